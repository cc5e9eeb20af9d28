//! Quantized weights kept in their release format (spec §2.4, §12.1): the loading policy
//! [`QuantizedWeights`] and the protocol through which a `VarBuilder` hands out the stored bytes
//! of an FP8 or MXFP4 weight instead of its dequantized values.
//!
//! A `VarBuilder` knows tensors by name only, so the two stored parts of a quantized weight
//! `<x>.weight` have virtual names ([`StoredPart::name`]):
//! * FP8 with 32×32 block scales ([`WeightFormat::Fp8Block32`], the dense quantized linears):
//!   * `<x>.weight#e4m3`: the e4m3 codes `[out, in]`, u8, the bytes of `<x>.weight`;
//!   * `<x>.weight#e8m0`: the e8m0 scales `[ceil(out/32), ceil(in/32)]`, u8, the bytes of `<x>.scale`.
//! * MXFP4 ([`WeightFormat::Mxfp4`], the routed experts):
//!   * `<x>.weight#e2m1`: the packed e2m1 codes `[out, in/2]`, u8, the bytes of `<x>.weight`
//!     (stored as I8; byte `j` of a row holds input `2j` in its low nibble, `2j+1` in its high one);
//!   * `<x>.weight#e8m0`: the e8m0 scales `[out, ceil(in/32)]`, u8, the bytes of `<x>.scale`.
//!
//! Which parts a weight has follows from its stored format ([`StoredPart::belongs_to`]): `#e4m3`
//! only for FP8 32×32 weights, `#e2m1` only for MXFP4 weights, `#e8m0` for both (with each
//! format's scale shape). [`super::ReleaseBackend`] reports them (`contains_tensor`) only under
//! [`QuantizedWeights::Native`] and only for weights stored in the matching format; its `get`
//! returns the bytes with their stored shapes ([`ReleaseCheckpoint::get_stored_part`]) and
//! records `<x>.weight` as used, so the strictness checks (`check_all_used`, `check_strict`) see
//! the weight loaded. Every other backend (candle's safetensors and `VarMap` builders,
//! [`crate::nn::RandomWeights`]) reports no such name, and the consumer loads the dense
//! `<x>.weight` as before. The consumer is [`crate::nn::LinearWeight::load`]: a
//! [`crate::nn::LinearKind::Quantized`] linear on a CUDA device with bf16 weights (an MXFP4 one
//! also needs `in` to be a multiple of 32). Tensor names ending in `#e4m3` / `#e2m1` / `#e8m0`
//! are reserved for this protocol.

use candle_core::{DType, Device, Tensor};

use super::checkpoint::{missing_scale, ReleaseCheckpoint};
use super::error::LoadError;
use super::layout::WeightFormat;

/// How the quantized (FP8, MXFP4) weights of a release checkpoint are held once loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantizedWeights {
    /// In their release format wherever a module computes with that format. On a CUDA device:
    /// a quantized linear over an FP8 (32×32 block) weight holds the e4m3 codes and e8m0 scales
    /// (about half the bytes of bf16) and runs the FP8 kernels (`cuda::fp8_linear`); a quantized
    /// linear over an MXFP4 weight (the routed experts) holds the packed e2m1 codes and e8m0
    /// scales (about a quarter of the bf16 bytes) and dequantizes them on the device into a bf16
    /// scratch for each call (`cuda::mxfp4_dequantize_device`, then the dense path's matmul: the
    /// same numbers as [`QuantizedWeights::Dequantized`]); the grouped `wo_a` keeps its FP8 codes
    /// and scales too (`nn::GroupedLinear`). Everything else — the CPU (the reference keeps dense
    /// f32 weights), the Engram tables, plain and f32 linears — is dequantized at load as with
    /// [`QuantizedWeights::Dequantized`].
    #[default]
    Native,
    /// Every quantized weight dequantized at load (exact, spec §2.4) into a dense tensor: the
    /// baseline the native weights are compared against, and a second opinion.
    Dequantized,
}

impl QuantizedWeights {
    /// `"native"` or `"dequantized"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Dequantized => "dequantized",
        }
    }
}

impl std::fmt::Display for QuantizedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One stored part of an FP8 or MXFP4 weight, addressed by a virtual tensor name (see the module
/// docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredPart {
    /// The e4m3 codes `[out, in]` of an FP8 32×32 weight (the bytes of `<x>.weight`).
    Codes,
    /// The packed e2m1 codes `[out, in/2]` of an MXFP4 weight (the bytes of `<x>.weight`).
    Fp4Codes,
    /// The e8m0 scales (the bytes of `<x>.scale`): `[ceil(out/32), ceil(in/32)]` for an FP8
    /// 32×32 weight, `[out, ceil(in/32)]` for an MXFP4 weight.
    Scales,
}

impl StoredPart {
    /// Every part.
    pub const ALL: [Self; 3] = [Self::Codes, Self::Fp4Codes, Self::Scales];

