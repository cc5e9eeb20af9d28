//! Number formats, QAT fake-quantization and the FP8 activation quantization.

pub mod formats;
