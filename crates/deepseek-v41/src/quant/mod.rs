//! Number formats, QAT fake-quantization, packed cache rows, the FP8 activation quantization, and
//! the weights kept in their release formats (block-scaled FP8, MXFP4) with their reference linears.

pub mod act_quant;
pub mod fake_quant;
pub mod formats;
pub mod fp8_weight;
pub mod mxfp4_weight;
pub mod packed;
#[cfg(test)]
mod test_golden;

pub use act_quant::fp8_activation_quant;
pub use fp8_weight::{fp8_linear_ref, Fp8Weight};
pub use mxfp4_weight::{mxfp4_linear_ref, Mxfp4Weight};
pub use fake_quant::{fake_quant, fake_quant_slice, quantize_block, QatFormat, QuantBlock};
use candle_core::{DType, Module, Result, Tensor};

use crate::nn::{Linear, LinearKind};
use crate::numerics::Numerics;

pub use packed::{
    pack_fp4_row, pack_fp8_row, pack_index_fp4_row, pack_row, unpack_fp4_row, unpack_fp8_row, unpack_index_fp4_row,
    unpack_row,
};

/// The reference linear over a weight kept in a release format: `x` `[M, K]` (bf16 or f32, on the
/// weight's device) times `dequantized` (`[N, K]` f32, the weight's exact dequantization)
/// transposed, through a [`Linear`] of kind [`LinearKind::Quantized`] (the FP8 activation
/// quantization of `x` when `act_quant`, f32 accumulation, `x`'s dtype out). `op` names the caller
/// in the errors; `device` is the weight's.
pub(crate) fn quantized_linear_ref(
    op: &str,
    x: &Tensor,
    (n, k): (usize, usize),
    device: &candle_core::Device,
    dequantized: impl FnOnce() -> Result<Tensor>,
    act_quant: bool,
) -> Result<Tensor> {
    match x.dims() {
        &[_, xk] if xk == k => {}
        d => candle_core::bail!("{op}: x must be [M, {k}] for a weight [{n}, {k}], got {d:?}"),
    }
    if !matches!(x.dtype(), DType::BF16 | DType::F32) {
        candle_core::bail!("{op}: x must be bf16 or f32, got {:?}", x.dtype())
    }
    if !x.device().same_device(device) {
        candle_core::bail!("{op}: x on {:?} and the weight on {:?} must share a device", x.device(), device)
    }
    let numerics = Numerics { activation_quant: act_quant, ..Numerics::PLAIN };
    Linear::from_weight(dequantized()?, LinearKind::Quantized, numerics).forward(x)
}
