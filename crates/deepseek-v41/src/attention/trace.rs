//! An optional recorder of intermediate tensors, keyed by the golden data's names
//! (`L{l}.window_kv`, `L{l}.topk`, ...). Disabled unless the caller installs one in the cache; the
//! golden checker uses it to compare every intermediate the reference dumps.

use std::collections::BTreeMap;

use candle_core::{Result, Tensor};

/// Per-token tensors appended call after call (row r of the concatenation = position r when
/// calls are contiguous from position 0).
#[derive(Debug, Default, Clone)]
pub struct Trace {
    rows: BTreeMap<String, Vec<Tensor>>,
}

impl Trace {
    /// An empty recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `t` (first dim = tokens of this call) under `name`.
    pub fn push(&mut self, name: impl Into<String>, t: &Tensor) {
        self.rows.entry(name.into()).or_default().push(t.clone());
    }

    /// Names recorded so far.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.rows.keys().map(|s| s.as_str())
    }

    /// The per-call pieces of `name`.
    pub fn pieces(&self, name: &str) -> Option<&[Tensor]> {
        self.rows.get(name).map(|v| v.as_slice())
    }

    /// All pieces of `name` concatenated along dim 0 (pieces must agree on the other dims).
    pub fn concat(&self, name: &str) -> Result<Option<Tensor>> {
        match self.rows.get(name) {
            None => Ok(None),
            Some(v) => Ok(Some(Tensor::cat(v, 0)?)),
        }
    }
}
