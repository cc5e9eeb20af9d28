//! mHC hyper-connections (spec §3.2): the residual stream is `hc` parallel copies `[T, hc, D]`;
//! each sublayer computes mixing coefficients from its input stream, collapses the stream into
//! one sublayer input, and writes the sublayer output back into all copies.
//!
//! V4.1 staggers the coefficients (spec §3.2, §14 item 9): the *pre* a sublayer computes is used
//! by the next sublayer's [`collapse`]; *post* and *comb* are used by the same sublayer's
//! [`post`]. The wiring lives in the decoder layer; this file holds the three operations and the
//! fused [`collapse_norm`] / [`post_collapse_norm`] (one launch on CUDA where a collapse feeds a norm).

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::VarBuilder;

use crate::config::Config;
use crate::nn::{grouped_matmul, RmsNorm, RowGroups};

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
        let func = vb.get_with_hints_dtype(
            (mix, hc * cfg.hidden_size),
            &format!("{p}_fn"),
            hints,
            DType::F32,
        )?;
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
        self.mixes_grouped(x, &RowGroups::whole(x.dim(0)?))
    }

    /// [`HcMix::mixes`] of a stream holding the tokens of several sequences split as `groups`:
    /// on the CPU each sequence's mixes are bit for bit those of its own call
    /// ([`grouped_matmul`]).
    pub fn mixes_grouped(&self, x: &Tensor, groups: &RowGroups) -> Result<HcCoeffs> {
        let (t, hc, d) = x.dims3()?;
        if hc != self.hc || hc * d != self.func.dim(1)? {
            candle_core::bail!(
                "HcMix::mixes: stream {:?} does not match hc_fn {:?}",
                x.shape(),
                self.func.shape()
            )
        }
        let x2 = x.reshape((t, hc * d))?;
        #[cfg(feature = "cuda")]
        if crate::cuda::fused_kernels(x.device()) && !crate::cuda::unfused("mhc_mixes") && crate::cuda::mhc_mixes_supported(&x2, hc) {
            // One launch: the product's f32 sums in the kernel's order (like cuBLAS's, not the
            // CPU's), the split bit for bit the one below (kernels/mhc_mixes.cu).
            let (pre, post, comb) = crate::cuda::mhc_mixes_device(
                &x2,
                &self.func,
                &self.scale,
                &self.base,
                hc,
                self.sinkhorn_iters,
                self.hc_eps,
                self.norm_eps,
                None,
            )?;
            return Ok(HcCoeffs { pre, post, comb });
        }
        #[cfg(feature = "cuda")]
        let (xf, rsqrt) = if crate::cuda::fused_kernels(x.device()) && crate::cuda::row_norm_supported(&x2) {
            // One launch, bit for bit the op sequence below.
            crate::cuda::rms_scale_device(&x2, self.norm_eps)?
        } else {
            rms_scale(&x2, self.norm_eps)?
        };
        #[cfg(not(feature = "cuda"))]
        let (xf, rsqrt) = rms_scale(&x2, self.norm_eps)?;
        let func = self.func.to_device(xf.device())?;
        let mixes = grouped_matmul(&xf, &func.t()?, groups)?.broadcast_mul(&rsqrt)?;
        split_sinkhorn(
            &mixes,
            &self.scale,
            &self.base,
            self.hc,
            self.sinkhorn_iters,
            self.hc_eps,
        )
    }
}

