//! Rotary position embedding of V4.1 (spec §2.2): GPT-J (interleaved) pairs on the **last**
//! `rope_dim` dims of each head, f32 angles `f32(p) · inv_freq_i`, one frequency set per layer
//! kind: plain `rope_theta` for ratio-0 layers, YaRN over `compress_rope_theta` for compressed
//! layers. No YaRN attention mscale.
//!
//! Instead of a `[max_pos, rope_dim/2]` table (256 MB at 1M positions) the frequencies are kept
//! and `cos`/`sin` rows are computed for the positions of each call; the values are identical to
//! the reference's f32 outer-product table. The rows of one block of [`ROPE_BLOCK`] consecutive
//! positions are kept on the table's device, so a decode step slices them instead of uploading
//! positions and launching three kernels per layer (elementwise ops: the same values either way).

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor, D};

use crate::config::{Config, YarnScaling};

/// Which frequency set a layer uses.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeKind {
    /// `inv_freq_i = theta^(-2i/rope_dim)` (ratio-0 layers).
    Plain {
        /// RoPE base.
        theta: f64,
    },
    /// YaRN-interpolated frequencies over `theta` (layers with ratio != 0).
    Yarn {
        /// RoPE base (`compress_rope_theta`).
        theta: f64,
        /// YaRN parameters.
        scaling: YarnScaling,
    },
}

impl RopeKind {
    /// The frequency set of a layer with compress ratio `ratio` (spec §2.2: YaRN iff ratio != 0).
    pub fn for_ratio(cfg: &Config, ratio: usize) -> Self {
        match (ratio, &cfg.rope_scaling) {
            (0, _) | (_, None) => {
                let theta = if ratio == 0 { cfg.rope_theta } else { cfg.compress_rope_theta };
                RopeKind::Plain { theta }
            }
            (_, Some(s)) => RopeKind::Yarn { theta: cfg.compress_rope_theta, scaling: s.clone() },
        }
    }
}

/// The YaRN correction range `(low, high)` of spec §2.2 (15 and 25 for V4.1-Flash).
pub fn yarn_correction_range(rope_dim: usize, theta: f64, s: &YarnScaling) -> (f64, f64) {
    let corr = |rot: f64| {
        rope_dim as f64 * (s.original_max_position_embeddings as f64 / (2.0 * std::f64::consts::PI * rot)).ln()
            / (2.0 * theta.ln())
    };
    let low = corr(s.beta_fast).floor().max(0.0);
    let high = corr(s.beta_slow).ceil().min(rope_dim as f64 - 1.0);
    (low, high)
}

/// The per-pair inverse frequencies `[rope_dim/2]` in f32, as the reference computes them.
pub fn inv_freq(rope_dim: usize, kind: &RopeKind) -> Vec<f32> {
    let theta = match kind {
        RopeKind::Plain { theta } | RopeKind::Yarn { theta, .. } => *theta,
    };
    let half = rope_dim / 2;
    let base: Vec<f32> =
        (0..half).map(|i| 1.0f32 / (theta as f32).powf((2 * i) as f32 / rope_dim as f32)).collect();
    match kind {
        RopeKind::Plain { .. } => base,
        RopeKind::Yarn { scaling, .. } => {
            let (low, high) = yarn_correction_range(rope_dim, theta, scaling);
            let span = if high - low < 0.001 { 0.001 } else { high - low } as f32;
            let factor = scaling.factor as f32;
            base.iter()
                .enumerate()
                .map(|(i, &f)| {
                    let ramp = ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
                    f / factor * ramp + f * (1.0 - ramp)
                })
                .collect()
        }
    }
}

/// Positions per cached block of `cos`/`sin` rows (see [`RopeTable::cos_sin`]).
pub const ROPE_BLOCK: usize = 256;

/// The `cos`, `sin` and `−sin` rows `[ROPE_BLOCK, rope_dim/2]` f32 of positions
/// `first .. first + ROPE_BLOCK`.
#[derive(Debug)]
struct RopeBlock {
    first: usize,
    cos: Tensor,
    sin: Tensor,
    neg_sin: Tensor,
}

/// The `cos`, `sin` and `−sin` rows of the positions of one call, each `[T, rope_dim/2]` f32.
#[derive(Debug, Clone)]
pub struct RopeRows {
    /// `cos(f32(p)·inv_freq)`.
    pub cos: Tensor,
    /// `sin(f32(p)·inv_freq)`.
    pub sin: Tensor,
    /// `−sin(f32(p)·inv_freq)`: the inverse rotation's sine.
    pub neg_sin: Tensor,
}

/// The frequencies of one layer kind; produces `cos`/`sin` rows for given positions.
#[derive(Debug, Clone)]
pub struct RopeTable {
    rope_dim: usize,
    /// `[1, rope_dim/2]` f32.
    inv_freq: Tensor,
    /// The rows of the last block of consecutive positions asked for (shared by clones).
    block: Arc<Mutex<Option<RopeBlock>>>,
}

impl RopeTable {
    /// The frequencies of `kind` for `rope_dim` rotated dims (even).
    pub fn new(rope_dim: usize, kind: &RopeKind, device: &Device) -> Result<Self> {
        if rope_dim == 0 || !rope_dim.is_multiple_of(2) {
            candle_core::bail!("RopeTable: rope_dim must be even and > 0, got {rope_dim}")
        }
        let f = inv_freq(rope_dim, kind);
        Ok(Self { rope_dim, inv_freq: Tensor::from_vec(f, (1, rope_dim / 2), device)?, block: Arc::default() })
    }