    /// The suffix of the part's virtual name: `#e4m3`, `#e2m1` or `#e8m0`.
    pub const fn suffix(self) -> &'static str {
        match self {
            Self::Codes => "#e4m3",
            Self::Fp4Codes => "#e2m1",
            Self::Scales => "#e8m0",
        }
    }

    /// The virtual name of this part of `weight` (`<x>.weight` → `<x>.weight#e4m3`).
    pub fn name(self, weight: &str) -> String {
        format!("{weight}{}", self.suffix())
    }

    /// Splits a virtual name into the weight's name and the part; `None` for any other name.
    pub fn parse(name: &str) -> Option<(&str, Self)> {
        Self::ALL.into_iter().find_map(|p| name.strip_suffix(p.suffix()).map(|w| (w, p)))
    }

    /// Whether a weight stored as `format` has this part: the codes and scales of FP8 32×32
    /// weights, the packed codes and scales of MXFP4 weights, nothing of any other format.
    pub fn belongs_to(self, format: WeightFormat) -> bool {
        matches!(
            (format, self),
            (WeightFormat::Fp8Block32, Self::Codes | Self::Scales) | (WeightFormat::Mxfp4, Self::Fp4Codes | Self::Scales)
        )
    }
}

impl ReleaseCheckpoint {
    /// Whether `weight` is stored as FP8 with 32×32 block scales, the format whose parts
    /// [`get_stored_part`](Self::get_stored_part) hands out.
    pub fn is_fp8_block32(&self, weight: &str) -> bool {
        self.info(weight).is_ok_and(|i| i.format == WeightFormat::Fp8Block32)
    }

    /// Whether `weight` is stored as MXFP4 (packed e2m1 codes with per-row 1×32 e8m0 scales), the
    /// other format whose parts [`get_stored_part`](Self::get_stored_part) hands out.
    pub fn is_mxfp4(&self, weight: &str) -> bool {
        self.info(weight).is_ok_and(|i| i.format == WeightFormat::Mxfp4)
    }

    /// Whether `weight` is stored in a format that has `part` ([`StoredPart::belongs_to`]).
    pub fn has_stored_part(&self, weight: &str, part: StoredPart) -> bool {
        self.info(weight).is_ok_and(|i| part.belongs_to(i.format))
    }

    /// The stored bytes of `part` of the FP8 (32×32 block) or MXFP4 weight `weight`, as a u8
    /// tensor of the stored shape on `device`: no dequantization, no f32 / bf16 copy. The bytes go from the
    /// memory map to the device in one copy (`Tensor::from_raw_buffer`: on CUDA one host-to-device
    /// copy of the mapped slice into a fresh device buffer; on the CPU one copy into the tensor's
    /// own buffer); the mapped pages are released afterwards and the progress callback gets the
    /// bytes read. Records `weight` as used and the part's bytes as placed under `weight`'s name
    /// ([`ReleaseCheckpoint::placed_bytes`]).
    ///
    /// Errors ([`LoadError::BadFormat`]) if `weight` is not stored in a format that has `part`
    /// ([`StoredPart::belongs_to`]).
    pub fn get_stored_part(&self, weight: &str, part: StoredPart, device: &Device) -> candle_core::Result<Tensor> {
        let info = self.info(weight)?;
        if !part.belongs_to(info.format) {
            return Err(LoadError::BadFormat {
                name: weight.to_string(),
                detail: format!(
                    "stored as {:?} ({}): it has no stored part `{}` (FP8 32x32 weights have `#e4m3` and `#e8m0`, \
                     MXFP4 weights `#e2m1` and `#e8m0`); load it dequantized",
                    info.format,
                    info.stored.dtype,
                    part.suffix()
                ),
            }
            .into());
        }
        let stored = match part {
            StoredPart::Codes | StoredPart::Fp4Codes => &info.stored,
            StoredPart::Scales => info.scale.as_ref().ok_or_else(|| missing_scale(weight))?,
        };
        let t = Tensor::from_raw_buffer(self.bytes_of(stored)?, DType::U8, &stored.shape, device)?;
        // `t` owns its bytes (host buffer or device copy): the mapped pages can go.
        self.release(stored);
        self.report_progress(stored.byte_range.len());
        self.record_placed(weight, &t);
        self.mark_used(weight);
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_names_round_trip() {
        for part in StoredPart::ALL {
            let name = part.name("layers.0.attn.wq_a.weight");
            assert_eq!(StoredPart::parse(&name), Some(("layers.0.attn.wq_a.weight", part)));
        }
        assert_eq!(StoredPart::Codes.name("a.weight"), "a.weight#e4m3");
        assert_eq!(StoredPart::Scales.name("a.weight"), "a.weight#e8m0");
        assert_eq!(StoredPart::Fp4Codes.name("a.weight"), "a.weight#e2m1");
        assert_eq!(StoredPart::parse("a.weight"), None);
        assert_eq!(StoredPart::parse("a.scale"), None);
        assert_eq!(StoredPart::parse("a.weight#e5m2"), None);
        assert_eq!(QuantizedWeights::default(), QuantizedWeights::Native);
        assert_eq!(QuantizedWeights::Dequantized.to_string(), "dequantized");
    }

    #[test]
    fn parts_belong_to_their_formats() {
        use WeightFormat::*;
        let has = |f| StoredPart::ALL.into_iter().filter(|p| p.belongs_to(f)).collect::<Vec<_>>();
        assert_eq!(has(Fp8Block32), [StoredPart::Codes, StoredPart::Scales]);
        assert_eq!(has(Mxfp4), [StoredPart::Fp4Codes, StoredPart::Scales]);
        assert!(has(Fp8Rows).is_empty() && has(Plain).is_empty());
    }
}
