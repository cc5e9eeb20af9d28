//! mHC hyper-connections (spec §3.2): the residual stream is `hc` parallel copies `[T, hc, D]`;
//! each sublayer computes mixing coefficients from its input stream, collapses the stream into
//! one sublayer input, and writes the sublayer output back into all copies.
//!
//! V4.1 staggers the coefficients (spec §3.2, §14 item 9): the *pre* a sublayer computes is used
//! by the next sublayer's [`collapse`]; *post* and *comb* are used by the same sublayer's
//! [`post`]. The wiring lives in the decoder layer; this file holds the three operations.

use candle_core::{DType, Result, Tensor, D};
use candle_nn::VarBuilder;

use crate::config::Config;

/// Which sublayer's mixing weights to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HcSublayer {
    /// `hc_attn_{fn,base,scale}`.
    Attn,
    /// `hc_ffn_{fn,base,scale}`.
    Ffn,
}

impl HcSublayer {
    fn prefix(self) -> &'static str {
        match self {
            HcSublayer::Attn => "hc_attn",
            HcSublayer::Ffn => "hc_ffn",
        }
    }
}

/// The coefficients one sublayer computes from its input stream (all f32).
#[derive(Debug, Clone)]
pub struct HcCoeffs {
    /// `[T, hc]` f32: collapse weights, used by the *next* sublayer.
    pub pre: Tensor,
    /// `[T, hc]` f32: how much of the sublayer output each copy receives.
    pub post: Tensor,
    /// `[T, hc, hc]` f32, doubly-(near-)stochastic: `comb[t, i, j]` moves residual copy `i` into
    /// output copy `j`.
    pub comb: Tensor,
}

/// The mixing weights of one sublayer: `layers.N.hc_{attn,ffn}_{fn,base,scale}`.
#[derive(Debug, Clone)]
pub struct HcMix {
    /// `[(2+hc)·hc, hc·D]` f32.
    func: Tensor,
    /// `[(2+hc)·hc]` f32.
    base: Tensor,
    /// `[3]` f32: scales of the pre, post and comb parts.
    scale: Tensor,
    hc: usize,
    sinkhorn_iters: usize,
    hc_eps: f64,
    norm_eps: f64,
}

impl HcMix {
    /// Loads `hc_{attn,ffn}_fn` `[(2+hc)·hc, hc·D]`, `_base` `[(2+hc)·hc]` and `_scale` `[3]`
    /// (all f32) from `vb` = `layers.N`.
    pub fn new(cfg: &Config, vb: VarBuilder, which: HcSublayer) -> Result<Self> {
        let hc = cfg.hc_mult;
        let mix = (2 + hc) * hc;
        let p = which.prefix();
        let hints = Default::default();
        let func = vb.get_with_hints_dtype((mix, hc * cfg.hidden_size), &format!("{p}_fn"), hints, DType::F32)?;
        let base = vb.get_with_hints_dtype(mix, &format!("{p}_base"), hints, DType::F32)?;
        let scale = vb.get_with_hints_dtype(3, &format!("{p}_scale"), hints, DType::F32)?;
        Ok(Self {
            func,
            base,
            scale,
            hc,
            sinkhorn_iters: cfg.hc_sinkhorn_iters,
            hc_eps: cfg.hc_eps,
            norm_eps: cfg.rms_norm_eps,
        })
    }

    /// Spec §3.2 steps 1–8 for the stream `x` `[T, hc, D]` (bf16; any float dtype): the raw
    /// mixes `(x·fnᵀ)·rsqrt(mean(x²) + rms_norm_eps)` over all `hc·D` elements in f32, then
    /// [`split_sinkhorn`].
    pub fn mixes(&self, x: &Tensor) -> Result<HcCoeffs> {
        let (t, hc, d) = x.dims3()?;
        if hc != self.hc || hc * d != self.func.dim(1)? {
            candle_core::bail!("HcMix::mixes: stream {:?} does not match hc_fn {:?}", x.shape(), self.func.shape())
        }
        let xf = x.reshape((t, hc * d))?.to_dtype(DType::F32)?;
        let rsqrt = (xf.sqr()?.mean_keepdim(D::Minus1)? + self.norm_eps)?.sqrt()?.recip()?;
        let func = self.func.to_device(xf.device())?;
        let mixes = xf.matmul(&func.t()?)?.broadcast_mul(&rsqrt)?;
        split_sinkhorn(&mixes, &self.scale, &self.base, self.hc, self.sinkhorn_iters, self.hc_eps)
    }
}

