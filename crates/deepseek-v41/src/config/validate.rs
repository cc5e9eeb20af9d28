//! Field- and list-level invariants (spec §1.4, §14, §0.1b.5); the per-layer ones are checked
//! while resolving roles (`roles.rs`).

use super::parse::Form;
use super::{Config, ConfigError};

/// The names a check reports, in the file's spelling.
struct Checker {
    form: Form,
}

impl Checker {
    fn invalid(&self, key: &str, value: impl ToString, requirement: impl Into<String>) -> ConfigError {
        ConfigError::InvalidValue {
            field: self.form.name(key),
            value: value.to_string(),
            requirement: requirement.into(),
        }
    }

    fn at_least(&self, key: &str, value: usize, min: usize) -> Result<(), ConfigError> {
        if value < min {
            return Err(self.invalid(key, value, format!("must be at least {min}")));
        }
        Ok(())
    }

    fn at_most(&self, key: &str, value: usize, max: usize, what: &str) -> Result<(), ConfigError> {
        if value > max {
            return Err(self.invalid(key, value, format!("must be at most {max} ({what} this implementation supports)")));
        }
        Ok(())
    }

    fn multiple_of(&self, key: &str, value: usize, m: usize, why: &str) -> Result<(), ConfigError> {
        if value == 0 || !value.is_multiple_of(m) {
            return Err(self.invalid(key, value, format!("must be a positive multiple of {m} ({why})")));
        }
        Ok(())
    }

    fn positive_finite(&self, key: &str, value: f64) -> Result<(), ConfigError> {
        if !(value.is_finite() && value > 0.0) {
            return Err(self.invalid(key, value, "must be finite and > 0"));
        }
        Ok(())
    }

    fn token_id(&self, key: &str, id: u32, vocab: usize) -> Result<(), ConfigError> {
        if id as usize >= vocab {
            return Err(self.invalid(key, id, format!("must be < {} = {vocab}", self.form.name("vocab_size"))));
        }
        Ok(())
    }

    /// `ids` strictly ascending and inside the backbone.
    fn layer_list(&self, key: &str, ids: &[usize], n_layers: usize) -> Result<(), ConfigError> {
        for (index, pair) in ids.windows(2).enumerate() {
            if pair[1] <= pair[0] {
                return Err(ConfigError::NotAscending {
                    field: self.form.name(key),
                    index: index + 1,
                    previous: pair[0],
                    value: pair[1],
                });
            }
        }
        if let Some(&layer) = ids.iter().find(|&&l| l >= n_layers) {
            return Err(ConfigError::LayerOutOfRange {
                field: self.form.name(key),
                layer,
                num_hidden_layers: n_layers,
            });
        }
        Ok(())
    }
}

