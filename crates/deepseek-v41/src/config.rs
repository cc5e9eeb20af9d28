//! The model configuration: HF `config.json` (V4.1 nests the model under `text_config`,
//! `quantization_config` at top level) or the flat `inference/config.json`, resolved once into
//! [`Config`] with typed per-layer roles ([`LayerRole`]).
//!
//! * [`Config::from_file`] detects the form; [`Config::from_hf_json`] and
//!   [`Config::from_inference_json`] read one form.
//! * Every constructor validates (spec §1.4, §14, §0.1b.5) and resolves the roles; a rejected
//!   config gives a [`ConfigError`] naming the field (as spelled in the file), the layer and the
//!   values.
//! * Fields the released configs omit take the release defaults: `gate_temp` 1.0,
//!   `norm_topk_prob` true, `num_key_value_heads` 1 (the only supported value),
//!   `num_nextn_predict_layers` 0, bos/eos/pad 0/1/2, `engram_pad_token_id` = `pad_token_id`; no
//!   `engram_layer_ids` means no Engram; no `candidate_source_layer_id` means no candidates.

mod error;
mod parse;
mod roles;
mod validate;

use std::path::Path;

use serde::Deserialize;

pub use error::{ConfigError, SourceKind};

/// YaRN scaling of the RoPE frequencies (applied to layers with compress ratio != 0).
#[derive(Debug, Clone, PartialEq)]
pub struct YarnScaling {
    /// Frequency interpolation factor (>= 1; 16 for Flash).
    pub factor: f64,
    /// Rotations above which a pair is not interpolated (> `beta_slow`; 32).
    pub beta_fast: f64,
    /// Rotations below which a pair is fully interpolated (> 0; 1).
    pub beta_slow: f64,
    /// The pre-extension context (65536); `original_seq_len` in `inference/config.json`.
    pub original_max_position_embeddings: usize,
}

/// Weight quantization of a released-format checkpoint (HF `quantization_config`; `dtype =
/// "fp8"` in `inference/config.json`).
///
/// Only the release's scheme is accepted: FP8 e4m3 weights in `weight_block_size` blocks with a
/// UE8M0 scale per block, dynamic FP8 activation quantization, MXFP4 (`expert_dtype = "fp4"`)
/// routed experts. [`Config::quantization`] is `None` for an all-bf16 checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quantization {
    /// `[rows, cols]` of one FP8 weight block with one scale; always `[32, 32]`.
    pub weight_block_size: [usize; 2],
}

/// Router scoring function (`scoring_func`; `score_func` in `inference/config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum ScoringFunc {
    /// sqrt(softplus(logit)) (V4, V4.1).
    #[serde(rename = "sqrtsoftplus")]
    SqrtSoftplus,
}

/// Engram (n-gram memory) configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct EngramConfig {
    /// Layers with an Engram module, strictly ascending, all `< num_hidden_layers`.
    pub layer_ids: Vec<usize>,
    /// Table rows per Engram layer.
    pub num_embeddings: Vec<usize>,
    /// Largest n-gram order; orders 2..=max_ngram_size are hashed.
    pub max_ngram_size: usize,
    /// Start of the prime walk.
    pub vocab_size: usize,
    /// Hash heads per n-gram order.
    pub n_heads: usize,
    /// Width of one table row.
    pub head_dim: usize,
    /// Raw token id used as padding (`engram_pad_token_id`; `engram_pad_id` in
    /// `inference/config.json`); mapped through the compressed token map before hashing.
    pub pad_token_id: u32,
    /// Size of the compressed token id space (99092 for the release tokenizer).
    pub compressed_vocab_size: usize,
}

/// Who supplies a layer's top-k, and what it does with candidate blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CandidateRole {
    /// Neither publishes nor consumes candidate blocks.
    None,
    /// The candidate source: publishes per-token candidate blocks from its own masked scores.
    Publish,
    /// An index source after the candidate source: restricts its scores to the published blocks.
    Consume {
        /// The candidate source layer.
        source: usize,
    },
}

