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
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    /// The text is not JSON (the message carries line and column).
    #[error("config is not valid JSON: {0}")]
    Syntax(#[source] serde_json::Error),
    /// A field that must hold a JSON object holds something else (`<root>` for the document).
    #[error("`{field}` must be a JSON object")]
    NotAnObject { field: String },
    /// The document is neither the HF form nor the `inference/config.json` form.
    #[error(
        "cannot tell the config form: expected `text_config` or `hidden_size` (HF config.json) \
         or `dim` (inference/config.json) at the top level"
    )]
    UnknownForm,
    /// A field holds a value of the wrong JSON type (or a negative count, ...).
    #[error("field `{field}`: {message}")]
    FieldType { field: String, message: String },
    /// A required field is absent (or `null`).
    #[error("missing required field `{field}`{because}")]
    MissingField {
        field: String,
        /// Empty, or ` (required when ...)`.
        because: String,
    },
    /// Two spellings of the same field are both present.
    #[error("fields `{first}` and `{second}` name the same setting; give only one")]
    DuplicateField { first: String, second: String },
    /// A scalar field is out of its valid range.
    #[error("`{field}` = {value}: {requirement}")]
    InvalidValue { field: String, value: String, requirement: String },
    /// A value the architecture could take but this implementation does not support.
    #[error("`{field}` = {value} is not supported: {supported}")]
    Unsupported { field: String, value: String, supported: String },
    /// A compress ratio outside {0, 1, 2} (spec §14 item 1).
    #[error("layer {layer}: compress_ratios[{layer}] = {ratio}; V4.1 compress ratios are 0, 1 or 2")]
    BadRatio { layer: usize, ratio: usize },
    /// A layer-id list that is not strictly ascending (unsorted or duplicated).
    #[error("`{field}` must be strictly ascending: entry {index} = {value} follows {previous}")]
    NotAscending { field: String, index: usize, previous: usize, value: usize },
    /// A source (or Engram) layer outside the backbone `0..num_hidden_layers`.
    #[error(
        "layer {layer}: listed in `{field}` but the backbone has {num_hidden_layers} layers \
         (0..={last}); MTP layers cannot be listed",
        last = num_hidden_layers.saturating_sub(1)
    )]
    LayerOutOfRange { field: String, layer: usize, num_hidden_layers: usize },
    /// A source layer whose compress ratio is 0 (sources need a compressed path).
    #[error("layer {layer}: listed in `{field}` but compress_ratios[{layer}] = 0 (a source needs ratio 1 or 2)")]
    SourceWithoutCompression { field: String, layer: usize },
    /// A kv source that is not an index source.
    #[error(
        "layer {layer}: listed in `{kv_field}` but not in `{index_field}` (every kv source must be an index source)"
    )]
    KvSourceNotIndexSource { layer: usize, kv_field: String, index_field: String },
    /// The candidate source is not an index source.
    #[error(
        "layer {layer}: `{field}` = {layer} but layer {layer} is not in `{index_field}` \
         (the candidate source must be an index source)"
    )]
    CandidateNotIndexSource { layer: usize, field: String, index_field: String },
    /// A compressed layer with no source of the given kind at or below it.
    #[error(
        "layer {layer}: compress_ratios[{layer}] = {ratio} but no layer <= {layer} is in `{field}` \
         (a compressed layer needs a {kind} source at or below it)"
    )]
    NoSource { layer: usize, ratio: usize, kind: SourceKind, field: String },
    /// The latest source at or below a compressed layer has a different ratio (spec §0.1b.5).
    #[error(
        "layer {layer}: compress_ratios[{layer}] = {ratio} but its latest {kind} source \
         (layer {source_layer}) has ratio {source_ratio}"
    )]
    SourceRatioMismatch { layer: usize, ratio: usize, kind: SourceKind, source_layer: usize, source_ratio: usize },
    /// A candidate consumer whose ratio differs from the candidate source's (block ids would
    /// index a different entry space).
    #[error(
        "layer {layer}: consumes the candidate blocks of layer {source_layer} but \
         compress_ratios[{layer}] = {ratio} differs from compress_ratios[{source_layer}] = {source_ratio}"
    )]
    CandidateRatioMismatch { layer: usize, ratio: usize, source_layer: usize, source_ratio: usize },
    /// The candidate pool cannot hold `index_topk` entries (spec §1.4).
    #[error(
        "candidate pool too small: `{blocks_field}` = {blocks} and `{size_field}` = {block_size} give \
         {blocks} * {block_size} - ({block_size} - 1) = {pool} candidate entries, fewer than \
         `{topk_field}` = {index_topk}"
    )]
    CandidatePoolTooSmall {
        blocks_field: String,
        size_field: String,
        topk_field: String,
        blocks: usize,
        block_size: usize,
        pool: usize,
        index_topk: usize,
    },
    /// Two lists that must have one entry per item have different lengths.
    #[error("`{field}` has {len} entries but `{other_field}` has {other_len}; they must match")]
    LengthMismatch { field: String, len: usize, other_field: String, other_len: usize },
}

impl From<ConfigError> for candle_core::Error {
    fn from(e: ConfigError) -> Self {
        candle_core::Error::wrap(e)
    }
}
