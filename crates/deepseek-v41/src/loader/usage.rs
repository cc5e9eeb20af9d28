//! Strict loading: which tensors the model requested, which it never used, and (in collect
//! mode) every missing / mis-shaped tensor of a load at once.

use std::collections::HashSet;

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
        }
    }
}

impl ReleaseCheckpoint {
    pub(super) fn mark_used(&self, name: &str) {
        self.usage().used.insert(name.to_string());
    }

    /// The names requested so far (successful `get` / row lookups), sorted.
    pub fn used_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.usage().used.iter().cloned().collect();
        v.sort();
        v
    }

    /// Logical tensors never requested, sorted, skipping [`NON_TEXT_PREFIXES`],
    /// [`NON_TEXT_SUFFIXES`] and names starting with any of `ignore_prefixes`. `.scale`
    /// companions are never listed (they belong to their weight, which is).
    pub fn unused_names(&self, ignore_prefixes: &[&str]) -> Vec<String> {
        let usage = self.usage();
        self.names()
            .into_iter()
            .filter(|n| !usage.used.contains(n))
            .filter(|n| {
                !NON_TEXT_PREFIXES
                    .iter()
                    .chain(ignore_prefixes)
                    .any(|p| n.starts_with(p))
            })
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

    /// Sets the largest tensor, in bytes as f32, that [`get`](Self::get) materializes (default
    /// [`DEFAULT_DENSE_LIMIT`]); larger ones must be read by rows.
    pub fn set_dense_limit(&self, bytes: usize) {
        self.usage().dense_limit = bytes;
    }

    /// The current dense limit in bytes (see [`set_dense_limit`](Self::set_dense_limit)).
    pub fn dense_limit(&self) -> usize {
        self.usage().dense_limit
    }

    /// Forgets the used names and recorded problems (e.g. before loading a second model from
    /// the same checkpoint).
    pub fn reset_usage(&self) {
        let mut u = self.usage();
        u.used.clear();
        u.problems.clear();
    }
}