    /// Number of rotated dims.
    pub fn rope_dim(&self) -> usize {
        self.rope_dim
    }

    /// `[1, rope_dim/2]` f32: the frequencies.
    pub fn inv_freq(&self) -> &Tensor {
        &self.inv_freq
    }

    /// `(cos, sin)`, each `[positions.len(), rope_dim/2]` f32, angle = `f32(p)·inv_freq` in f32.
    ///
    /// Consecutive positions inside one block of [`ROPE_BLOCK`] are views of that block's rows
    /// (computed once, on the table's device); other position lists are computed for the call.
    pub fn cos_sin(&self, positions: &[usize]) -> Result<(Tensor, Tensor)> {
        let r = self.rows(positions)?;
        Ok((r.cos, r.sin))
    }

    /// [`RopeTable::cos_sin`] with the inverse rotation's `−sin` as well.
    pub fn rows(&self, positions: &[usize]) -> Result<RopeRows> {
        let Some(&first) = positions.first() else { return self.compute(positions) };
        let consecutive = positions.iter().enumerate().all(|(i, &p)| p == first + i);
        let block = first - first % ROPE_BLOCK;
        if !consecutive || first + positions.len() > block + ROPE_BLOCK {
            return self.compute(positions);
        }
        let mut cached = self.block.lock().map_err(|_| candle_core::Error::Msg("RopeTable: poisoned block cache".into()))?;
        if cached.as_ref().is_none_or(|b| b.first != block) {
            let all: Vec<usize> = (block..block + ROPE_BLOCK).collect();
            let RopeRows { cos, sin, neg_sin } = self.compute(&all)?;
            *cached = Some(RopeBlock { first: block, cos, sin, neg_sin });
        }
        let Some(b) = cached.as_ref() else { return self.compute(positions) };
        let (off, n) = (first - block, positions.len());
        Ok(RopeRows { cos: b.cos.narrow(0, off, n)?, sin: b.sin.narrow(0, off, n)?, neg_sin: b.neg_sin.narrow(0, off, n)? })
    }

    /// The rows of the positions held in the device tensor `positions` (`[T]`, any integer or
    /// float dtype, on the table's device): the same f32 arithmetic as [`RopeTable::rows`]
    /// (`f32(p)·inv_freq`, then `cos` / `sin` on the device), with no host value involved, so a
    /// batched decode step can derive its rows from positions already on the device.
    pub fn rows_at(&self, positions: &Tensor) -> Result<RopeRows> {
        let t = positions.dims1()?;
        let p = positions.to_dtype(DType::F32)?.reshape((t, 1))?;
        let angles = p.broadcast_mul(&self.inv_freq)?;
        let sin = angles.sin()?;
        Ok(RopeRows { cos: angles.cos()?, neg_sin: sin.neg()?, sin })
    }

    /// The rows of `positions`, computed now.
    fn compute(&self, positions: &[usize]) -> Result<RopeRows> {
        let p: Vec<f32> = positions.iter().map(|&p| p as f32).collect();
        let p = Tensor::from_vec(p, (positions.len(), 1), self.inv_freq.device())?;
        let angles = p.broadcast_mul(&self.inv_freq)?;
        let sin = angles.sin()?;
        Ok(RopeRows { cos: angles.cos()?, neg_sin: sin.neg()?, sin })
    }

    /// Rotates the last `rope_dim` dims of `x` (`[T, H, d]` or `[T, d]`, any float dtype) by the
    /// angles of `positions[t]` (`positions.len() == T`), GPT-J pairs, in f32; `inverse` rotates
    /// by the conjugate. Returns the dtype of `x`.
    pub fn apply(&self, x: &Tensor, positions: &[usize], inverse: bool) -> Result<Tensor> {
        let r = self.rows(positions)?;
        apply_rope_tail(x, &r.cos, if inverse { &r.neg_sin } else { &r.sin })
    }
}

/// GPT-J rotation of the last `2·cos.dim(1)` dims of `x` (`[T, H, d]` or `[T, d]`) with per-token
/// `cos`/`sin` `[T, rope_dim/2]` f32. Computed in f32, returned in `x`'s dtype.
pub fn apply_rope_tail(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let squeeze = x.rank() == 2;
    let x3 = if squeeze { x.unsqueeze(1)? } else { x.clone() };
    let (t, h, d) = x3.dims3()?;
    let rd = 2 * cos.dim(1)?;
    if cos.dim(0)? != t || rd > d {
        candle_core::bail!("rope: x {:?} vs cos/sin {:?}", x.shape(), cos.shape())
    }
    let nope = x3.narrow(D::Minus1, 0, d - rd)?;
    let rot = x3.narrow(D::Minus1, d - rd, rd)?.to_dtype(DType::F32)?;
    // candle-nn's interleaved rope wants [b, h, t, d] with cos [b, t, d/2]: use b = T, t = 1.
    let rot = rot.reshape((t, h, 1, rd))?.contiguous()?;
    let cos = cos.reshape((t, 1, rd / 2))?.contiguous()?;
    let sin = sin.reshape((t, 1, rd / 2))?.contiguous()?;
    let rot = candle_nn::rotary_emb::rope_i(&rot, &cos, &sin)?.reshape((t, h, rd))?.to_dtype(x.dtype())?;
    let out = Tensor::cat(&[nope, rot], D::Minus1)?;
    if squeeze {
        out.squeeze(1)
    } else {
        Ok(out)
    }
}
