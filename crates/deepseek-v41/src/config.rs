//! The model configuration: HF `config.json` (V4.1 nests the model under `text_config`,
//! `quantization_config` at top level) or the flat `inference/config.json`, resolved once into
//! [`Config`] with typed per-layer roles ([`LayerRole`]).
//!
//! SKELETON: the types below are the contract other modules code against. Parsing and
//! validation are filled in by the config work item.

use serde::Deserialize;

/// YaRN scaling of the RoPE frequencies (applied to layers with compress ratio != 0).
#[derive(Debug, Clone, PartialEq)]
pub struct YarnScaling {
    pub factor: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub original_max_position_embeddings: usize,
}

/// Router scoring function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum ScoringFunc {
    /// sqrt(softplus(logit)) (V4, V4.1).
    #[serde(rename = "sqrtsoftplus")]
    SqrtSoftplus,
}

/// Engram (n-gram memory) configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct EngramConfig {
    pub layer_ids: Vec<usize>,
    /// Table rows per Engram layer.
    pub num_embeddings: Vec<usize>,
    /// Largest n-gram order; orders 2..=max_ngram_size are hashed.
    pub max_ngram_size: usize,
    /// Start of the prime walk.
    pub vocab_size: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    pub pad_token_id: u32,
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
    Consume { source: usize },
}

/// How a compressed layer obtains its top-k (spec §1.4 mode names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopkRole {
    /// Kv source and index source: computes its compressed KV, its index keys and a top-k.
    Full { candidates: CandidateRole },
    /// Index source that is not a kv source: a fresh top-k against `key_owner`'s index keys.
    Reindex { key_owner: usize, candidates: CandidateRole },
    /// Reuses the top-k published by `index_source`.
    Reuse { index_source: usize },
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
        topk: TopkRole,
    },
}

/// The resolved role of one backbone layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRole {
    pub layer: usize,
    pub attention: AttentionRole,
    /// Whether an Engram module runs before this layer's mixes.
    pub engram: bool,
}

/// The resolved text-model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub q_lora_rank: usize,
    pub o_lora_rank: usize,
    pub o_groups: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    pub rope_scaling: Option<YarnScaling>,
    pub max_position_embeddings: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub routed_scaling_factor: f64,
    pub gate_temp: f64,
    pub swiglu_limit: f64,
    pub scoring_func: ScoringFunc,
    pub norm_topk_prob: bool,
    pub sliding_window: usize,
    /// Raw list, may include MTP entries beyond `num_hidden_layers`.
    pub compress_ratios: Vec<usize>,
    pub kv_source_layer_ids: Vec<usize>,
    pub index_source_layer_ids: Vec<usize>,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub candidate_source_layer_id: Option<usize>,
    pub candidate_topk_blocks: usize,
    pub candidate_block_size: usize,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f64,
    pub engram: Option<EngramConfig>,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: u32,
    pub image_token_id: Option<u32>,
    pub num_nextn_predict_layers: usize,
    /// Resolved roles of the backbone layers `0..num_hidden_layers`.
    pub layers: Vec<LayerRole>,
}
