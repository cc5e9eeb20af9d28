//! [`ConfigError`]: why a `config.json` was rejected, naming the field, the layer and the values.

use std::path::PathBuf;

/// Which of the three "latest source at or below a layer" lookups an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// `kv_source_layer_ids`: owners of a compressor, a compressed cache and an index-key cache.
    Kv,
    /// `index_source_layer_ids`: layers that compute a top-k.
    Index,
}

impl std::fmt::Display for SourceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SourceKind::Kv => "kv",
            SourceKind::Index => "index",
        })
    }
}

/// A configuration that cannot be read, or that violates an invariant of the architecture
/// (spec §1.4, §14, §0.1b).
///
/// Field names are spelled as in the file that was read: `text_config.head_dim` for the nested HF
/// form, `head_dim` for the flat forms, `n_layers` (not `num_hidden_layers`) for
/// `inference/config.json`. Converts into [`candle_core::Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        error: std::io::Error,
    },
    /// The text is not JSON (the message carries line and column).
    #[error("config is not valid JSON: {0}")]
    Syntax(#[source] serde_json::Error),
    /// A field that must hold a JSON object holds something else (`<root>` for the document).
    #[error("`{field}` must be a JSON object")]
    NotAnObject {
        /// The field.
        field: String,
    },
    /// The document is neither the HF form nor the `inference/config.json` form.
    #[error(
        "cannot tell the config form: expected `text_config` or `hidden_size` (HF config.json) \
         or `dim` (inference/config.json) at the top level"
    )]
    UnknownForm,
    /// A field holds a value of the wrong JSON type (or a negative count, ...).
    #[error("field `{field}`: {message}")]
    FieldType {
        /// The field (`<config>` when serde cannot name it).
        field: String,
        /// serde's message.
        message: String,
    },
    /// A required field is absent (or `null`).
    #[error("missing required field `{field}`{because}")]
    MissingField {
        /// The field.
        field: String,
        /// Empty, or ` (required when ...)`.
        because: String,
    },
    /// Two spellings of the same field are both present.
    #[error("fields `{first}` and `{second}` name the same setting; give only one")]
    DuplicateField {
        /// One spelling.
        first: String,
        /// The other spelling.
        second: String,
    },
    /// A scalar field is out of its valid range.
    #[error("`{field}` = {value}: {requirement}")]
    InvalidValue {
        /// The field.
        field: String,
        /// Its value, as written.
        value: String,
        /// The range it must be in, in words.
        requirement: String,
    },
    /// A value the architecture could take but this implementation does not support.
    #[error("`{field}` = {value} is not supported: {supported}")]
    Unsupported {
        /// The field.
        field: String,
        /// Its value, as written.
        value: String,
        /// What this implementation supports, in words.
        supported: String,
    },
    /// A compress ratio outside {0, 1, 2} (spec §14 item 1).
    #[error("layer {layer}: compress_ratios[{layer}] = {ratio}; V4.1 compress ratios are 0, 1 or 2")]
    BadRatio {
        /// The layer.
        layer: usize,
        /// Its compress ratio.
        ratio: usize,
    },
    /// A layer-id list that is not strictly ascending (unsorted or duplicated).
    #[error("`{field}` must be strictly ascending: entry {index} = {value} follows {previous}")]
    NotAscending {
        /// The list.
        field: String,
        /// Position in the list of the first offending entry.
        index: usize,
        /// The entry before it.
        previous: usize,
        /// The offending entry.
        value: usize,
    },
    /// A source (or Engram) layer outside the backbone `0..num_hidden_layers`.
    #[error(
        "layer {layer}: listed in `{field}` but the backbone has {num_hidden_layers} layers \
         (0..={last}); MTP layers cannot be listed",
        last = num_hidden_layers.saturating_sub(1)
    )]
    LayerOutOfRange {
        /// The list.
        field: String,
        /// The listed layer.
        layer: usize,
        /// The number of backbone layers.
        num_hidden_layers: usize,
    },
    /// A source layer whose compress ratio is 0 (sources need a compressed path).
    #[error("layer {layer}: listed in `{field}` but compress_ratios[{layer}] = 0 (a source needs ratio 1 or 2)")]
    SourceWithoutCompression {
        /// The source list.
        field: String,
        /// The listed layer.
        layer: usize,
    },
    /// A kv source that is not an index source.
    #[error(
        "layer {layer}: listed in `{kv_field}` but not in `{index_field}` (every kv source must be an index source)"
    )]
    KvSourceNotIndexSource {
        /// The kv source layer.
        layer: usize,
        /// The kv source list.
        kv_field: String,
        /// The index source list.
        index_field: String,
    },
    /// The candidate source is not an index source.
    #[error(
        "layer {layer}: `{field}` = {layer} but layer {layer} is not in `{index_field}` \
         (the candidate source must be an index source)"
    )]
    CandidateNotIndexSource {
        /// The candidate source layer.
        layer: usize,
        /// The field naming the candidate source.
        field: String,
        /// The index source list.
        index_field: String,
    },
    /// A compressed layer with no source of the given kind at or below it.
    #[error(
        "layer {layer}: compress_ratios[{layer}] = {ratio} but no layer <= {layer} is in `{field}` \
         (a compressed layer needs a {kind} source at or below it)"
    )]
    NoSource {
        /// The compressed layer.
        layer: usize,
        /// Its compress ratio.
        ratio: usize,
        /// Which kind of source is missing.
        kind: SourceKind,
        /// The source list searched.
        field: String,
    },
    /// The latest source at or below a compressed layer has a different ratio (spec §0.1b.5).
    #[error(
        "layer {layer}: compress_ratios[{layer}] = {ratio} but its latest {kind} source \
         (layer {source_layer}) has ratio {source_ratio}"
    )]
    SourceRatioMismatch {
        /// The compressed layer.
        layer: usize,
        /// Its compress ratio.
        ratio: usize,
        /// Which kind of source.
        kind: SourceKind,
        /// The latest source of that kind at or below `layer`.
        source_layer: usize,
        /// The source's compress ratio.
        source_ratio: usize,
    },
    /// A candidate consumer whose ratio differs from the candidate source's (block ids would
    /// index a different entry space).
    #[error(
        "layer {layer}: consumes the candidate blocks of layer {source_layer} but \
         compress_ratios[{layer}] = {ratio} differs from compress_ratios[{source_layer}] = {source_ratio}"
    )]
    CandidateRatioMismatch {
        /// The consuming layer.
        layer: usize,
        /// Its compress ratio.
        ratio: usize,
        /// The candidate source layer.
        source_layer: usize,
        /// The candidate source's compress ratio.
        source_ratio: usize,
    },
    /// The candidate pool cannot hold `index_topk` entries (spec §1.4).
    #[error(
        "candidate pool too small: `{blocks_field}` = {blocks} and `{size_field}` = {block_size} give \
         {blocks} * {block_size} - ({block_size} - 1) = {pool} candidate entries, fewer than \
         `{topk_field}` = {index_topk}"
    )]
    CandidatePoolTooSmall {
        /// The field giving the number of candidate blocks.
        blocks_field: String,
        /// The field giving the block size.
        size_field: String,
        /// The `index_topk` field.
        topk_field: String,
        /// Number of candidate blocks.
        blocks: usize,
        /// Block size, in compressed entries.
        block_size: usize,
        /// The guaranteed candidate entries, `blocks * block_size - (block_size - 1)`.
        pool: usize,
        /// The top-k it must hold.
        index_topk: usize,
    },
    /// Two lists that must have one entry per item have different lengths.
    #[error("`{field}` has {len} entries but `{other_field}` has {other_len}; they must match")]
    LengthMismatch {
        /// One list.
        field: String,
        /// Its length.
        len: usize,
        /// The other list.
        other_field: String,
        /// Its length.
        other_len: usize,
    },
}

impl From<ConfigError> for candle_core::Error {
    fn from(e: ConfigError) -> Self {
        candle_core::Error::wrap(e)
    }
}
