//! The reference's linear operator (spec §0.1b.8, §2.5).
//!
//! Weights are held dequantized (`[out, in]`, exact in bf16 for FP8 and MXFP4 checkpoints).
//! A [`LinearKind::Quantized`] linear (FP8/FP4 weights in the release) quantizes its input per
//! 1x32 block to e4m3 when [`Numerics::activation_quant`] is on; the plain kinds never do. Every
//! product is accumulated in f32; the output is rounded to the activation dtype, or kept in f32
//! for [`LinearKind::F32`] (MoE gate, ratio-2 compressor, head, mHC mixes).

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::numerics::Numerics;
use crate::quant::fp8_activation_quant;

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
    /// `[out, in]`; f32 on CPU, the model dtype elsewhere.
    weight: Tensor,
    kind: LinearKind,
    quantize_input: bool,
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
    /// Loads `<prefix>.weight` `[out, in]` (dequantized by the checkpoint backend).
    pub fn new(in_dim: usize, out_dim: usize, kind: LinearKind, numerics: Numerics, vb: VarBuilder) -> Result<Self> {
        let dtype = match kind {
            LinearKind::F32 => DType::F32,
            _ => compute_dtype(vb.device(), vb.dtype()),
        };
        let weight = vb.get_with_hints_dtype((out_dim, in_dim), "weight", Default::default(), dtype)?;
        Ok(Self::from_weight(weight, kind, numerics))
    }

    /// Wraps a weight `[out, in]`.
    pub fn from_weight(weight: Tensor, kind: LinearKind, numerics: Numerics) -> Self {
        let quantize_input = kind == LinearKind::Quantized && numerics.activation_quant;
        Self { weight, kind, quantize_input }
    }

    /// `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
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
    /// `xp = prepare_input(x)`.
    pub fn forward_prepared(&self, xp: &Tensor) -> Result<Tensor> {
        let out_dtype = if self.kind == LinearKind::F32 { DType::F32 } else { xp.dtype() };
        let x = xp.to_dtype(self.weight.dtype())?;
        let y = match x.rank() {
            2 => x.matmul(&self.weight.t()?)?,
            _ => x.broadcast_matmul(&self.weight.t()?)?,
        };
        y.to_dtype(out_dtype)
    }
}

impl Module for Linear {
    /// `x`: `[..., in]`; returns `[..., out]` in `x`'s dtype (f32 for [`LinearKind::F32`]).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_prepared(&self.prepare_input(x)?)
    }
}