/// How a compressed layer obtains its top-k (spec §1.4 mode names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopkRole {
    /// Kv source and index source: computes its compressed KV, its index keys and a top-k.
    Full {
        /// Whether the layer publishes candidate blocks or restricts its top-k to them.
        candidates: CandidateRole,
    },
    /// Index source that is not a kv source: a fresh top-k against `key_owner`'s index keys.
    Reindex {
        /// The latest kv source at or below the layer, whose index-key cache is scored.
        key_owner: usize,
        /// Whether the fresh top-k is restricted to published candidate blocks.
        candidates: CandidateRole,
    },
    /// Reuses the top-k published by `index_source`.
    Reuse {
        /// The latest index source at or below the layer.
        index_source: usize,
    },
}

/// The attention role of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionRole {
    /// Ratio 0: sliding window only.
    WindowOnly,
    /// Ratio 1 or 2: window plus top-k compressed entries.
    Compressed {
        /// Compress ratio (1 or 2).
        ratio: usize,
        /// The latest kv source at or below this layer (owns the compressed cache read here).
        kv_source: usize,
        /// Where the top-k comes from.
        topk: TopkRole,
    },
}

/// The resolved role of one backbone layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRole {
    /// The layer index.
    pub layer: usize,
    /// How the layer attends.
    pub attention: AttentionRole,
    /// Whether an Engram module runs before this layer's mixes.
    pub engram: bool,
}