/// `(f32(x), 1 / sqrt(mean(x²) + eps))` of the rows of `x` `[T, n]`: `[T, n]` and `[T, 1]` f32.
fn rms_scale(x: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let xf = x.to_dtype(DType::F32)?;
    let rsqrt = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    Ok((xf, rsqrt))
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
    #[cfg(feature = "cuda")]
    if crate::cuda::fused_kernels(dev) && hc <= crate::cuda::MHC_MAX_HC {
        // One launch instead of the ~130 tiny kernels of the op sequence below; bit for bit equal.
        let (pre, post, comb) = crate::cuda::split_sinkhorn_device(mixes, scale, base, hc, iters, eps)?;
        return Ok(HcCoeffs { pre, post, comb });
    }
    let m = mixes.to_dtype(DType::F32)?;
    let base = base.to_device(dev)?.to_dtype(DType::F32)?;
    let scale = scale.to_device(dev)?.to_dtype(DType::F32)?;
    let part = |start: usize, len: usize, s: usize| -> Result<Tensor> {
        m.narrow(1, start, len)?
            .broadcast_mul(&scale.narrow(0, s, 1)?)?
            .broadcast_add(&base.narrow(0, start, len)?)
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
        candle_core::bail!(
            "mHC collapse: pre {:?} does not fit stream {:?}",
            pre.shape(),
            x.shape()
        )
    }
    #[cfg(feature = "cuda")]
    if crate::cuda::fused_kernels(x.device()) && crate::cuda::collapse_supported(x) {
        // One launch, bit for bit the op sequence below.
        return crate::cuda::collapse_device(x, pre);
    }
    let pre = pre.to_dtype(DType::F32)?.unsqueeze(2)?;
    x.to_dtype(DType::F32)?
        .broadcast_mul(&pre)?
        .sum(1)?
        .to_dtype(x.dtype())
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
    #[cfg(feature = "cuda")]
    if crate::cuda::fused_kernels(x.device()) && !crate::cuda::unfused("mhc_post") && crate::cuda::mhc_post_supported(x, y, x.dtype()) {
        // One launch, bit for bit the op sequence below as the CPU computes it (the comb
        // product one FMA chain over the copies: `post_is_one_fma_chain_over_the_copies`).
        return crate::cuda::mhc_post_device(x, comb, y, post, x.dtype());
    }
    // Σ_i comb[i, j]·x[i] = (combᵀ · x)[j], per token.
    let comb_t = comb.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?;
    let mixed = comb_t.matmul(&x.to_dtype(DType::F32)?)?;
    let direct = post
        .to_dtype(DType::F32)?
        .unsqueeze(2)?
        .broadcast_mul(&y.to_dtype(DType::F32)?.unsqueeze(1)?)?;
    (direct + mixed)?.to_dtype(x.dtype())
}

/// The sublayer input `norm(collapse(x, pre))` (spec §3.2, then the sublayer's RMSNorm), in
/// `x`'s dtype. On CUDA one launch ([`crate::cuda::collapse_norm_device`]), bit for bit the two
/// ops.
pub fn collapse_norm(x: &Tensor, pre: &Tensor, norm: &RmsNorm) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if fused_norm(x, None) && pre.dims() == [x.dim(0)?, x.dim(1)?] {
        return crate::cuda::collapse_norm_device(x, pre, norm.weight(), norm.eps());
    }
    norm.forward(&collapse(x, pre)?)
}

/// A sublayer's post and the next sublayer's input: `(x1, norm(collapse(x1, pre)))` with
/// `x1 = post(y, x, post_w, comb)` (the next collapse's weights `pre` are known before the post:
/// the staggered wiring of spec §3.2). On CUDA one launch
/// ([`crate::cuda::mhc_post_norm_device`]), bit for bit [`post`], [`collapse`] and the norm.
pub fn post_collapse_norm(y: &Tensor, x: &Tensor, post_w: &Tensor, comb: &Tensor, pre: &Tensor, norm: &RmsNorm) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if fused_norm(x, Some(y)) && !crate::cuda::unfused("mhc_post") {
        let (t, hc, d) = x.dims3()?;
        if y.dims() == [t, d] && post_w.dims() == [t, hc] && comb.dims() == [t, hc, hc] && pre.dims() == [t, hc] {
            return crate::cuda::mhc_post_norm_device(x, comb, y, post_w, pre, norm.weight(), norm.eps());
        }
    }
    let x1 = post(y, x, post_w, comb)?;
    let h = collapse_norm(&x1, pre, norm)?;
    Ok((x1, h))
}

