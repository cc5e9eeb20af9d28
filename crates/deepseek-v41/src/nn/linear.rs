//! The reference's linear operator (spec §0.1b.8, §2.5).
//!
//! The weight ([`LinearWeight`]) is dense `[out, in]` (dequantized, exact in bf16 for FP8 and
//! MXFP4 checkpoints; f32 on the CPU), or — for a quantized linear on CUDA — an FP8 weight kept
//! in its release format and multiplied by the FP8 kernels, or an MXFP4 weight kept in its
//! release format and dequantized on the device for each product (`nn/linear_weight.rs`).
//! A [`LinearKind::Quantized`] linear (FP8/FP4 weights in the release) quantizes its input per
//! 1x32 block to e4m3 when [`Numerics::activation_quant`] is on; the plain kinds never do. Every
//! product is accumulated in f32; the output is rounded to the activation dtype, or kept in f32
//! for [`LinearKind::F32`] (MoE gate, ratio-2 compressor, head, mHC mixes).

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::linear_weight::{dense_product, fp8_product, mxfp4_product, LinearWeight};
use super::row_groups::{grouped_matmul, RowGroups};
use crate::numerics::Numerics;
use crate::quant::{fp8_activation_quant, Fp8Weight, Mxfp4Weight};

/// How a linear computes, mirroring the reference's three linear flavours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearKind {
    /// FP8/FP4 weight: activation quantization (if enabled), f32 accumulation, output in the
    /// input's dtype.
    Quantized,
    /// BF16 weight, no activation quantization, output in the input's dtype.
    Plain,
    /// Computed and returned in f32.
    F32,
}

