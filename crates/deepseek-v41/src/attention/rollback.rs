//! Truncating a [`SequenceCache`] to a shorter length (retries, speculative decoding, prefix
//! reuse): the state after `truncate(n)` is the state after the first `n` tokens, so continuing
//! from it gives the same results as a fresh run of those `n` tokens.
//!
//! Most of the state rolls back exactly by itself: compressed entries and index keys are
//! append-only (keep the `n / ratio` closed groups), and the top-k / candidates published within
//! a call are dropped. Two parts overwrite or drop rows as the sequence grows, so a rollback of
//! more than a few positions needs rows kept for it, bounded by the cache's *rollback depth*
//! ([`SequenceCache::set_rollback_depth`], 0 by default):
//!
//! * the sliding-window ring holds the last `W` positions only: rows leaving it are kept in a
//!   spill of `depth` rows;
//! * a ratio-2 compressor carries the raw projections of its open group only: the last
//!   `depth + ratio − 1` projections are kept.
//!
//! The reach is counted from the furthest position processed: after running to `L`, a cache of
//! depth `d` can be truncated to any `n >= L − d`, again and again (a truncation and a shorter
//! continuation do not restore the rows dropped while running to `L`).
//!
//! Without depth, truncation works where nothing needed was overwritten (e.g. a sequence
//! shorter than the window whose new length closes a compressor group). When a needed row is
//! gone, [`RollbackError::NotHeld`] names it and nothing changes. The fused CUDA decode step
//! writes the ring in place and keeps no spill: a rollback that needs ring rows it evicted
//! fails the same way.

use candle_core::Result;

use super::cache::SequenceCache;

/// Why a cache cannot be truncated or given a rollback depth.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RollbackError {
    /// The requested length is past the end.
    #[error("cannot truncate the cache to {len} tokens: it holds only {seq_len}")]
    BeyondEnd {
        /// The requested length.
        len: usize,
        /// The tokens the cache holds.
        seq_len: usize,
    },
    /// A row the shorter state needs was overwritten and not kept.
    #[error(
        "cannot truncate the cache from {seq_len} to {len} tokens: the {what} no longer holds positions \
         {}..{} (rollback depth {depth}); set a rollback depth of at least {} on the empty cache \
         (set_rollback_depth), or start over with a fresh cache",
        missing.start, missing.end, seq_len.saturating_sub(*len)
    )]
    NotHeld {
        /// The requested length.
        len: usize,
        /// The tokens the cache holds.
        seq_len: usize,
        /// The part of the cache, e.g. "window ring of layer 3".
        what: String,
        /// The positions whose rows are missing.
        missing: std::ops::Range<usize>,
        /// The cache's rollback depth.
        depth: usize,
    },
    /// A rollback depth can only be set before the first token.
    #[error("the rollback depth must be set on an empty cache; this one holds {seq_len} tokens")]
    NotEmpty {
        /// The tokens the cache holds.
        seq_len: usize,
    },
}

impl From<RollbackError> for candle_core::Error {
    fn from(e: RollbackError) -> Self {
        candle_core::Error::wrap(e)
    }
}

impl SequenceCache {
    /// Keeps enough rows to truncate the cache up to `depth` positions back from the furthest
    /// position processed (see the module docs): `depth` window rows per layer and `depth + 1` f32 projection pairs per
    /// ratio-2 kv source. Errors unless the cache is empty.
    pub fn set_rollback_depth(&mut self, depth: usize) -> std::result::Result<(), RollbackError> {
        let seq_len = self.seq_len();
        if seq_len > 0 {
            return Err(RollbackError::NotEmpty { seq_len });
        }
        for (l, &ratio) in self.source_ratios.clone().iter().enumerate() {
            let Ok(state) = self.layer_mut(l) else { continue };
            state.window.set_rollback_depth(depth);
            if let Some(source) = &mut state.source {
                source.carry.set_history(depth + ratio.saturating_sub(1));
            }
        }
        self.rollback_depth = depth;
        Ok(())
    }

    /// The positions a truncation may go back at any time ([`SequenceCache::set_rollback_depth`]).
    pub fn rollback_depth(&self) -> usize {
        self.rollback_depth
    }

    /// Rolls the cache back to its first `len` tokens. Each layer is rolled back from its own
    /// length, so this also repairs a cache whose last forward call failed part-way (truncate to
    /// the length before the call). Fails with a [`RollbackError`], changing nothing, when `len`
    /// is past the end or a needed row is no longer held.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.check_truncate(len)?;
        for (l, &ratio) in self.source_ratios.clone().iter().enumerate() {
            let state = self.layer_mut(l)?;
            let from = state.next_pos;
            if from == len {
                continue;
            }
            state.window.truncate(from, len)?;
            if let Some(source) = &mut state.source {
                source.compressed.truncate(len / ratio);
                source.index_keys.truncate(len / ratio);
                source.carry.truncate(ratio, from, len)?;
            }
            state.next_pos = len;
        }
        self.clear_published();
        Ok(())
    }

    fn check_truncate(&self, len: usize) -> std::result::Result<(), RollbackError> {
        let seq_len = self.seq_len();
        let depth = self.rollback_depth;
        for (l, &ratio) in self.source_ratios.iter().enumerate() {
            let Ok(state) = self.layer(l) else { continue };
            let from = state.next_pos;
            if from < len {
                return Err(RollbackError::BeyondEnd { len, seq_len: from });
            }
            let not_held = |what: String, missing| RollbackError::NotHeld { len, seq_len, what, missing, depth };
            if let Some(missing) = state.window.rollback_gap(from, len) {
                return Err(not_held(format!("window ring of layer {l}"), missing));
            }
            if let Some(missing) = state.source.as_ref().and_then(|s| s.carry.rollback_gap(ratio, from, len)) {
                return Err(not_held(format!("compressor carry of layer {l}"), missing));
            }
        }
        Ok(())
    }
}