fn check_dims(c: &Checker, cfg: &Config) -> Result<(), ConfigError> {
    c.at_least("vocab_size", cfg.vocab_size, 1)?;
    c.at_least("num_hidden_layers", cfg.num_hidden_layers, 1)?;
    c.multiple_of("hidden_size", cfg.hidden_size, 32, "FP8 weight blocks and 1x32 activation quantization")?;
    c.at_least("num_attention_heads", cfg.num_attention_heads, 1)?;
    c.at_least("o_groups", cfg.o_groups, 1)?;
    if !cfg.num_attention_heads.is_multiple_of(cfg.o_groups) {
        return Err(c.invalid(
            "num_attention_heads",
            cfg.num_attention_heads,
            format!("must be divisible by {} = {}", c.form.name("o_groups"), cfg.o_groups),
        ));
    }
    let rope = cfg.qk_rope_head_dim;
    if rope == 0 || !rope.is_multiple_of(2) {
        return Err(c.invalid("qk_rope_head_dim", rope, "must be positive and even (GPT-J rotation pairs)"));
    }
    c.multiple_of("head_dim", cfg.head_dim, 32, "FP8 window-KV blocks of 32 and FP4 compressed-KV blocks of 16")?;
    if cfg.head_dim <= rope {
        let rope_key = c.form.name("qk_rope_head_dim");
        return Err(c.invalid("head_dim", cfg.head_dim, format!("must exceed {rope_key} = {rope}")));
    }
    c.multiple_of("q_lora_rank", cfg.q_lora_rank, 32, "input of the FP8 wq_b")?;
    c.multiple_of("o_lora_rank", cfg.o_lora_rank, 32, "input blocks of the FP8 wo_b")?;
    c.multiple_of("moe_intermediate_size", cfg.moe_intermediate_size, 32, "input of the MXFP4 w2")?;
    c.at_least("index_n_heads", cfg.index_n_heads, 1)?;
    c.multiple_of("index_head_dim", cfg.index_head_dim, 32, "FP4 index q/k blocks of 32")?;
    if cfg.index_head_dim <= rope {
        return Err(c.invalid(
            "index_head_dim",
            cfg.index_head_dim,
            format!(
                "must exceed {} = {rope} (index heads rotate their last {rope} dims)",
                c.form.name("qk_rope_head_dim")
            ),
        ));
    }
    c.at_least("index_topk", cfg.index_topk, 1)?;
    c.at_least("sliding_window", cfg.sliding_window, 1)?;
    c.at_least("max_position_embeddings", cfg.max_position_embeddings, 1)?;
    c.at_least("hc_mult", cfg.hc_mult, 1)?;
    c.at_least("hc_sinkhorn_iters", cfg.hc_sinkhorn_iters, 1)?;
    // Fields that size run-time work with no weight shape to check them against (a cache ring
    // allocated up front, a loop count): bounded so that a typo errors instead of allocating or
    // looping without end. The released model: 1,048,576 positions, window 128, 20 iterations.
    c.at_most("max_position_embeddings", cfg.max_position_embeddings, MAX_POSITIONS, "positions")?;
    c.at_most("sliding_window", cfg.sliding_window, MAX_WINDOW.min(cfg.max_position_embeddings), "window rows (and no more than the context)")?;
    c.at_most("hc_sinkhorn_iters", cfg.hc_sinkhorn_iters, MAX_SINKHORN_ITERS, "Sinkhorn iterations")?;
    Ok(())
}

/// The most positions a config may declare (16× the released 1,048,576).
pub const MAX_POSITIONS: usize = 1 << 24;
/// The longest sliding window a config may declare (the ring is allocated per layer up front).
pub const MAX_WINDOW: usize = 1 << 16;
/// The most mHC Sinkhorn iterations a config may declare.
pub const MAX_SINKHORN_ITERS: usize = 1000;

fn check_scalars(c: &Checker, cfg: &Config) -> Result<(), ConfigError> {
    c.positive_finite("rms_norm_eps", cfg.rms_norm_eps)?;
    c.positive_finite("hc_eps", cfg.hc_eps)?;
    c.positive_finite("routed_scaling_factor", cfg.routed_scaling_factor)?;
    c.positive_finite("gate_temp", cfg.gate_temp)?;
    c.positive_finite("swiglu_limit", cfg.swiglu_limit)?;
    for (key, theta) in [("rope_theta", cfg.rope_theta), ("compress_rope_theta", cfg.compress_rope_theta)] {
        if !(theta.is_finite() && theta > 1.0) {
            return Err(c.invalid(key, theta, "must be finite and > 1"));
        }
    }
    if let Some(y) = &cfg.rope_scaling {
        if !(y.factor.is_finite() && y.factor >= 1.0) {
            return Err(c.invalid("rope_scaling.factor", y.factor, "must be finite and >= 1"));
        }
        c.positive_finite("rope_scaling.beta_slow", y.beta_slow)?;
        if !(y.beta_fast.is_finite() && y.beta_fast > y.beta_slow) {
            return Err(c.invalid(
                "rope_scaling.beta_fast",
                y.beta_fast,
                format!("must be finite and > {} = {}", c.form.name("rope_scaling.beta_slow"), y.beta_slow),
            ));
        }
        c.at_least("rope_scaling.original_max_position_embeddings", y.original_max_position_embeddings, 1)?;
    }
    c.at_least("n_routed_experts", cfg.n_routed_experts, 1)?;
    c.at_least("num_experts_per_tok", cfg.num_experts_per_tok, 1)?;
    if cfg.num_experts_per_tok > cfg.n_routed_experts {
        return Err(c.invalid(
            "num_experts_per_tok",
            cfg.num_experts_per_tok,
            format!("must be <= {} = {}", c.form.name("n_routed_experts"), cfg.n_routed_experts),
        ));
    }
    c.token_id("bos_token_id", cfg.bos_token_id, cfg.vocab_size)?;
    c.token_id("eos_token_id", cfg.eos_token_id, cfg.vocab_size)?;
    c.token_id("pad_token_id", cfg.pad_token_id, cfg.vocab_size)?;
    // `image_token_id` may lie outside the vocab: text-only checkpoints (the embedded
    // Shakespeare model) set it to `vocab_size` so that no real token is an image token.
    Ok(())
}

