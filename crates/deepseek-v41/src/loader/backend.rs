//! The candle `VarBuilder` backend over a [`ReleaseCheckpoint`].

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use super::checkpoint::ReleaseCheckpoint;
use super::error::LoadError;

/// [`SimpleBackend`] over a release checkpoint: `get` checks the requested shape against the
/// logical (dequantized) shape and returns the dequantized tensor in the requested dtype.
#[derive(Clone)]
pub struct ReleaseBackend {
    ckpt: ReleaseCheckpoint,
}

impl ReleaseBackend {
    /// Wraps a checkpoint (cheap: the checkpoint is shared).
    pub fn new(ckpt: ReleaseCheckpoint) -> Self {
        Self { ckpt }
    }

    /// The checkpoint (for strictness checks and row lookups).
    pub fn checkpoint(&self) -> &ReleaseCheckpoint {
        &self.ckpt
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
    fn get(&self, s: Shape, name: &str, _h: candle_nn::Init, dtype: DType, dev: &Device) -> Result<Tensor> {
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
        self.ckpt.get(name, dtype, dev)
    }

    /// Whether `name` is a logical tensor (`.scale` companions are not).
    fn contains_tensor(&self, name: &str) -> bool {
        self.ckpt.contains(name)
    }
}

/// A `VarBuilder` over `ckpt` whose default dtype is `dtype` and device `device`. Keep a clone
/// of `ckpt` to call [`ReleaseCheckpoint::check_strict`] (or `check_all_used` / `check_missing`)
/// after building the model, or for Engram row lookups.
pub fn var_builder(ckpt: ReleaseCheckpoint, dtype: DType, device: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(Box::new(ReleaseBackend::new(ckpt)), dtype, device.clone())
}