/// Spec §3.2 steps 2–8: splits the raw mixes `[T, (2+hc)·hc]` f32 (already rsqrt-scaled) with
/// `scale` `[3]` f32 and `base` `[(2+hc)·hc]` f32 into pre `σ(·)+eps`, post `2σ(·)` and comb:
/// row softmax `+eps`, a column normalization, then `iters−1` (row, column) normalizations, eps
/// inside every division.
pub fn split_sinkhorn(
    mixes: &Tensor,
    scale: &Tensor,
    base: &Tensor,
    hc: usize,
    iters: usize,
    eps: f64,
) -> Result<HcCoeffs> {
    let (t, width) = mixes.dims2()?;
    if width != (2 + hc) * hc || base.dims1()? != width || scale.dims1()? != 3 || iters == 0 {
        candle_core::bail!(
            "split_sinkhorn: mixes {:?}, base {:?}, scale {:?} do not fit hc {hc} (iters {iters})",
            mixes.shape(),
            base.shape(),
            scale.shape()
        )
    }
    let dev = mixes.device();
    let m = mixes.to_dtype(DType::F32)?;
    let base = base.to_device(dev)?.to_dtype(DType::F32)?;
    let scale = scale.to_device(dev)?.to_dtype(DType::F32)?;
    let part = |start: usize, len: usize, s: usize| -> Result<Tensor> {
        m.narrow(1, start, len)?.broadcast_mul(&scale.narrow(0, s, 1)?)?.broadcast_add(&base.narrow(0, start, len)?)
    };
    let pre = (candle_nn::ops::sigmoid(&part(0, hc, 0)?)? + eps)?;
    let post = (candle_nn::ops::sigmoid(&part(hc, hc, 1)?)? * 2.0)?;
    let comb = part(2 * hc, hc * hc, 2)?.reshape((t, hc, hc))?;
    let mut comb = (candle_nn::ops::softmax_last_dim(&comb)? + eps)?;
    let col_norm = |c: &Tensor| -> Result<Tensor> { c.broadcast_div(&(c.sum_keepdim(1)? + eps)?) };
    let row_norm = |c: &Tensor| -> Result<Tensor> { c.broadcast_div(&(c.sum_keepdim(2)? + eps)?) };
    comb = col_norm(&comb)?;
    for _ in 1..iters {
        comb = col_norm(&row_norm(&comb)?)?;
    }
    Ok(HcCoeffs { pre, post, comb })
}

/// Collapse (spec §3.2): `Σ_k pre[t,k]·x[t,k,:]` accumulated in f32, returned in `x`'s dtype.
/// `x`: `[T, hc, D]` (bf16); `pre`: `[T, hc]` f32. Returns `[T, D]`.
pub fn collapse(x: &Tensor, pre: &Tensor) -> Result<Tensor> {
    let (t, hc, _) = x.dims3()?;
    if pre.dims() != [t, hc] {
        candle_core::bail!("mHC collapse: pre {:?} does not fit stream {:?}", pre.shape(), x.shape())
    }
    let pre = pre.to_dtype(DType::F32)?.unsqueeze(2)?;
    x.to_dtype(DType::F32)?.broadcast_mul(&pre)?.sum(1)?.to_dtype(x.dtype())
}

/// Post (spec §3.2): `out[t,j,:] = post[t,j]·y[t,:] + Σ_i comb[t,i,j]·x[t,i,:]` in f32 (the
/// residual sits on comb's **first**, summed index), returned in `x`'s dtype.
/// `y`: `[T, D]` sublayer output (bf16); `x`: `[T, hc, D]` stream (bf16); `post`: `[T, hc]` f32;
/// `comb`: `[T, hc, hc]` f32. Returns `[T, hc, D]`.
pub fn post(y: &Tensor, x: &Tensor, post: &Tensor, comb: &Tensor) -> Result<Tensor> {
    let (t, hc, d) = x.dims3()?;
    if y.dims() != [t, d] || post.dims() != [t, hc] || comb.dims() != [t, hc, hc] {
        candle_core::bail!(
            "mHC post: y {:?}, post {:?}, comb {:?} do not fit stream {:?}",
            y.shape(),
            post.shape(),
            comb.shape(),
            x.shape()
        )
    }
    // Σ_i comb[i, j]·x[i] = (combᵀ · x)[j], per token.
    let comb_t = comb.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?;
    let mixed = comb_t.matmul(&x.to_dtype(DType::F32)?)?;
    let direct = post.to_dtype(DType::F32)?.unsqueeze(2)?.broadcast_mul(&y.to_dtype(DType::F32)?.unsqueeze(1)?)?;
    (direct + mixed)?.to_dtype(x.dtype())
}
