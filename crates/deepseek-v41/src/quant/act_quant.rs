//! FP8 activation quantization of the reference's linear operator (spec §0.1b.8, §2.5): the
//! input of every FP8/FP4-weight linear is quantized per 1x32 block of the last dim to e4m3 with
//! a UE8M0 (power-of-two) scale, amax floored at 1e-4.
//!
//! The quantized values `q·s` are exactly representable in bf16 and f32, so the emulation
//! returns the dequantized activation; an f32 GEMM of it with the dequantized weight equals the
//! reference's blockwise FP8 GEMM up to summation order.

use candle_core::{DType, Result, Tensor, D};

use super::formats::{ceil_log2, round_to_e4m3};

/// Block size of the activation quantization.
pub const ACT_BLOCK: usize = 32;

/// Quantizes one block in place: `s = 2^ceil(log2(max(amax, 1e-4)/448))`, `x = e4m3(x/s)·s`.
pub fn fp8_act_quant_block(block: &mut [f32]) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-4);
    let s = 2f32.powi(ceil_log2(amax / 448.0));
    for v in block.iter_mut() {
        *v = round_to_e4m3(*v / s) * s;
    }
}

/// Emulates the activation quantization of `x` (`[..., K]`, K a multiple of 32, any float
/// dtype); returns the dequantized values in `x`'s dtype.
pub fn fp8_activation_quant(x: &Tensor) -> Result<Tensor> {
    let k = x.dim(D::Minus1)?;
    if k % ACT_BLOCK != 0 {
        candle_core::bail!("fp8_activation_quant: last dim {k} of {:?} is not a multiple of {ACT_BLOCK}", x.shape())
    }
    let mut v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    for block in v.chunks_mut(ACT_BLOCK) {
        fp8_act_quant_block(block);
    }
    Tensor::from_vec(v, x.shape(), x.device())?.to_dtype(x.dtype())
}
