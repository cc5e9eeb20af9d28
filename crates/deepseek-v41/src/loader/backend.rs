//! The candle `VarBuilder` backend over a [`ReleaseCheckpoint`].

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use super::checkpoint::ReleaseCheckpoint;
use super::error::LoadError;
use super::native::{QuantizedWeights, StoredPart};

/// [`SimpleBackend`] over a release checkpoint: `get` checks the requested shape against the
/// logical (dequantized) shape and returns the dequantized tensor in the requested dtype.
///
/// Under [`QuantizedWeights::Native`] (the default) it also hands out the stored parts of FP8
/// (32×32 block) weights under their virtual names `<x>.weight#e4m3` / `<x>.weight#e8m0`, and of
/// MXFP4 weights under `<x>.weight#e2m1` / `<x>.weight#e8m0` ([`super::native`]); under
/// [`QuantizedWeights::Dequantized`] it knows no such name.
#[derive(Clone)]
pub struct ReleaseBackend {
    ckpt: ReleaseCheckpoint,
    quantized: QuantizedWeights,
}

impl ReleaseBackend {
    /// Wraps a checkpoint (cheap: the checkpoint is shared), with [`QuantizedWeights::Native`].
    pub fn new(ckpt: ReleaseCheckpoint) -> Self {
        Self::with_quantized(ckpt, QuantizedWeights::default())
    }

    /// Wraps a checkpoint with the given policy for its quantized weights.
    pub fn with_quantized(ckpt: ReleaseCheckpoint, quantized: QuantizedWeights) -> Self {
        Self { ckpt, quantized }
    }

    /// The checkpoint (for strictness checks and row lookups).
    pub fn checkpoint(&self) -> &ReleaseCheckpoint {
        &self.ckpt
    }

    /// The policy for quantized weights.
    pub fn quantized(&self) -> QuantizedWeights {
        self.quantized
    }

    /// Whether the virtual name of `part` of `weight` exists: native policy, and `weight` stored in
    /// a format that has `part` (FP8 32×32 block: `#e4m3`, `#e8m0`; MXFP4: `#e2m1`, `#e8m0`).
    fn has_part(&self, weight: &str, part: StoredPart) -> bool {
        self.quantized == QuantizedWeights::Native && self.ckpt.has_stored_part(weight, part)
    }

    /// `get` of a virtual name `name` = `part` of `weight` (see [`super::native`]): the stored
    /// bytes as u8, checked against the requested shape `s` when there is one.
    fn get_part(&self, s: Option<&Shape>, name: &str, weight: &str, part: StoredPart, dtype: DType, dev: &Device) -> Result<Tensor> {
        if !self.has_part(weight, part) {
            candle_core::bail!(
                "`{name}`: no such stored part (the policy is {}; under `native` FP8 weights with 32x32 block scales have `#e4m3` / \
                 `#e8m0`, MXFP4 weights `#e2m1` / `#e8m0`); check contains_tensor first and load `{weight}` dequantized otherwise",
                self.quantized
            )
        }
        if dtype != DType::U8 {
            candle_core::bail!("`{name}` holds the stored bytes: request it as u8, got {dtype:?}")
        }
        let info = self.ckpt.info(weight)?;
        let stored = match part {
            StoredPart::Codes | StoredPart::Fp4Codes => Some(&info.stored),
            StoredPart::Scales => info.scale.as_ref(),
        };
        if let (Some(s), Some(stored)) = (s, stored) {
            if stored.shape != s.dims() {
                let e = LoadError::ShapeMismatch { name: name.to_string(), expected: s.dims().to_vec(), found: stored.shape.clone() };
                return self.fail_or_collect(weight, e, s, dtype, dev);
            }
        }
        self.ckpt.get_stored_part(weight, part, dev)
    }

