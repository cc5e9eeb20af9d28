//! Strict loading: which tensors the model requested, which it never used, and (in collect
//! mode) every missing / mis-shaped tensor of a load at once; and the bytes each tensor handed
//! out took ([`ReleaseCheckpoint::placed_bytes`], what `loader::plan` predicts).

use std::collections::{BTreeMap, HashSet};

use candle_core::Tensor;

use super::checkpoint::ReleaseCheckpoint;
use super::error::LoadError;

/// Name prefixes of tensors a text model never uses (spec §12.1: MTP heads, vision tower).
pub const NON_TEXT_PREFIXES: [&str; 4] = ["mtp.", "vision.", "aligner.", "image_"];

/// Name suffixes of tensors a text model never uses: `ffn.gate.bias_vl` (the vision-language
/// routing bias; unused for text, see the golden README).
pub const NON_TEXT_SUFFIXES: [&str; 1] = [".ffn.gate.bias_vl"];

/// The usage record shared by the clones of a checkpoint.
#[derive(Debug)]
pub struct Usage {
    used: HashSet<String>,
    collect: bool,
    problems: Vec<String>,
    dense_limit: usize,
    placed: BTreeMap<String, u64>,
}

/// Default largest tensor [`ReleaseCheckpoint::get`] materializes: 32 GiB as f32 (the release's
/// largest dense tensors are about 2.6 GB; an Engram table is about 400 GB as f32).
pub const DEFAULT_DENSE_LIMIT: usize = 32 << 30;

impl Default for Usage {
    fn default() -> Self {
        Self {
            used: HashSet::new(),
            collect: false,
            problems: Vec::new(),
            dense_limit: DEFAULT_DENSE_LIMIT,
            placed: BTreeMap::new(),
        }
    }
}

impl ReleaseCheckpoint {
    pub(super) fn mark_used(&self, name: &str) {
        self.usage().used.insert(name.to_string());
    }

    /// Adds the bytes of `t` (elements × dtype size), handed out for the logical tensor `name`,
    /// to [`placed_bytes`](Self::placed_bytes).
    pub(super) fn record_placed(&self, name: &str, t: &Tensor) {
        let bytes = (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        *self.usage().placed.entry(name.to_string()).or_default() += bytes;
    }

    /// The bytes of every tensor handed out since the checkpoint was opened (or
    /// [`reset_usage`](Self::reset_usage)), by logical tensor name: what [`get`](Self::get)
    /// returned (elements × dtype size), or the sum of the stored parts
    /// [`get_stored_part`](Self::get_stored_part) returned for an FP8 / MXFP4 weight. A tensor
    /// requested twice counts twice; row lookups ([`row_table`](Self::row_table)) and the zero
    /// stand-ins of collect mode place nothing. The model's device holds these bytes (the
    /// weights a loaded model keeps, before any product computed from them at load), which
    /// `loader::plan::LoadPlan` predicts from the config alone.
    pub fn placed_bytes(&self) -> BTreeMap<String, u64> {
        self.usage().placed.clone()
    }

    /// The names requested so far (successful `get` / row lookups, and in collect mode the
    /// failed requests whose problem was recorded), sorted.
    pub fn used_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.usage().used.iter().cloned().collect();
        v.sort();
        v
    }

    /// Logical tensors never requested, sorted, skipping [`NON_TEXT_PREFIXES`],
    /// [`NON_TEXT_SUFFIXES`] and names starting with any of `ignore_prefixes`. `.scale`
    /// companions are never listed (they belong to their weight, which is).
    pub fn unused_names(&self, ignore_prefixes: &[&str]) -> Vec<String> {
        self.unused_names_except(|n| ignore_prefixes.iter().any(|p| n.starts_with(p)))
    }

    /// [`unused_names`](Self::unused_names) skipping the names for which `ignore` holds (e.g.
    /// the routed experts another rank of an expert-parallel group loads).
    pub fn unused_names_except(&self, ignore: impl Fn(&str) -> bool) -> Vec<String> {
        let usage = self.usage();
        self.names()
            .into_iter()
            .filter(|n| !usage.used.contains(n))
            .filter(|n| !NON_TEXT_PREFIXES.iter().any(|p| n.starts_with(p)) && !ignore(n))
            .filter(|n| !NON_TEXT_SUFFIXES.iter().any(|s| n.ends_with(s)))
            .collect()
    }

    /// Errors ([`LoadError::Unused`]) listing every text-model tensor that was never requested
    /// (see [`unused_names`](Self::unused_names)). Call after building the model.
    pub fn check_all_used(&self, ignore_prefixes: &[&str]) -> Result<(), LoadError> {
        let names = self.unused_names(ignore_prefixes);
        if names.is_empty() {
            Ok(())
        } else {
            Err(LoadError::Unused { names })
        }
    }

    /// Collect mode (off by default). When on, the `VarBuilder` backend
    /// ([`super::var_builder`]) does not fail on a missing, badly stored or mis-shaped tensor:
    /// it records the problem and returns zeros of the requested shape so that loading
    /// continues, and [`check_missing`](Self::check_missing) reports every problem at once. For
    /// diagnostics only: a model built in collect mode with problems holds zero weights.
    pub fn set_collect_missing(&self, on: bool) {
        self.usage().collect = on;
    }

    /// Whether collect mode is on.
    pub fn collects_missing(&self) -> bool {
        self.usage().collect
    }

    pub(super) fn record_problem(&self, msg: String) {
        self.usage().problems.push(msg);
    }

    /// The problems recorded in collect mode, in load order.
    pub fn load_problems(&self) -> Vec<String> {
        self.usage().problems.clone()
    }

    /// Errors ([`LoadError::Collected`]) listing every problem recorded in collect mode.
    pub fn check_missing(&self) -> Result<(), LoadError> {
        let problems = self.load_problems();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(LoadError::Collected { problems })
        }
    }

    /// The strict check after building a model in collect mode: errors
    /// ([`LoadError::Mismatch`]) listing every recorded problem (as
    /// [`check_missing`](Self::check_missing)) and every unused text-model tensor (as
    /// [`check_all_used`](Self::check_all_used)) together, so that a renamed tensor shows up as
    /// both missing and unexpected.
    pub fn check_strict(&self, ignore_prefixes: &[&str]) -> Result<(), LoadError> {
        self.check_strict_except(|n| ignore_prefixes.iter().any(|p| n.starts_with(p)))
    }

    /// [`check_strict`](Self::check_strict) not listing the unused names for which `ignore`
    /// holds.
    pub fn check_strict_except(&self, ignore: impl Fn(&str) -> bool) -> Result<(), LoadError> {
        let problems = self.load_problems();
        let unexpected = self.unused_names_except(ignore);
        if problems.is_empty() && unexpected.is_empty() {
            Ok(())
        } else {
            Err(LoadError::Mismatch { problems, unexpected })
        }
    }

    /// Sets the largest tensor, in bytes as f32, that [`get`](Self::get) materializes (default
    /// [`DEFAULT_DENSE_LIMIT`]); larger ones must be read by rows.
    pub fn set_dense_limit(&self, bytes: usize) {
        self.usage().dense_limit = bytes;
    }

    /// The current dense limit in bytes (see [`set_dense_limit`](Self::set_dense_limit)).
    pub fn dense_limit(&self) -> usize {
        self.usage().dense_limit
    }

    /// Forgets the used names, recorded problems and placed bytes (e.g. before loading a second
    /// model from the same checkpoint).
    pub fn reset_usage(&self) {
        let mut u = self.usage();
        u.used.clear();
        u.problems.clear();
        u.placed.clear();
    }
}
