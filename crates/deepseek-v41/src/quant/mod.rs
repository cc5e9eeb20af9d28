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
pub use packed::{
    pack_fp4_row, pack_fp8_row, pack_index_fp4_row, pack_row, unpack_fp4_row, unpack_fp8_row, unpack_index_fp4_row,
    unpack_row,
};
