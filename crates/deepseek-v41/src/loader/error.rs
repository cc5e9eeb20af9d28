//! The loader's error type: every failure names the file and/or tensor and the values involved.

use std::path::PathBuf;

/// Everything that can go wrong while opening or reading a release checkpoint.
///
/// Converts into [`candle_core::Error`] (as a wrapped error whose message is this `Display`), so
/// library functions can use `?` in `candle_core::Result` code.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// An I/O error on a file (open, stat, mmap, directory listing).
    #[error("checkpoint file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is shorter than its own header says (or shorter than the 8-byte length prefix).
    #[error("checkpoint file {path} is truncated: {detail}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was expected versus found.
        detail: String,
    },
    /// The JSON header cannot be parsed or is structurally wrong.
    #[error("checkpoint file {path} has a corrupt header: {detail}")]
    CorruptHeader {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A tensor's byte range does not match its shape and dtype.
    #[error(
        "header/data length mismatch for tensor `{name}` in {path}: dtype {dtype} shape {shape:?} \
         needs {expected} bytes but its data_offsets span {found} bytes"
    )]
    LengthMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Stored dtype (safetensors spelling).
        dtype: String,
        /// Stored shape.
        shape: Vec<usize>,
        /// Bytes implied by shape and dtype.
        expected: usize,
        /// Bytes spanned by the offsets.
        found: usize,
    },
    /// The same tensor name appears in two files.
    #[error("tensor `{name}` appears in both {first} and {second}")]
    Duplicate {
        /// The tensor.
        name: String,
        /// The file seen first.
        first: PathBuf,
        /// The file seen second.
        second: PathBuf,
    },
    /// `model.safetensors.index.json` is unreadable or inconsistent with the shards.
    #[error("checkpoint index {path}: {detail}")]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A shard named by the index does not exist.
    #[error("shard {shard} referenced by {index} (e.g. for tensor `{tensor}`) is missing")]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The missing shard's path.
        shard: PathBuf,
        /// One tensor the index maps to that shard.
        tensor: String,
    },
    /// A requested tensor does not exist.
    #[error("tensor `{name}` not found in the checkpoint{hint}")]
    Missing {
        /// The tensor.
        name: String,
        /// Extra context (e.g. "it is the scale companion of ...").
        hint: String,
    },
    /// A tensor has a different logical shape than requested.
    #[error("tensor `{name}` has shape {found:?} in the checkpoint, expected {expected:?}")]
    ShapeMismatch {
        /// The tensor.
        name: String,
        /// The shape the caller asked for.
        expected: Vec<usize>,
        /// The logical (dequantized) shape in the checkpoint.
        found: Vec<usize>,
    },
    /// A tensor's dtype or its quantization companion is not a supported combination.
    #[error("tensor `{name}`: {detail}")]
    BadFormat {
        /// The tensor.
        name: String,
        /// What is wrong (dtypes and shapes involved).
        detail: String,
    },
    /// A raw byte buffer passed to a dequantization function has the wrong length.
    #[error("{what}: expected {expected} bytes for {dims}, got {found}")]
    BufferLength {
        /// Which buffer (weight / scale and format).
        what: &'static str,
        /// The logical dims the length was derived from.
        dims: String,
        /// Expected byte count.
        expected: usize,
        /// Actual byte count.
        found: usize,
    },
    /// A row lookup asked for a row outside the table.
    #[error("row {row} out of range for tensor `{name}` with {rows} rows")]
    RowOutOfRange {
        /// The tensor.
        name: String,
        /// The requested row id.
        row: i64,
        /// Number of rows.
        rows: usize,
    },
    /// A tensor too large to materialize densely (the Engram tables): read it by rows.
    #[error(
        "tensor `{name}` {shape:?} would take {bytes} bytes as f32, over the dense limit of {limit}; \
         read it by rows (ReleaseCheckpoint::row_table / get_raw_rows) or raise the limit"
    )]
    TooLarge {
        /// The tensor.
        name: String,
        /// Its logical shape.
        shape: Vec<usize>,
        /// Its dense f32 size.
        bytes: usize,
        /// The limit in force.
        limit: usize,
    },
    /// Tensors of the checkpoint that the model never requested (strict loading).
    #[error("{} checkpoint tensor(s) were never used: {}", names.len(), names.join(", "))]
    Unused {
        /// The unused tensor names (sorted).
        names: Vec<String>,
    },
    /// Problems recorded while loading in "collect" mode (see
    /// [`super::ReleaseCheckpoint::set_collect_missing`]).
    #[error("{} problem(s) while loading: {}", problems.len(), problems.join("; "))]
    Collected {
        /// One message per problem.
        problems: Vec<String>,
    },
}

impl From<LoadError> for candle_core::Error {
    fn from(e: LoadError) -> Self {
        candle_core::Error::wrap(e)
    }
}