/// Whether the fused collapse-norm kernels run for this stream (and sublayer output).
#[cfg(feature = "cuda")]
fn fused_norm(x: &Tensor, y: Option<&Tensor>) -> bool {
    crate::cuda::fused_kernels(x.device()) && !crate::cuda::unfused("mhc_norm") && crate::cuda::mhc_norm_supported(x, y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn bf16_round(v: f32) -> f32 {
        half::bf16::from_f32(v).to_f32()
    }

    /// Dyadic values so every product and sum below is exact in f32 (outputs are rounded to bf16).
    fn setup() -> Result<(Tensor, Tensor, Tensor, Tensor, Tensor)> {
        let dev = Device::Cpu;
        let (t, hc, d) = (2usize, 4usize, 3usize);
        let x: Vec<f32> = (0..t * hc * d).map(|i| (i as f32 - 10.0) * 0.25).collect();
        let x = Tensor::from_vec(x, (t, hc, d), &dev)?.to_dtype(DType::BF16)?;
        let y = Tensor::from_vec(
            (0..t * d).map(|i| i as f32 * 0.5 - 1.0).collect::<Vec<_>>(),
            (t, d),
            &dev,
        )?
        .to_dtype(DType::BF16)?;
        let pre = Tensor::from_vec(
            (0..t * hc)
                .map(|i| (i % 5) as f32 * 0.125)
                .collect::<Vec<_>>(),
            (t, hc),
            &dev,
        )?;
        let post = Tensor::from_vec(
            (0..t * hc)
                .map(|i| 2.0 - i as f32 * 0.25)
                .collect::<Vec<_>>(),
            (t, hc),
            &dev,
        )?;
        // A deliberately non-symmetric comb.
        let comb: Vec<f32> = (0..t * hc * hc)
            .map(|i| ((i * 7) % 11) as f32 * 0.0625)
            .collect();
        let comb = Tensor::from_vec(comb, (t, hc, hc), &dev)?;
        Ok((x, y, pre, post, comb))
    }

    #[test]
    fn collapse_by_hand() -> Result<()> {
        let (x, _, pre, _, _) = setup()?;
        let got = collapse(&x, &pre)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let xv = x.to_dtype(DType::F32)?.to_vec3::<f32>()?;
        let pv = pre.to_vec2::<f32>()?;
        for t in 0..2 {
            for c in 0..3 {
                let want = bf16_round((0..4).map(|k| pv[t][k] * xv[t][k][c]).sum());
                assert_eq!(got[t][c], want, "t {t} c {c}");
            }
        }
        Ok(())
    }

    #[test]
    fn post_sums_comb_first_index() -> Result<()> {
        let (x, y, _, p, comb) = setup()?;
        let got = post(&y, &x, &p, &comb)?
            .to_dtype(DType::F32)?
            .to_vec3::<f32>()?;
        let (xv, yv) = (
            x.to_dtype(DType::F32)?.to_vec3::<f32>()?,
            y.to_dtype(DType::F32)?.to_vec2::<f32>()?,
        );
        let (pv, cv) = (p.to_vec2::<f32>()?, comb.to_vec3::<f32>()?);
        let mut transposed_differs = false;
        for t in 0..2 {
            for j in 0..4 {
                for c in 0..3 {
                    let want = pv[t][j] * yv[t][c]
                        + (0..4).map(|i| cv[t][i][j] * xv[t][i][c]).sum::<f32>();
                    assert_eq!(got[t][j][c], bf16_round(want), "t {t} copy {j} c {c}");
                    // Negative control: the residual on comb's second index.
                    let wrong = pv[t][j] * yv[t][c]
                        + (0..4).map(|i| cv[t][j][i] * xv[t][i][c]).sum::<f32>();
                    transposed_differs |= (wrong - want).abs() > 0.1;
                }
            }
        }
        assert!(
            transposed_differs,
            "the test comb does not distinguish comb from its transpose"
        );
        Ok(())
    }

    /// The CPU reference's comb product is one f32 FMA chain over the residual copies,
    /// `((c0·x0) ⊕fma c1·x1) ⊕fma …`, then `post·y` added: the order `kernels/decoder_ops.cu`'s
    /// post kernel computes, so the kernel equals the reference bit for bit at every width
    /// (cuBLAS's SGEMM sums K = hc in pairs at small widths: another order). f32 outputs, so
    /// no final rounding hides a different order (the pairwise order differs in ~30 % of them).
    #[test]
    fn post_is_one_fma_chain_over_the_copies() -> Result<()> {
        let dev = Device::Cpu;
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut r = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / 2f32.powi(31)) * 2.0 - 1.0
        };
        for (t, hc, d) in [(1usize, 4usize, 192usize), (3, 4, 192), (2, 4, 5120), (2, 3, 7)] {
            let x: Vec<f32> = (0..t * hc * d).map(|_| r() * 3.0).collect();
            let y: Vec<f32> = (0..t * d).map(|_| r() * 3.0).collect();
            let p: Vec<f32> = (0..t * hc).map(|_| r()).collect();
            let c: Vec<f32> = (0..t * hc * hc).map(|_| r().abs()).collect();
            let xt = Tensor::from_vec(x, (t, hc, d), &dev)?.to_dtype(DType::BF16)?;
            let yt = Tensor::from_vec(y, (t, d), &dev)?.to_dtype(DType::BF16)?;
            let (pt, ct) = (Tensor::from_vec(p.clone(), (t, hc), &dev)?, Tensor::from_vec(c.clone(), (t, hc, hc), &dev)?);
            let got = post(&yt, &xt.to_dtype(DType::F32)?, &pt, &ct)?.flatten_all()?.to_vec1::<f32>()?;
            let (xv, yv) = (xt.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, yt.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            let (mut chain_differs, mut pairs_differ) = (0usize, 0usize);
            for tt in 0..t {
                for j in 0..hc {
                    for cc in 0..d {
                        let term = |i: usize| (c[(tt * hc + i) * hc + j], xv[(tt * hc + i) * d + cc]);
                        let (c0, x0) = term(0);
                        let mixed = (1..hc).fold(c0 * x0, |m, i| {
                            let (ci, xi) = term(i);
                            ci.mul_add(xi, m)
                        });
                        let direct = p[tt * hc + j] * yv[tt * d + cc];
                        let pairs = (0..hc).step_by(2).map(|i| (0..2).filter(|k| i + k < hc).map(|k| term(i + k).0 * term(i + k).1).sum::<f32>()).sum::<f32>();
                        let g = got[(tt * hc + j) * d + cc];
                        chain_differs += (g != direct + mixed) as usize;
                        pairs_differ += (g != direct + pairs) as usize;
                    }
                }
            }
            assert_eq!(chain_differs, 0, "T {t}, hc {hc}, d {d}: the CPU post is not the FMA chain");
            assert!(pairs_differ > 0, "T {t}, hc {hc}, d {d}: the test cannot tell the chain from pairwise sums");
        }
        Ok(())
    }

    #[test]
    fn sinkhorn_identity_mixes() -> Result<()> {
        // Zero mixes and zero base: uniform comb 1/4, pre σ(0)+eps, post 1.
        let dev = Device::Cpu;
        let m = Tensor::zeros((1, 24), DType::F32, &dev)?;
        let c = split_sinkhorn(
            &m,
            &Tensor::ones(3, DType::F32, &dev)?,
            &Tensor::zeros(24, DType::F32, &dev)?,
            4,
            20,
            1e-6,
        )?;
        for v in c.comb.flatten_all()?.to_vec1::<f32>()? {
            assert!((v - 0.25).abs() < 1e-5);
        }
        for v in c.pre.flatten_all()?.to_vec1::<f32>()? {
            assert!((v - (0.5 + 1e-6)).abs() < 1e-7);
        }
        for v in c.post.flatten_all()?.to_vec1::<f32>()? {
            assert!((v - 1.0).abs() < 1e-7);
        }
        assert!(split_sinkhorn(
            &m,
            &Tensor::ones(3, DType::F32, &dev)?,
            &Tensor::zeros(24, DType::F32, &dev)?,
            3,
            20,
            1e-6
        )
        .is_err());
        Ok(())
    }
}