/// The resolved text-model configuration (HF names; `inference/config.json` names in brackets).
///
/// Built by [`Config::from_file`], [`Config::from_hf_json`] or [`Config::from_inference_json`],
/// which validate it and fill [`Config::layers`]. After editing fields in code, call
/// [`Config::resolve`] to re-validate and re-resolve the roles.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Token vocabulary (129280).
    pub vocab_size: usize,
    /// Residual width D (`dim`; 5120); a multiple of 32.
    pub hidden_size: usize,
    /// Backbone layers (`n_layers`; 40), MTP layers excluded.
    pub num_hidden_layers: usize,
    /// Attention heads H (`n_heads`; 64); divisible by `o_groups`.
    pub num_attention_heads: usize,
    /// Per-head q/k/v width and the width of the single KV row (512); a multiple of 32.
    pub head_dim: usize,
    /// Rotated dims at the end of each head (`rope_head_dim`; 64); even, `< head_dim`.
    pub qk_rope_head_dim: usize,
    /// Query LoRA rank (1280).
    pub q_lora_rank: usize,
    /// Output LoRA rank per group (1024).
    pub o_lora_rank: usize,
    /// Output groups of `wo_a` (8).
    pub o_groups: usize,
    /// Epsilon of every RMSNorm of the text stack (`norm_eps`; 1e-20).
    pub rms_norm_eps: f64,
    /// RoPE base of ratio-0 layers (10000).
    pub rope_theta: f64,
    /// RoPE base of layers with ratio != 0 (160000).
    pub compress_rope_theta: f64,
    /// YaRN scaling of layers with ratio != 0 (`rope_factor`, `beta_fast`, `beta_slow`,
    /// `original_seq_len`).
    pub rope_scaling: Option<YarnScaling>,
    /// Longest supported context (`max_seq_len`, else `original_seq_len * rope_factor`; 1048576).
    pub max_position_embeddings: usize,
    /// Routed experts (384).
    pub n_routed_experts: usize,
    /// Always-active shared experts (1).
    pub n_shared_experts: usize,
    /// Routed experts per token (`n_activated_experts`; 6).
    pub num_experts_per_tok: usize,
    /// Expert hidden width (`moe_inter_dim`; 2304).
    pub moe_intermediate_size: usize,
    /// Routing weight scale (`route_scale`; 1.5).
    pub routed_scaling_factor: f64,
    /// Router logit temperature (default 1.0).
    pub gate_temp: f64,
    /// Expert activation clamp (10.0).
    pub swiglu_limit: f64,
    /// Router scoring (`score_func`).
    pub scoring_func: ScoringFunc,
    /// Renormalize the selected routing weights (default true).
    pub norm_topk_prob: bool,
    /// Sliding window W (`window_size`; 128).
    pub sliding_window: usize,
    /// Raw list, may include MTP entries beyond `num_hidden_layers`.
    pub compress_ratios: Vec<usize>,
    /// Layers owning a compressor, a compressed cache and an index-key cache
    /// (`kv_source_layers`), strictly ascending.
    pub kv_source_layer_ids: Vec<usize>,
    /// Layers computing a top-k (`index_source_layers`), strictly ascending.
    pub index_source_layer_ids: Vec<usize>,
    /// Index heads H_I (32).
    pub index_n_heads: usize,
    /// Index head width d_I (128).
    pub index_head_dim: usize,
    /// Compressed entries selected per token K (512).
    pub index_topk: usize,
    /// The layer publishing candidate blocks (`candidate_source_layer`; 20).
    pub candidate_source_layer_id: Option<usize>,
    /// Candidate blocks kept per token (2048); 0 when there is no candidate source.
    pub candidate_topk_blocks: usize,
    /// Entries per candidate block (8); 0 when there is no candidate source.
    pub candidate_block_size: usize,
    /// mHC stream copies (4).
    pub hc_mult: usize,
    /// Sinkhorn iterations of the mHC combination (20).
    pub hc_sinkhorn_iters: usize,
    /// mHC epsilon (1e-6).
    pub hc_eps: f64,
    /// Engram settings; `None` without `engram_layer_ids`.
    pub engram: Option<EngramConfig>,
    /// Begin-of-sequence token (default 0).
    pub bos_token_id: u32,
    /// End-of-sequence token (default 1).
    pub eos_token_id: u32,
    /// Padding token (default 2).
    pub pad_token_id: u32,
    /// Image placeholder token (129264), if given.
    pub image_token_id: Option<u32>,
    /// MTP layers (`n_mtp_layers`; 3), not part of the backbone.
    pub num_nextn_predict_layers: usize,
    /// Weight quantization; `None` for an all-bf16 checkpoint.
    pub quantization: Option<Quantization>,
    /// Resolved roles of the backbone layers `0..num_hidden_layers`.
    pub layers: Vec<LayerRole>,
}

