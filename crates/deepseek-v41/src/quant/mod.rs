//! Number formats, QAT fake-quantization, packed cache rows and the FP8 activation quantization.

pub mod act_quant;
pub mod fake_quant;
pub mod formats;
pub mod packed;
#[cfg(test)]
mod test_golden;

pub use act_quant::fp8_activation_quant;
pub use fake_quant::{fake_quant, fake_quant_slice, quantize_block, QatFormat, QuantBlock};
pub use packed::{
    pack_fp4_row, pack_fp8_row, pack_index_fp4_row, pack_row, unpack_fp4_row, unpack_fp8_row, unpack_index_fp4_row,
    unpack_row,
};
