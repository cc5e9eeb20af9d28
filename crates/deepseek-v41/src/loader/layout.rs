//! How a stored tensor (plus its `.scale` companion) maps to one logical tensor (spec §2.4, §12).
//!
//! * `F8_E4M3 <x>.weight [out, in]` + `<x>.scale` `[ceil(out/32), ceil(in/32)]`: FP8 32×32 blocks.
//! * `F8_E4M3 <x>.weight [rows, in]` + `<x>.scale` `[rows, ceil(in/32)]`: FP8 rows with 1×32
//!   scales (Engram tables).
//! * `I8`/`U8 <x>.weight [out, cols]` + `<x>.scale` `[out, ceil(2·cols/32)]`: MXFP4, logical
//!   shape `[out, 2·cols]`.
//! * anything else: the tensor as stored.
//!
//! Scales must be `F8_E8M0` (or `U8`, the same bytes under vLLM's view).

use std::ops::Range;
use std::path::PathBuf;

use super::dequant::blocks;
use super::error::LoadError;
use super::shard::StoredDtype;

/// How a logical tensor is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Stored unquantized (BF16, F32, ...); returned as stored, cast to the requested dtype.
    Plain,
    /// FP8 e4m3 with one e8m0 scale per 32×32 block.
    Fp8Block32,
    /// FP8 e4m3 with one e8m0 scale per row per 32 columns (Engram tables).
    Fp8Rows,
    /// MXFP4: two e2m1 codes per byte, one e8m0 scale per row per 32 logical inputs.
    Mxfp4,
}

/// One stored tensor: where it is and what its header says.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredTensor {
    /// Name in the checkpoint.
    pub name: String,
    /// The shard file holding it.
    pub file: PathBuf,
    /// Stored dtype.
    pub dtype: StoredDtype,
    /// Stored shape.
    pub shape: Vec<usize>,
    /// Byte range within the file.
    pub byte_range: Range<usize>,
}

/// A logical tensor of the checkpoint: what [`super::ReleaseCheckpoint::get`] returns, and
/// where its bytes come from.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Name (the weight's name for quantized tensors).
    pub name: String,
    /// Storage format.
    pub format: WeightFormat,
    /// Logical (dequantized) shape, e.g. `[out, in]` for an MXFP4 weight stored as `[out, in/2]`.
    pub shape: Vec<usize>,
    /// The stored weight / tensor.
    pub stored: StoredTensor,
    /// The `.scale` companion of a quantized weight.
    pub scale: Option<StoredTensor>,
}

/// The `.scale` companion name of a weight: `<x>.weight` -> `<x>.scale`.
pub fn scale_name(weight: &str) -> Option<String> {
    weight.strip_suffix(".weight").map(|p| format!("{p}.scale"))
}

/// The weight a `.scale` tensor would belong to: `<x>.scale` -> `<x>.weight`.
pub fn weight_of_scale(scale: &str) -> Option<String> {
    scale.strip_suffix(".scale").map(|p| format!("{p}.weight"))
}

/// Decides the format and logical shape of `weight` given its optional `.scale` companion.
pub fn classify(weight: &StoredTensor, scale: Option<&StoredTensor>) -> Result<(WeightFormat, Vec<usize>), LoadError> {
    let bad = |detail: String| LoadError::BadFormat {
        name: weight.name.clone(),
        detail,
    };
    let dims2 = || match weight.shape[..] {
        [a, b] => Ok((a, b)),
        _ => Err(bad(format!(
            "quantized {} weight must be 2-D, found shape {:?}",
            weight.dtype, weight.shape
        ))),
    };
    let check_scale_dtype = |s: &StoredTensor| match s.dtype {
        StoredDtype::F8E8M0 | StoredDtype::U8 => Ok(()),
        d => Err(bad(format!(
            "its scale `{}` has dtype {d}, expected F8_E8M0 (or U8)",
            s.name
        ))),
    };
    match (weight.dtype, scale) {
        (StoredDtype::F8E4M3, None) => Err(bad(format!(
            "F8_E4M3 weight without its scale companion `{}`",
            scale_name(&weight.name).unwrap_or_else(|| format!("{}.scale", weight.name))
        ))),
        (StoredDtype::F8E4M3, Some(s)) => {
            check_scale_dtype(s)?;
            let (out, inp) = dims2()?;
            if s.shape == [blocks(out), blocks(inp)] {
                Ok((WeightFormat::Fp8Block32, vec![out, inp]))
            } else if s.shape == [out, blocks(inp)] {
                Ok((WeightFormat::Fp8Rows, vec![out, inp]))
            } else {
                Err(bad(format!(
                    "F8_E4M3 weight {:?} has scale `{}` of shape {:?}; expected [{}, {}] (32x32 blocks) \
                     or [{out}, {}] (per-row 1x32 blocks)",
                    weight.shape,
                    s.name,
                    s.shape,
                    blocks(out),
                    blocks(inp),
                    blocks(inp)
                )))
            }
        }
        (StoredDtype::I8 | StoredDtype::U8, Some(s)) => {
            check_scale_dtype(s)?;
            let (out, cols) = dims2()?;
            if s.shape == [out, blocks(2 * cols)] {
                Ok((WeightFormat::Mxfp4, vec![out, 2 * cols]))
            } else {
                Err(bad(format!(
                    "MXFP4 weight {} {:?} (logical [{out}, {}]) has scale `{}` of shape {:?}; expected [{out}, {}]",
                    weight.dtype,
                    weight.shape,
                    2 * cols,
                    s.name,
                    s.shape,
                    blocks(2 * cols)
                )))
            }
        }
        (StoredDtype::I8, None) => Err(bad(
            "I8 tensor without a `.scale` companion (MXFP4 weights need an F8_E8M0 scale)".to_string(),
        )),
        (StoredDtype::F8E8M0, _) => Err(bad(
            "F8_E8M0 tensor that is not the `.scale` companion of a weight".to_string()
        )),
        (d, Some(s)) => Err(bad(format!(
            "has a scale companion `{}` but its dtype {d} is not a quantized format",
            s.name
        ))),
        (d, None) => match d.candle() {
            Some(_) => Ok((WeightFormat::Plain, weight.shape.clone())),
            None => Err(bad(format!("dtype {d} is not supported"))),
        },
    }
}