/// A bias-free linear `y = x·Wᵀ`.
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out, in]`: dense (f32 on CPU, the model dtype elsewhere), or FP8 / MXFP4 as stored.
    weight: LinearWeight,
    kind: LinearKind,
    quantize_input: bool,
}

/// Linears with their checkpoint prefixes, as the modules' `linears()` list them: relative to
/// the module's var builder (`wq_a`, `attn.wq_a`, `layers.3.attn.wq_a`, ...).
pub type NamedLinears<'a> = Vec<(String, &'a Linear)>;

/// `(name, linear)` pairs as [`NamedLinears`].
pub fn named<'a, const N: usize>(linears: [(&str, &'a Linear); N]) -> NamedLinears<'a> {
    linears.into_iter().map(|(n, l)| (n.to_string(), l)).collect()
}

/// `linears` with `prefix.` put before every name.
pub fn prefixed<'a>(prefix: &str, linears: NamedLinears<'a>) -> NamedLinears<'a> {
    linears.into_iter().map(|(n, l)| (format!("{prefix}.{n}"), l)).collect()
}

/// The dtype weights are held in for computing on `device`: f32 on CPU (the reference's f32
/// accumulation without per-call casts), `dtype` on accelerators.
pub fn compute_dtype(device: &Device, dtype: DType) -> DType {
    if device.is_cpu() {
        DType::F32
    } else {
        dtype
    }
}

impl Linear {
    /// Loads `<prefix>.weight` `[out, in]` ([`LinearWeight::load`]: dequantized by the
    /// checkpoint backend, or the FP8 / MXFP4 weight as stored for a quantized linear on CUDA
    /// when the backend offers it).
    pub fn new(in_dim: usize, out_dim: usize, kind: LinearKind, numerics: Numerics, vb: VarBuilder) -> Result<Self> {
        Ok(Self::with_weight(LinearWeight::load(in_dim, out_dim, kind, &vb)?, kind, numerics))
    }

    /// Wraps a dense weight `[out, in]`.
    pub fn from_weight(weight: Tensor, kind: LinearKind, numerics: Numerics) -> Self {
        Self::with_weight(LinearWeight::Dense(weight), kind, numerics)
    }

    /// A [`LinearKind::Quantized`] linear over an FP8 weight kept as stored. On CUDA (feature
    /// `cuda`) it runs the FP8 kernels; on the CPU every call dequantizes the weight to f32 (the
    /// reference [`crate::quant::fp8_linear_ref`], bit for bit).
    pub fn from_fp8(weight: Fp8Weight, numerics: Numerics) -> Self {
        Self::with_weight(LinearWeight::Fp8(weight), LinearKind::Quantized, numerics)
    }

    /// A [`LinearKind::Quantized`] linear over an MXFP4 weight kept as stored. Every product
    /// dequantizes the weight (on CUDA, feature `cuda`: one kernel into a bf16 scratch; on the CPU
    /// to f32) and runs the dense path's matmul: bit for bit the dense linear over the
    /// dequantized weight ([`crate::quant::mxfp4_linear_ref`] on the CPU).
    pub fn from_mxfp4(weight: Mxfp4Weight, numerics: Numerics) -> Self {
        Self::with_weight(LinearWeight::Mxfp4(weight), LinearKind::Quantized, numerics)
    }

    fn with_weight(weight: LinearWeight, kind: LinearKind, numerics: Numerics) -> Self {
        let quantize_input = kind == LinearKind::Quantized && numerics.activation_quant;
        Self { weight, kind, quantize_input }
    }

    /// The FP8 weight when [`Module::forward`] of an input on `device` in `dtype` quantizes it
    /// inside the FP8 kernel: an FP8 weight that quantizes its input, a bf16 input on CUDA, an
    /// input width that is a multiple of 32.
    pub(super) fn fused_fp8(&self, device: &candle_core::Device, dtype: DType) -> Option<&crate::quant::Fp8Weight> {
        match &self.weight {
            LinearWeight::Fp8(w) if self.quantize_input && device.is_cuda() && dtype == DType::BF16 && w.dims().1.is_multiple_of(32) => Some(w),
            _ => None,
        }
    }

    /// Whether [`Module::forward`] of a contiguous `[rows, in]` input on `device` in `dtype` is
    /// launches of the crate's FP8 streaming kernel only, with no Candle op (what a
    /// [`crate::cuda::SideStream`] branch needs): the fused activation ([`Linear::fused_fp8`]),
    /// the fused kernels on, and few enough rows for the streaming path.
    #[cfg(feature = "cuda")]
    pub(crate) fn forward_is_kernels_only(&self, device: &candle_core::Device, dtype: DType, rows: usize) -> bool {
        self.fused_fp8(device, dtype).is_some() && crate::cuda::fused_kernels(device) && rows >= 1 && crate::cuda::auto_streams(rows)
    }

    /// The same linear (kind, input quantization) over another FP8 weight of its shape: the views
    /// of a stacked weight ([`super::LinearPair`]).
    pub(super) fn with_fp8(&self, weight: crate::quant::Fp8Weight) -> Self {
        Self { weight: LinearWeight::Fp8(weight), kind: self.kind, quantize_input: self.quantize_input }
    }

    /// Whether the linear quantizes its input ([`Linear::prepare_input`]).
    pub(super) fn quantizes_input(&self) -> bool {
        self.quantize_input
    }

    /// The weight `[out, in]`, dense, FP8 or MXFP4 ([`LinearWeight::to_dense`] gives a dense copy
    /// of any).
    pub fn weight(&self) -> &LinearWeight {
        &self.weight
    }

    /// The linear's kind.
    pub fn kind(&self) -> LinearKind {
        self.kind
    }

    /// The device the weight lives on.
    pub fn device(&self) -> &Device {
        self.weight.device()
    }

    /// The input this linear's product consumes for `x` `[..., in]`: the FP8 activation
    /// quantization of `x` when the linear quantizes its input, else `x` (same shape and dtype).
    ///
    /// Linears of the same kind and numerics fed the same activation can share it through
    /// [`Linear::forward_prepared`] (one quantization instead of one per linear; the
    /// quantization is per row, so rows selected from it equal the quantization of the
    /// selected rows).
    pub fn prepare_input(&self, x: &Tensor) -> Result<Tensor> {
        if self.quantize_input {
            fp8_activation_quant(x)
        } else {
            Ok(x.clone())
        }
    }

    /// [`Module::forward`] of an input already passed through [`Linear::prepare_input`] (of this
    /// linear, or of one with the same kind and numerics): `xp` `[..., in]`; returns `[..., out]`
    /// in `xp`'s dtype (f32 for [`LinearKind::F32`]). Bit for bit `forward(x)` when
    /// `xp = prepare_input(x)`, for a dense or MXFP4 weight; for an FP8 weight on CUDA up to the
    /// kernels' f32 summation order (the quantized values are the same).
    pub fn forward_prepared(&self, xp: &Tensor) -> Result<Tensor> {
        let out_dtype = if self.kind == LinearKind::F32 { DType::F32 } else { xp.dtype() };
        let y = match &self.weight {
            #[cfg(feature = "cuda")]
            LinearWeight::Dense(w) if self.kind == LinearKind::F32 && crate::cuda::fused_kernels(xp.device()) && !crate::cuda::unfused("f32_linear") => {
                // Decode sizes: one launch over x in its own dtype (cuda::f32_linear_device;
                // its f32 sums in the kernel's order, like cuBLAS's not the CPU's).
                let k = w.dim(1)?;
                let lead = &xp.dims()[..xp.rank().saturating_sub(1)];
                let x2 = xp.reshape((lead.iter().product::<usize>(), k));
                match x2 {
                    Ok(x2) if xp.rank() >= 2 && xp.dims().last() == Some(&k) && crate::cuda::f32_linear_supported(&x2, w) => {
                        let mut shape = lead.to_vec();
                        shape.push(w.dim(0)?);
                        crate::cuda::f32_linear_device(&x2, w)?.reshape(shape)?
                    }
                    _ => dense_product(xp, w)?,
                }
            }
            LinearWeight::Dense(w) => dense_product(xp, w)?,
            LinearWeight::Fp8(w) => fp8_product(xp, w, false)?,
            LinearWeight::Mxfp4(w) => mxfp4_product(xp, w)?,
        };
        y.to_dtype(out_dtype)
    }

    /// [`Module::forward`] of `x` `[m, in]` holding the rows of several sequences split as
    /// `groups`: on the CPU with a dense weight each group's rows are bit for bit those of the
    /// group's own call ([`grouped_matmul`]); otherwise (one whole group, a CUDA device, an FP8 or
    /// MXFP4 weight) exactly `forward(x)`.
    pub fn forward_grouped(&self, x: &Tensor, groups: &RowGroups) -> Result<Tensor> {
        if self.groups_apply(x, groups) {
            return self.forward_prepared_grouped(&self.prepare_input(x)?, groups);
        }
        self.forward(x)
    }

    /// [`Linear::forward_prepared`] of `xp` `[m, in]` split as `groups`, as
    /// [`Linear::forward_grouped`].
    pub fn forward_prepared_grouped(&self, xp: &Tensor, groups: &RowGroups) -> Result<Tensor> {
        match &self.weight {
            LinearWeight::Dense(w) if self.groups_apply(xp, groups) => {
                let out_dtype = if self.kind == LinearKind::F32 { DType::F32 } else { xp.dtype() };
                grouped_matmul(&xp.to_dtype(w.dtype())?, &w.t()?, groups)?.to_dtype(out_dtype)
            }
            _ => self.forward_prepared(xp),
        }
    }

    /// Whether a grouped call differs from the plain one: several groups, a dense weight, the CPU.
    fn groups_apply(&self, x: &Tensor, groups: &RowGroups) -> bool {
        matches!(self.weight, LinearWeight::Dense(_)) && x.device().is_cpu() && !groups.is_whole()
    }
}

impl Module for Linear {
    /// `x`: `[..., in]`; returns `[..., out]` in `x`'s dtype (f32 for [`LinearKind::F32`]).
    ///
    /// An FP8 weight on CUDA with a bf16 `x` whose width is a multiple of 32 runs the activation
    /// quantization inside the FP8 kernel; any other input is prepared first
    /// ([`Linear::prepare_input`], in `x`'s dtype as for a dense weight) and multiplied as is.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(w) = self.fused_fp8(x.device(), x.dtype()) {
            return fp8_product(x, w, true)?.to_dtype(x.dtype());
        }
        self.forward_prepared(&self.prepare_input(x)?)
    }
}
