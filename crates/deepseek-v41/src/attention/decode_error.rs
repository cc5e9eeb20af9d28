//! Why a batched decode step ([`super::decode_batch`]) cannot be built or run: checked before any
//! cache row is written, and converted into a `candle_core::Error` (wrapped, so
//! `err.to_string()` is this message) by the functions that return `candle_core::Result`.

/// A batched decode step's inputs, caches or layer do not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeStepError {
    /// A batch of no sequence.
    #[error("batched decode step: the batch size must be at least 1, got 0")]
    EmptyBatch,
    /// Two parts of a step were built for different batch sizes.
    #[error("batched decode step: {what} is for {got} sequences, the step's batch has {batch}")]
    BatchMismatch {
        /// The part that disagrees (`"positions"`, `"the kv source's cache"`, ...).
        what: &'static str,
        /// The step's batch size.
        batch: usize,
        /// The part's batch size.
        got: usize,
    },
    /// A position whose compressed entries do not fit the sequence's region of the pool.
    #[error(
        "batched decode step: sequence {seq} at position {position} sees {needed} compressed entries, but its region holds \
         {entries} (positions below {limit} fit); build the caches with more entries per sequence"
    )]
    BeyondCapacity {
        /// The sequence's index in the batch.
        seq: usize,
        /// Its position this step.
        position: usize,
        /// The entries it needs (visible after this step's insert).
        needed: usize,
        /// The entries its region holds.
        entries: usize,
        /// The first position that does not fit (`entries · ratio`).
        limit: usize,
    },
    /// A kv source's page pool cannot serve a sequence's new entries (nothing was taken).
    #[error(
        "batched decode step, layer {layer}: sequence {seq} needs {needed} more pages of {page} compressed entries, the page pool \
         has {free} of {total} free; release a finished sequence or build the step with a larger page pool"
    )]
    PoolFull {
        /// The kv source.
        layer: usize,
        /// The first sequence (batch index) left without its pages.
        seq: usize,
        /// The pages it and the sequences after it asked for.
        needed: usize,
        /// The free pages left for it.
        free: usize,
        /// The pages of the pool.
        total: usize,
        /// Entries a page holds.
        page: usize,
    },
    /// A step over the first rows would run an idle row that holds a sequence.
    #[error(
        "batched decode step: row {row} holds a sequence but the step gives tokens for only the first {given} rows; give it its \
         token (sequences take the lowest free rows) or release it"
    )]
    RowInUse {
        /// The row that holds a sequence.
        row: usize,
        /// The rows given tokens.
        given: usize,
    },
    /// A step over fewer rows than the last update gave tokens to.
    #[error(
        "batched decode step: the last update gave tokens to {updated} rows, a step over the first {rows} would skip some; step at \
         least {updated} rows (a bucket at least that large)"
    )]
    RowsNotStepped {
        /// Rows given tokens by the update.
        updated: usize,
        /// Rows asked for.
        rows: usize,
    },
    /// A position past what the step's integer inputs hold.
    #[error("batched decode step: sequence {seq} is at position {position}, positions above {max} are not supported")]
    PositionOutOfRange {
        /// The sequence's index in the batch.
        seq: usize,
        /// Its position.
        position: usize,
        /// The largest position taken.
        max: usize,
    },
    /// A tensor of the wrong dtype or shape.
    #[error("batched decode step: {what} must be {expected}, got {got}")]
    Tensor {
        /// The tensor (`"x"`, `"the window pool"`, ...).
        what: &'static str,
        /// What it must be (dtype and shape).
        expected: String,
        /// What it is.
        got: String,
    },
    /// A layer role the batched step does not compose.
    #[error(
        "batched decode step: layer {layer} ({role}) is not supported: the step takes window-only layers and compressed \
         layers of ratio 1 or 2"
    )]
    UnsupportedLayer {
        /// The layer.
        layer: usize,
        /// Its role, in words.
        role: String,
    },
    /// Caches, inputs or settings that do not belong to the layer.
    #[error("batched decode step, layer {layer}: {why}")]
    Mismatch {
        /// The layer.
        layer: usize,
        /// What does not fit, and what to pass instead.
        why: String,
    },
}

impl From<DecodeStepError> for candle_core::Error {
    fn from(e: DecodeStepError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// `Err(DecodeStepError::Tensor)` unless `t` has `dtype` and `dims`.
pub(super) fn check_tensor(
    what: &'static str,
    t: &candle_core::Tensor,
    dtype: candle_core::DType,
    dims: &[usize],
) -> Result<(), DecodeStepError> {
    if t.dtype() != dtype || t.dims() != dims {
        return Err(DecodeStepError::Tensor {
            what,
            expected: format!("{dtype:?} {dims:?}"),
            got: format!("{:?} {:?}", t.dtype(), t.dims()),
        });
    }
    Ok(())
}