    /// In collect mode, records `err`, marks `name` as requested (so that a stored but malformed
    /// tensor is not also reported unused) and returns zeros of `shape` as a stand-in; otherwise
    /// returns `err`. (Missing tensors, unsupported formats and shape mismatches are all
    /// collected.) A stand-in over [`STAND_IN_LIMIT`] bytes (e.g. from a config with absurd
    /// sizes) is not allocated: the problem is recorded and the load stops with `err`.
    fn fail_or_collect(&self, name: &str, err: LoadError, shape: &Shape, dtype: DType, dev: &Device) -> Result<Tensor> {
        if !self.ckpt.collects_missing() {
            return Err(err.into());
        }
        self.ckpt.record_problem(err.to_string());
        self.ckpt.mark_used(name);
        let bytes = shape.dims().iter().try_fold(dtype.size_in_bytes(), |a, &d| a.checked_mul(d));
        match bytes {
            Some(b) if b <= STAND_IN_LIMIT.min(self.ckpt.dense_limit()) => Tensor::zeros(shape, dtype, dev),
            _ => Err(err.into()),
        }
    }
}

/// Largest zero stand-in (bytes) for a missing or mismatched tensor in collect mode.
pub const STAND_IN_LIMIT: usize = 1 << 30;

impl SimpleBackend for ReleaseBackend {
    /// `name`'s logical tensor as `dtype` on `dev`; errors (naming the tensor and both shapes)
    /// unless its logical shape is `s`. The init hint is ignored: nothing is ever created.
    ///
    /// A virtual name `<x>.weight#e4m3` / `#e2m1` / `#e8m0` ([`super::native`]) returns the stored
    /// bytes (`dtype` must be u8, `s` the stored shape) and records `<x>.weight` as used; a shape
    /// mismatch is collected like any other in collect mode.
    fn get(&self, s: Shape, name: &str, _h: candle_nn::Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        if let Some((weight, part)) = StoredPart::parse(name) {
            return self.get_part(Some(&s), name, weight, part, dtype, dev);
        }
        let info = match self.ckpt.info(name) {
            Ok(info) => info,
            Err(e) => return self.fail_or_collect(name, e, &s, dtype, dev),
        };
        if info.shape != s.dims() {
            let e = LoadError::ShapeMismatch {
                name: name.to_string(),
                expected: s.dims().to_vec(),
                found: info.shape,
            };
            return self.fail_or_collect(name, e, &s, dtype, dev);
        }
        self.ckpt.get(name, dtype, dev)
    }

    /// `name`'s logical tensor as `dtype` on `dev`, whatever its shape.
    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        if let Some((weight, part)) = StoredPart::parse(name) {
            return self.get_part(None, name, weight, part, dtype, dev);
        }
        self.ckpt.get(name, dtype, dev)
    }

    /// Whether `name` is a logical tensor (`.scale` companions are not), or — under
    /// [`QuantizedWeights::Native`] — a stored part of a weight stored in its format:
    /// `<x>.weight#e4m3` / `#e8m0` of an FP8 weight with 32×32 block scales, `<x>.weight#e2m1` /
    /// `#e8m0` of an MXFP4 weight.
    fn contains_tensor(&self, name: &str) -> bool {
        match StoredPart::parse(name) {
            Some((weight, part)) => self.has_part(weight, part),
            None => self.ckpt.contains(name),
        }
    }
}

/// A `VarBuilder` over `ckpt` whose default dtype is `dtype` and device `device`, with
/// [`QuantizedWeights::Native`]. Keep a clone of `ckpt` to call
/// [`ReleaseCheckpoint::check_strict`] (or `check_all_used` / `check_missing`) after building the
/// model, or for Engram row lookups.
pub fn var_builder(ckpt: ReleaseCheckpoint, dtype: DType, device: &Device) -> VarBuilder<'static> {
    var_builder_with(ckpt, dtype, device, QuantizedWeights::default())
}

/// [`var_builder`] with the given policy for the quantized weights.
pub fn var_builder_with(ckpt: ReleaseCheckpoint, dtype: DType, device: &Device, quantized: QuantizedWeights) -> VarBuilder<'static> {
    VarBuilder::from_backend(Box::new(ReleaseBackend::with_quantized(ckpt, quantized)), dtype, device.clone())
}