fn check_engram(c: &Checker, cfg: &Config) -> Result<(), ConfigError> {
    let Some(e) = &cfg.engram else { return Ok(()) };
    c.layer_list("engram_layer_ids", &e.layer_ids, cfg.num_hidden_layers)?;
    if e.num_embeddings.len() != e.layer_ids.len() {
        return Err(ConfigError::LengthMismatch {
            field: c.form.name("engram_num_embeddings"),
            len: e.num_embeddings.len(),
            other_field: c.form.name("engram_layer_ids"),
            other_len: e.layer_ids.len(),
        });
    }
    if let Some((i, &rows)) = e.num_embeddings.iter().enumerate().find(|(_, &r)| r == 0) {
        return Err(c.invalid(&format!("engram_num_embeddings[{i}]"), rows, "must be at least 1"));
    }
    c.at_least("engram_max_ngram_size", e.max_ngram_size, 2)?;
    c.at_least("engram_n_heads", e.n_heads, 1)?;
    c.at_least("engram_head_dim", e.head_dim, 1)?;
    c.at_least("engram_vocab_size", e.vocab_size, 1)?;
    let wkv_in = (e.max_ngram_size - 1).checked_mul(e.n_heads).and_then(|x| x.checked_mul(e.head_dim));
    let Some(wkv_in) = wkv_in else {
        return Err(c.invalid(
            "engram_head_dim",
            e.head_dim,
            format!(
                "(engram_max_ngram_size - 1) * engram_n_heads * engram_head_dim = {} * {} * {} overflows",
                e.max_ngram_size - 1,
                e.n_heads,
                e.head_dim
            ),
        ));
    };
    if !wkv_in.is_multiple_of(32) {
        return Err(c.invalid(
            "engram_head_dim",
            e.head_dim,
            format!(
                "(engram_max_ngram_size - 1) * engram_n_heads * engram_head_dim = {} * {} * {} = {wkv_in} \
                 must be a multiple of 32 (input of the FP8 engram.wkv)",
                e.max_ngram_size - 1,
                e.n_heads,
                e.head_dim
            ),
        ));
    }
    c.at_least("engram_compressed_vocab_size", e.compressed_vocab_size, 1)?;
    if e.compressed_vocab_size > cfg.vocab_size {
        return Err(c.invalid(
            "engram_compressed_vocab_size",
            e.compressed_vocab_size,
            format!("must be <= {} = {}", c.form.name("vocab_size"), cfg.vocab_size),
        ));
    }
    c.token_id("engram_pad_token_id", e.pad_token_id, cfg.vocab_size)
}

