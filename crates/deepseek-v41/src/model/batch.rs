//! The inputs and outputs of a batched forward ([`Model::forward_batch`]): several sequences,
//! each a chunk of tokens (a prefill chunk or one decode token) on its own [`ModelCache`], in one
//! call. The row-wise parts of the model run once over the concatenated rows of all items, the
//! attention per item on its rows and its cache (`docs/architecture.md`, "Several sequences in
//! one forward").
//!
//! Each item borrows its cache mutably, so one cache cannot be passed twice:
//!
//! ```compile_fail
//! # fn f(model: &deepseek_v41::model::Model, cache: &mut deepseek_v41::model::ModelCache) {
//! use deepseek_v41::model::BatchItem;
//! let mut items = [BatchItem::new(&[1, 2], cache), BatchItem::new(&[3], cache)];
//! let _ = model.forward_batch(&mut items);
//! # }
//! ```

use std::ops::Range;

use candle_core::{Result, Tensor};

use super::decoder::{Model, ModelCache};

/// Which rows of an item's chunk get logits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum LogitRows {
    /// The last token of the chunk (the next-token logits; the default).
    #[default]
    Last,
    /// Every token of the chunk.
    All,
    /// These indices into the chunk (`0..tokens.len()`), in this order.
    Rows(Vec<usize>),
}

impl LogitRows {
    /// The chunk indices for a chunk of `len` tokens, or `None` when one is outside it.
    fn resolve(&self, len: usize) -> std::result::Result<Vec<usize>, usize> {
        match self {
            Self::Last => Ok(vec![len - 1]),
            Self::All => Ok((0..len).collect()),
            Self::Rows(rows) => match rows.iter().find(|&&r| r >= len) {
                Some(&r) => Err(r),
                None => Ok(rows.clone()),
            },
        }
    }
}

/// One sequence of a batched forward: its next tokens, at positions `cache.seq_len() ..`.
#[derive(Debug)]
pub struct BatchItem<'a> {
    /// The chunk: a prefill chunk or one decode token (not empty, ids below the vocabulary
    /// size).
    pub tokens: &'a [u32],
    /// The sequence's cache; the call appends `tokens` to it.
    pub cache: &'a mut ModelCache,
    /// The rows whose logits [`Model::forward_batch`] returns.
    pub logits: LogitRows,
}

impl<'a> BatchItem<'a> {
    /// An item returning the logits of its last token.
    pub fn new(tokens: &'a [u32], cache: &'a mut ModelCache) -> Self {
        Self { tokens, cache, logits: LogitRows::Last }
    }

    /// The same item returning the logits of `rows`.
    pub fn with_logits(self, rows: LogitRows) -> Self {
        Self { logits: rows, ..self }
    }
}

/// A batch the model cannot take, reported before any cache changes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// No item was given.
    #[error("empty batch: pass at least one BatchItem")]
    Empty,
    /// An item's chunk holds no token.
    #[error("batch item {item} has no tokens: every item needs a prefill chunk or one decode token")]
    EmptyChunk {
        /// The item's index in the batch.
        item: usize,
    },
    /// An item asks for the logits of a row outside its chunk.
    #[error("batch item {item} asks for the logits of row {row}, but its chunk has {len} tokens (rows 0..{len})")]
    RowOutsideChunk {
        /// The item's index in the batch.
        item: usize,
        /// The requested row.
        row: usize,
        /// The chunk's length.
        len: usize,
    },
}

impl From<BatchError> for candle_core::Error {
    fn from(e: BatchError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// The logits of a batched forward.
#[derive(Debug, Clone)]
pub struct BatchOutput {
    /// `[R, vocab]` f32: the requested rows of every item, items in batch order.
    pub logits: Tensor,
    /// Item i's rows of [`BatchOutput::logits`].
    pub rows: Vec<Range<usize>>,
}

impl BatchOutput {
    /// Item `item`'s logits `[rows, vocab]`, in the order its [`LogitRows`] asked for.
    pub fn item(&self, item: usize) -> Result<Tensor> {
        match self.rows.get(item) {
            Some(r) => self.logits.narrow(0, r.start, r.len()),
            None => candle_core::bail!("BatchOutput: no item {item}, the batch had {} items", self.rows.len()),
        }
    }

    /// Item `item`'s logits of its last requested row, `[vocab]` (for sampling).
    pub fn last(&self, item: usize) -> Result<Tensor> {
        let t = self.item(item)?;
        t.get(t.dim(0)? - 1)
    }
}

/// The checked layout of a batch: per item its rows in the concatenation and the concatenated
/// indices of its logit rows.
pub(super) struct BatchPlan {
    /// Item i's token rows in the concatenated stream.
    pub(super) spans: Vec<Range<usize>>,
    /// Rows of the concatenated stream whose logits are returned, items in order.
    pub(super) logit_rows: Vec<u32>,
    /// Item i's rows of the returned logits.
    pub(super) out_rows: Vec<Range<usize>>,
}

impl BatchPlan {
    /// Checks `items` (non-empty batch, non-empty chunks with ids below `model`'s vocabulary,
    /// logit rows inside their chunk) and lays them out.
    pub(super) fn new(model: &Model, items: &[BatchItem]) -> Result<Self> {
        if items.is_empty() {
            Err(BatchError::Empty)?
        }
        let (mut spans, mut logit_rows, mut out_rows) = (Vec::new(), Vec::new(), Vec::new());
        let mut at = 0;
        for (i, item) in items.iter().enumerate() {
            let len = item.tokens.len();
            if len == 0 {
                Err(BatchError::EmptyChunk { item: i })?
            }
            model.check_tokens(item.tokens)?;
            let rows = item.logits.resolve(len).map_err(|row| BatchError::RowOutsideChunk { item: i, row, len })?;
            out_rows.push(logit_rows.len()..logit_rows.len() + rows.len());
            logit_rows.extend(rows.iter().map(|&r| (at + r) as u32));
            spans.push(at..at + len);
            at += len;
        }
        Ok(Self { spans, logit_rows, out_rows })
    }
}
