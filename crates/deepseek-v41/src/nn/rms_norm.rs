//! RMSNorm as the reference computes it (spec §2.1): `w ⊙ x / sqrt(mean(x²) + eps)` in f32,
//! cast back to the input dtype.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::VarBuilder;

/// RMSNorm over the last dim with a learned weight. V4.1 uses eps = 1e-20 everywhere.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// `[dim]`, f32.
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Loads `<prefix>.weight` of shape `[dim]`.
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints_dtype(dim, "weight", Default::default(), DType::F32)?;
        Ok(Self { weight, eps })
    }

    /// Builds the norm from a weight tensor `[dim]`.
    pub fn from_weight(weight: Tensor, eps: f64) -> Result<Self> {
        Ok(Self { weight: weight.to_dtype(DType::F32)?, eps })
    }

    /// The learned weight `[dim]`, f32 (for fused kernels that apply the norm themselves).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

/// Weightless RMS normalisation factor-free helper: `x / sqrt(mean(x²) + eps)` in f32 (f32 out).
pub fn rms_normalize_f32(x: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)
}

impl Module for RmsNorm {
    /// `x`: `[..., dim]` in any float dtype; returns the same shape and dtype.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dim = x.dim(D::Minus1)?;
        if dim != self.weight.dim(0)? {
            candle_core::bail!("RmsNorm: input last dim {dim} != weight dim {}", self.weight.dim(0)?)
        }
        #[cfg(feature = "cuda")]
        if crate::cuda::fused_kernels(x.device()) && crate::cuda::row_norm_supported(x) {
            // One launch, bit for bit the op sequence below.
            return crate::cuda::rms_norm_device(x, &self.weight, self.eps);
        }
        rms_normalize_f32(x, self.eps)?.broadcast_mul(&self.weight)?.to_dtype(x.dtype())
    }
}
