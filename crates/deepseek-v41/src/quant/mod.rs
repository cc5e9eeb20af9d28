//! Number formats, QAT fake-quantization and the FP8 activation quantization.

pub mod act_quant;
pub mod formats;

pub use act_quant::fp8_activation_quant;