impl Config {
    /// Reads a `config.json` in either form: the HF form (a `text_config` object, or HF names
    /// such as `hidden_size` at the top level) or the flat `inference/config.json` (`dim`,
    /// `n_layers`, ...). Validates it and resolves the layer roles.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|error| ConfigError::Io { path: path.to_path_buf(), error })?;
        Self::from_json(&text)
    }

    /// Like [`Config::from_file`], from JSON text: detects the form, validates, resolves roles.
    pub fn from_json(json: &str) -> Result<Config, ConfigError> {
        let (cfg, form) = parse::from_any_json(json)?;
        cfg.finish(form)
    }

    /// Reads the HF `config.json`: model fields under `text_config`, `quantization_config` and
    /// the bos/eos/pad/image token ids at the top level; a flat document with the same field
    /// names is accepted too. Validates it and resolves the layer roles.
    pub fn from_hf_json(json: &str) -> Result<Config, ConfigError> {
        let (cfg, form) = parse::from_hf_json(json)?;
        cfg.finish(form)
    }

    /// Reads the official flat `inference/config.json` (`dim`, `n_layers`, `n_heads`,
    /// `moe_inter_dim`, `n_activated_experts`, `score_func`, `route_scale`, `norm_eps`,
    /// `rope_head_dim`, `window_size`, `original_seq_len`, `rope_factor`, `beta_fast`,
    /// `beta_slow`, `engram_pad_id`, `n_mtp_layers`, `dtype`, `expert_dtype`, ...). Validates it
    /// and resolves the layer roles.
    pub fn from_inference_json(json: &str) -> Result<Config, ConfigError> {
        let (cfg, form) = parse::from_inference_json(json)?;
        cfg.finish(form)
    }

    fn finish(mut self, form: parse::Form) -> Result<Config, ConfigError> {
        validate::validate(&self, form)?;
        self.layers = roles::resolve(&self, form)?;
        Ok(self)
    }

    /// Re-validates a configuration edited in code and recomputes [`Config::layers`].
    pub fn resolve(self) -> Result<Config, ConfigError> {
        self.finish(parse::Form::HfFlat)
    }

    /// Checks every invariant (fields, lists and per-layer roles) without modifying `self`;
    /// errors use the HF field names. Does not compare [`Config::layers`] with the lists.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate::validate(self, parse::Form::HfFlat)?;
        roles::resolve(self, parse::Form::HfFlat).map(|_| ())
    }

    /// The number of backbone layers (`num_hidden_layers`).
    pub fn n_layers(&self) -> usize {
        self.num_hidden_layers
    }

    /// The resolved role of backbone layer `layer`, `None` when `layer >= n_layers()`.
    pub fn role(&self, layer: usize) -> Option<&LayerRole> {
        self.layers.get(layer)
    }

    /// The compress ratio of backbone layer `layer` (0, 1 or 2), `None` when out of range.
    pub fn compress_ratio(&self, layer: usize) -> Option<usize> {
        if layer < self.num_hidden_layers {
            self.compress_ratios.get(layer).copied()
        } else {
            None
        }
    }

    /// Whether `layer` owns a compressor, a compressed cache and an index-key cache.
    pub fn is_kv_source(&self, layer: usize) -> bool {
        self.kv_source_layer_ids.binary_search(&layer).is_ok()
    }

    /// Whether `layer` computes its own top-k (owns `indexer.wq_b` and `indexer.weights_proj`).
    pub fn is_index_source(&self, layer: usize) -> bool {
        self.index_source_layer_ids.binary_search(&layer).is_ok()
    }

    /// Whether `layer` publishes candidate blocks.
    pub fn is_candidate_source(&self, layer: usize) -> bool {
        self.candidate_source_layer_id == Some(layer)
    }

    /// Whether an Engram module runs before `layer`'s mixes.
    pub fn is_engram_layer(&self, layer: usize) -> bool {
        self.engram_slot(layer).is_some()
    }

    /// The position of `layer` in `engram.layer_ids` (which indexes `engram.num_embeddings`),
    /// `None` when `layer` has no Engram.
    pub fn engram_slot(&self, layer: usize) -> Option<usize> {
        self.engram.as_ref()?.layer_ids.binary_search(&layer).ok()
    }

    /// The latest kv source at or below `layer` (whose compressed and index-key caches a
    /// compressed `layer` reads), if any.
    pub fn latest_kv_source(&self, layer: usize) -> Option<usize> {
        roles::latest_at_or_below(&self.kv_source_layer_ids, layer)
    }

    /// The latest index source at or below `layer` (whose top-k a compressed `layer` uses), if
    /// any.
    pub fn latest_index_source(&self, layer: usize) -> Option<usize> {
        roles::latest_at_or_below(&self.index_source_layer_ids, layer)
    }

    /// Non-rotated dims per head, `head_dim - qk_rope_head_dim` (448).
    pub fn nope_head_dim(&self) -> usize {
        self.head_dim.saturating_sub(self.qk_rope_head_dim)
    }

    /// Heads per output group, `num_attention_heads / o_groups` (8).
    pub fn heads_per_group(&self) -> usize {
        self.num_attention_heads.checked_div(self.o_groups).unwrap_or(0)
    }
}