/// The compress-ratio list and the source lists (spec §1.4, §14 items 1–2).
fn check_lists(c: &Checker, cfg: &Config) -> Result<(), ConfigError> {
    let n = cfg.num_hidden_layers;
    let ratios = &cfg.compress_ratios;
    let with_mtp = n + cfg.num_nextn_predict_layers;
    if ratios.len() != n && ratios.len() != with_mtp {
        let (n_key, mtp_key) = (c.form.name("num_hidden_layers"), c.form.name("num_nextn_predict_layers"));
        let counts = if with_mtp == n { format!("exactly {n}") } else { format!("{n} or {with_mtp}") };
        return Err(c.invalid(
            "compress_ratios",
            format!("a list of {} entries", ratios.len()),
            format!(
                "needs one entry per backbone layer ({n_key} = {n}), optionally followed by one per MTP \
                 layer ({mtp_key} = {}): {counts} entries",
                cfg.num_nextn_predict_layers
            ),
        ));
    }
    if let Some((layer, &ratio)) = ratios.iter().enumerate().find(|(_, &r)| r > 2) {
        return Err(ConfigError::BadRatio { layer, ratio });
    }
    let kv_key = "kv_source_layer_ids";
    let index_key = "index_source_layer_ids";
    let cand_key = "candidate_source_layer_id";
    let candidate: Vec<usize> = cfg.candidate_source_layer_id.into_iter().collect();
    let lists: [(&str, &[usize]); 3] =
        [(kv_key, &cfg.kv_source_layer_ids), (index_key, &cfg.index_source_layer_ids), (cand_key, &candidate)];
    for (key, ids) in lists {
        c.layer_list(key, ids, n)?;
    }
    for (key, ids) in lists {
        if let Some(&layer) = ids.iter().find(|&&l| ratios[l] == 0) {
            return Err(ConfigError::SourceWithoutCompression { field: c.form.name(key), layer });
        }
    }
    if let Some(&layer) = cfg.kv_source_layer_ids.iter().find(|l| !cfg.index_source_layer_ids.contains(l)) {
        return Err(ConfigError::KvSourceNotIndexSource {
            layer,
            kv_field: c.form.name(kv_key),
            index_field: c.form.name(index_key),
        });
    }
    if let Some(layer) = cfg.candidate_source_layer_id {
        if !cfg.index_source_layer_ids.contains(&layer) {
            return Err(ConfigError::CandidateNotIndexSource {
                layer,
                field: c.form.name(cand_key),
                index_field: c.form.name(index_key),
            });
        }
        let blocks_key = "candidate_topk_blocks";
        let size_key = "candidate_block_size";
        c.at_least(blocks_key, cfg.candidate_topk_blocks, 1)?;
        c.at_least(size_key, cfg.candidate_block_size, 1)?;
        // A block or a kept pool longer than the context selects nothing more.
        c.at_most(size_key, cfg.candidate_block_size, cfg.max_position_embeddings, "entries per block (and no more than the context)")?;
        c.at_most(blocks_key, cfg.candidate_topk_blocks, cfg.max_position_embeddings, "kept blocks (and no more than the context)")?;
        let (blocks, block_size) = (cfg.candidate_topk_blocks, cfg.candidate_block_size);
        let pool = blocks.saturating_mul(block_size) - (block_size - 1);
        if pool < cfg.index_topk {
            return Err(ConfigError::CandidatePoolTooSmall {
                blocks_field: c.form.name(blocks_key),
                size_field: c.form.name(size_key),
                topk_field: c.form.name("index_topk"),
                blocks,
                block_size,
                pool,
                index_topk: cfg.index_topk,
            });
        }
    }
    Ok(())
}

/// Checks every field- and list-level invariant of `cfg`; errors spell fields as in `form`.
pub(crate) fn validate(cfg: &Config, form: Form) -> Result<(), ConfigError> {
    let c = Checker { form };
    check_dims(&c, cfg)?;
    check_scalars(&c, cfg)?;
    check_lists(&c, cfg)?;
    check_engram(&c, cfg)
}
