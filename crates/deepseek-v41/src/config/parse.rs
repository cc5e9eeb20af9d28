//! Reading the two file forms into [`Config`] (before validation and role resolution).
//!
//! Both forms go through one serde struct, [`RawText`], with the HF names. The flat
//! `inference/config.json` is first rewritten to those names ([`INFERENCE_RENAMES`], YaRN and
//! `dtype` folded into `rope_scaling` / `quantization_config`); [`Form`] maps every name back, so
//! errors quote the name the user wrote. Every raw field is optional: required fields are checked
//! here, which gives an error naming the field in the file's own spelling.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::{Config, ConfigError, EngramConfig, Quantization, ScoringFunc, YarnScaling};

/// `(inference/config.json name, HF name)` of every renamed field.
const INFERENCE_RENAMES: &[(&str, &str)] = &[
    ("dim", "hidden_size"),
    ("moe_inter_dim", "moe_intermediate_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_mtp_layers", "num_nextn_predict_layers"),
    ("n_heads", "num_attention_heads"),
    ("n_activated_experts", "num_experts_per_tok"),
    ("score_func", "scoring_func"),
    ("route_scale", "routed_scaling_factor"),
    ("norm_eps", "rms_norm_eps"),
    ("rope_head_dim", "qk_rope_head_dim"),
    ("window_size", "sliding_window"),
    ("kv_source_layers", "kv_source_layer_ids"),
    ("index_source_layers", "index_source_layer_ids"),
    ("candidate_source_layer", "candidate_source_layer_id"),
    ("engram_pad_id", "engram_pad_token_id"),
    ("max_seq_len", "max_position_embeddings"),
];

/// `(inference/config.json name, HF name inside rope_scaling)` of the YaRN fields.
const INFERENCE_YARN: &[(&str, &str)] = &[
    ("rope_factor", "factor"),
    ("beta_fast", "beta_fast"),
    ("beta_slow", "beta_slow"),
    ("original_seq_len", "original_max_position_embeddings"),
];

/// `(alias, HF name)` of the source-list fields, accepted in every form.
const ALIASES: &[(&str, &str)] = &[
    ("kv_source_layers", "kv_source_layer_ids"),
    ("index_source_layers", "index_source_layer_ids"),
    ("candidate_source_layer", "candidate_source_layer_id"),
];

/// HF fields that live at the top level of the nested form, next to `text_config`.
const HF_TOP_LEVEL: &[&str] =
    &["bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "quantization_config"];

/// Token ids of the release (spec §1.1), used when a file does not give them.
const DEFAULT_BOS: u32 = 0;
const DEFAULT_EOS: u32 = 1;
const DEFAULT_PAD: u32 = 2;

/// The form a configuration was read from; decides how field names are spelled in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// HF `config.json` with the model under `text_config`.
    HfNested,
    /// HF names, all at the top level (also used for a [`Config`] built in code).
    HfFlat,
    /// The official flat `inference/config.json`.
    Inference,
}

impl Form {
    /// The spelling, in this form's file, of the HF (canonical) field `key`.
    ///
    /// `key` may be a dotted path (`rope_scaling.factor`) or carry an index suffix
    /// (`compress_ratios[3]`).
    pub(crate) fn name(self, key: &str) -> String {
        match self {
            Form::HfFlat => key.to_string(),
            Form::HfNested => {
                let head = key.split(['.', '[']).next().unwrap_or(key);
                if HF_TOP_LEVEL.contains(&head) {
                    key.to_string()
                } else {
                    format!("text_config.{key}")
                }
            }
            Form::Inference => {
                if let Some((inf, _)) = INFERENCE_RENAMES.iter().find(|(_, hf)| *hf == key) {
                    return inf.to_string();
                }
                if let Some(field) = key.strip_prefix("rope_scaling.") {
                    if let Some((inf, _)) = INFERENCE_YARN.iter().find(|(_, hf)| *hf == field) {
                        return inf.to_string();
                    }
                }
                match key {
                    "rope_scaling" => "rope_factor".to_string(),
                    "quantization_config" => "dtype".to_string(),
                    "quantization_config.expert_dtype" => "expert_dtype".to_string(),
                    _ => key.to_string(),
                }
            }
        }
    }
}

/// `rope_scaling` as written in the HF form.
#[derive(Debug, Default, Deserialize)]
struct RawRopeScaling {
    #[serde(alias = "type")]
    rope_type: Option<String>,
    factor: Option<f64>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

/// `quantization_config` as written in the HF form.
#[derive(Debug, Default, Deserialize)]
struct RawQuantization {
    quant_method: Option<String>,
    activation_scheme: Option<String>,
    weight_block_size: Option<Vec<usize>>,
    scale_fmt: Option<String>,
    expert_dtype: Option<String>,
}

/// The text-model fields under their HF names (every field optional; see the module docs).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawText {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    q_lora_rank: Option<usize>,
    o_lora_rank: Option<usize>,
    o_groups: Option<usize>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    compress_rope_theta: Option<f64>,
    rope_scaling: Option<RawRopeScaling>,
    max_position_embeddings: Option<usize>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    routed_scaling_factor: Option<f64>,
    gate_temp: Option<f64>,
    swiglu_limit: Option<f64>,
    scoring_func: Option<String>,
    topk_method: Option<String>,
    norm_topk_prob: Option<bool>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    first_k_dense_replace: Option<usize>,
    num_hash_layers: Option<usize>,
    sliding_window: Option<usize>,
    compress_ratios: Option<Vec<usize>>,
    kv_source_layer_ids: Option<Vec<usize>>,
    index_source_layer_ids: Option<Vec<usize>>,
    index_n_heads: Option<usize>,
    index_head_dim: Option<usize>,
    index_topk: Option<usize>,
    candidate_source_layer_id: Option<usize>,
    candidate_topk_blocks: Option<usize>,
    candidate_block_size: Option<usize>,
    hc_mult: Option<usize>,
    hc_sinkhorn_iters: Option<usize>,
    hc_eps: Option<f64>,
    engram_layer_ids: Option<Vec<usize>>,
    engram_num_embeddings: Option<Vec<usize>>,
    engram_max_ngram_size: Option<usize>,
    engram_vocab_size: Option<usize>,
    engram_n_heads: Option<usize>,
    engram_head_dim: Option<usize>,
    engram_pad_token_id: Option<u32>,
    engram_compressed_vocab_size: Option<usize>,
    num_nextn_predict_layers: Option<usize>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    pad_token_id: Option<u32>,
    image_token_id: Option<u32>,
    quantization_config: Option<RawQuantization>,
}

/// Parses JSON text into an object map.
fn parse_object(json: &str) -> Result<Map<String, Value>, ConfigError> {
    match serde_json::from_str::<Value>(json).map_err(ConfigError::Syntax)? {
        Value::Object(map) => Ok(map),
        _ => Err(ConfigError::NotAnObject { field: "<root>".to_string() }),
    }
}

/// Detects the form of `json` and parses it.
pub(crate) fn from_any_json(json: &str) -> Result<(Config, Form), ConfigError> {
    let map = parse_object(json)?;
    let has = |k: &str| map.contains_key(k);
    if has("text_config") || has("hidden_size") || has("num_hidden_layers") {
        from_hf_map(map)
    } else if has("dim") || has("n_layers") {
        from_inference_map(map)
    } else {
        Err(ConfigError::UnknownForm)
    }
}

/// Parses the HF form (nested under `text_config`, or flat).
pub(crate) fn from_hf_json(json: &str) -> Result<(Config, Form), ConfigError> {
    from_hf_map(parse_object(json)?)
}

/// Parses the flat `inference/config.json` form.
pub(crate) fn from_inference_json(json: &str) -> Result<(Config, Form), ConfigError> {
    from_inference_map(parse_object(json)?)
}

fn from_hf_map(mut top: Map<String, Value>) -> Result<(Config, Form), ConfigError> {
    match top.remove("text_config") {
        None | Some(Value::Null) => Ok((build(top, Form::HfFlat)?, Form::HfFlat)),
        Some(Value::Object(mut text)) => {
            if let Some(Value::String(t)) = top.get("model_type") {
                check_model_type(t, "model_type")?;
            }
            for key in HF_TOP_LEVEL {
                match top.remove(*key) {
                    None | Some(Value::Null) => {}
                    Some(v) => {
                        text.insert(key.to_string(), v);
                    }
                }
            }
            Ok((build(text, Form::HfNested)?, Form::HfNested))
        }
        Some(_) => Err(ConfigError::NotAnObject { field: "text_config".to_string() }),
    }
}

/// Moves `from` to `to` in `map`, refusing to overwrite a value given under the other name.
fn rename(map: &mut Map<String, Value>, from: &str, to: &str) -> Result<(), ConfigError> {
    if let Some(v) = map.remove(from) {
        if map.contains_key(to) {
            return Err(ConfigError::DuplicateField { first: from.to_string(), second: to.to_string() });
        }
        map.insert(to.to_string(), v);
    }
    Ok(())
}

fn from_inference_map(mut map: Map<String, Value>) -> Result<(Config, Form), ConfigError> {
    for (inf, hf) in INFERENCE_RENAMES {
        rename(&mut map, inf, hf)?;
    }
    // YaRN: present iff any of its four fields is given.
    let mut yarn = Map::new();
    for (inf, hf) in INFERENCE_YARN {
        if let Some(v) = map.remove(*inf).filter(|v| !v.is_null()) {
            yarn.insert(hf.to_string(), v);
        }
    }
    if !yarn.is_empty() {
        if !map.contains_key("max_position_embeddings") {
            // The official code's context is original_seq_len * rope_factor (1M for Flash).
            let orig = yarn.get("original_max_position_embeddings").and_then(Value::as_u64);
            let factor = yarn.get("factor").and_then(Value::as_f64);
            if let (Some(o), Some(f)) = (orig, factor) {
                let len = o as f64 * f;
                if len.is_finite() && len >= 1.0 && len.fract() == 0.0 {
                    map.insert("max_position_embeddings".to_string(), Value::from(len as u64));
                }
            }
        }
        yarn.insert("rope_type".to_string(), Value::from("yarn"));
        map.insert("rope_scaling".to_string(), Value::Object(yarn));
    }
    // Weight formats: `dtype` ("fp8" | "bf16") and `expert_dtype`.
    let dtype = map.remove("dtype").filter(|v| !v.is_null());
    let expert = map.remove("expert_dtype").filter(|v| !v.is_null());
    match dtype.as_ref().map(|v| (v, v.as_str())) {
        Some((_, Some("fp8"))) => {
            let mut q = Map::new();
            q.insert("quant_method".to_string(), Value::from("fp8"));
            q.insert("weight_block_size".to_string(), Value::from(vec![32u64, 32]));
            q.insert("scale_fmt".to_string(), Value::from("ue8m0"));
            if let Some(e) = expert {
                q.insert("expert_dtype".to_string(), e);
            }
            map.insert("quantization_config".to_string(), Value::Object(q));
        }
        None | Some((_, Some("bf16"))) => {
            if let Some(e) = expert {
                return Err(ConfigError::Unsupported {
                    field: "expert_dtype".to_string(),
                    value: e.to_string(),
                    supported: "expert_dtype is only supported with dtype = \"fp8\"".to_string(),
                });
            }
        }
        Some((v, _)) => {
            return Err(ConfigError::Unsupported {
                field: "dtype".to_string(),
                value: v.to_string(),
                supported: "dtype must be \"fp8\" or \"bf16\"".to_string(),
            })
        }
    }
    Ok((build(map, Form::Inference)?, Form::Inference))
}

/// Deserializes `map` into [`RawText`]; on failure, finds the offending key to name it.
fn deserialize(map: Map<String, Value>, form: Form) -> Result<RawText, ConfigError> {
    match serde_json::from_value::<RawText>(Value::Object(map.clone())) {
        Ok(raw) => Ok(raw),
        Err(whole) => {
            for (key, value) in map {
                let single = Map::from_iter([(key.clone(), value)]);
                if let Err(e) = serde_json::from_value::<RawText>(Value::Object(single)) {
                    return Err(ConfigError::FieldType { field: form.name(&key), message: e.to_string() });
                }
            }
            Err(ConfigError::FieldType { field: "<config>".to_string(), message: whole.to_string() })
        }
    }
}

/// A required field.
fn req<T>(v: Option<T>, form: Form, key: &str) -> Result<T, ConfigError> {
    v.ok_or_else(|| ConfigError::MissingField { field: form.name(key), because: String::new() })
}

/// A field required because another one is present.
fn req_if<T>(v: Option<T>, form: Form, key: &str, because: &str) -> Result<T, ConfigError> {
    v.ok_or_else(|| ConfigError::MissingField { field: form.name(key), because: format!(" (required when {because})") })
}

/// Rejects a string field that differs from the only supported value.
fn expect_str(v: &Option<String>, form: Form, key: &str, expected: &str) -> Result<(), ConfigError> {
    match v {
        Some(s) if s != expected => Err(ConfigError::Unsupported {
            field: form.name(key),
            value: format!("{s:?}"),
            supported: format!("only {expected:?} is supported"),
        }),
        _ => Ok(()),
    }
}

fn check_model_type(t: &str, field: &str) -> Result<(), ConfigError> {
    if t.starts_with("deepseek_v41") {
        Ok(())
    } else {
        Err(ConfigError::Unsupported {
            field: field.to_string(),
            value: format!("{t:?}"),
            supported: "this crate reads DeepSeek V4.1 configs (model_type \"deepseek_v41\" / \"deepseek_v41_text\")"
                .to_string(),
        })
    }
}

/// Rejects the fields of older DeepSeek versions whose presence changes the architecture.
fn reject_legacy(raw: &RawText, form: Form) -> Result<(), ConfigError> {
    let legacy: [(&str, Option<usize>, usize, &str); 4] = [
        ("n_group", raw.n_group, 1, "V4.1 has no group-limited routing"),
        ("topk_group", raw.topk_group, 1, "V4.1 has no group-limited routing"),
        ("first_k_dense_replace", raw.first_k_dense_replace, 0, "every V4.1 layer is MoE"),
        ("num_hash_layers", raw.num_hash_layers, 0, "V4.1 has no hash routing"),
    ];
    for (key, value, allowed, why) in legacy {
        if let Some(v) = value.filter(|&v| v > allowed) {
            return Err(ConfigError::Unsupported {
                field: form.name(key),
                value: v.to_string(),
                supported: format!("{why} (allowed: absent or <= {allowed})"),
            });
        }
    }
    Ok(())
}

fn build_quantization(q: RawQuantization, form: Form) -> Result<Quantization, ConfigError> {
    expect_str(&q.quant_method, form, "quantization_config.quant_method", "fp8")?;
    expect_str(&q.activation_scheme, form, "quantization_config.activation_scheme", "dynamic")?;
    expect_str(&q.scale_fmt, form, "quantization_config.scale_fmt", "ue8m0")?;
    let block = req(q.weight_block_size, form, "quantization_config.weight_block_size")?;
    if block != [32, 32] {
        return Err(ConfigError::Unsupported {
            field: form.name("quantization_config.weight_block_size"),
            value: format!("{block:?}"),
            supported: "V4.1 FP8 weights use 32x32 blocks; only [32, 32] is supported".to_string(),
        });
    }
    let expert = req_if(q.expert_dtype, form, "quantization_config.expert_dtype", "weights are fp8")?;
    expect_str(&Some(expert), form, "quantization_config.expert_dtype", "fp4")?;
    Ok(Quantization { weight_block_size: [32, 32] })
}

fn build_yarn(r: RawRopeScaling, form: Form) -> Result<YarnScaling, ConfigError> {
    expect_str(&r.rope_type, form, "rope_scaling.rope_type", "yarn")?;
    Ok(YarnScaling {
        factor: req(r.factor, form, "rope_scaling.factor")?,
        beta_fast: req(r.beta_fast, form, "rope_scaling.beta_fast")?,
        beta_slow: req(r.beta_slow, form, "rope_scaling.beta_slow")?,
        original_max_position_embeddings: req(
            r.original_max_position_embeddings,
            form,
            "rope_scaling.original_max_position_embeddings",
        )?,
    })
}

fn build_engram(raw: &mut RawText, pad_token_id: u32, form: Form) -> Result<Option<EngramConfig>, ConfigError> {
    let layer_ids = match raw.engram_layer_ids.take() {
        None => return Ok(None),
        Some(ids) if ids.is_empty() => return Ok(None),
        Some(ids) => ids,
    };
    let because = "engram_layer_ids is non-empty";
    Ok(Some(EngramConfig {
        layer_ids,
        num_embeddings: req_if(raw.engram_num_embeddings.take(), form, "engram_num_embeddings", because)?,
        max_ngram_size: req_if(raw.engram_max_ngram_size, form, "engram_max_ngram_size", because)?,
        vocab_size: req_if(raw.engram_vocab_size, form, "engram_vocab_size", because)?,
        n_heads: req_if(raw.engram_n_heads, form, "engram_n_heads", because)?,
        head_dim: req_if(raw.engram_head_dim, form, "engram_head_dim", because)?,
        pad_token_id: raw.engram_pad_token_id.unwrap_or(pad_token_id),
        compressed_vocab_size: req_if(raw.engram_compressed_vocab_size, form, "engram_compressed_vocab_size", because)?,
    }))
}

/// Builds an unvalidated [`Config`] (empty `layers`) from HF-named fields.
fn build(mut map: Map<String, Value>, form: Form) -> Result<Config, ConfigError> {
    for (alias, hf) in ALIASES {
        rename(&mut map, alias, hf)?;
    }
    let mut raw = deserialize(map, form)?;
    if let Some(t) = &raw.model_type {
        check_model_type(t, &form.name("model_type"))?;
    }
    reject_legacy(&raw, form)?;
    expect_str(&raw.hidden_act, form, "hidden_act", "silu")?;
    expect_str(&raw.topk_method, form, "topk_method", "noaux_tc")?;
    for (key, value) in [("attention_bias", raw.attention_bias), ("tie_word_embeddings", raw.tie_word_embeddings)] {
        if value == Some(true) {
            return Err(ConfigError::Unsupported {
                field: form.name(key),
                value: "true".to_string(),
                supported: "V4.1 has no attention bias and untied embeddings (false)".to_string(),
            });
        }
    }
    let kv_heads = raw.num_key_value_heads.unwrap_or(1);
    if kv_heads != 1 {
        return Err(ConfigError::Unsupported {
            field: form.name("num_key_value_heads"),
            value: kv_heads.to_string(),
            supported: "V4.1 attention has a single shared KV row (1)".to_string(),
        });
    }
    let scoring = req(raw.scoring_func.take(), form, "scoring_func")?;
    let scoring_func = match scoring.as_str() {
        "sqrtsoftplus" => ScoringFunc::SqrtSoftplus,
        other => {
            return Err(ConfigError::Unsupported {
                field: form.name("scoring_func"),
                value: format!("{other:?}"),
                supported: "only \"sqrtsoftplus\" is supported".to_string(),
            })
        }
    };
    let pad_token_id = raw.pad_token_id.unwrap_or(DEFAULT_PAD);
    let engram = build_engram(&mut raw, pad_token_id, form)?;
    let candidate = raw.candidate_source_layer_id;
    let because_candidate = "candidate_source_layer_id is set";
    let cand_field = |v: Option<usize>, key: &str| match candidate {
        Some(_) => req_if(v, form, key, because_candidate),
        None => Ok(v.unwrap_or(0)),
    };
    Ok(Config {
        vocab_size: req(raw.vocab_size, form, "vocab_size")?,
        hidden_size: req(raw.hidden_size, form, "hidden_size")?,
        num_hidden_layers: req(raw.num_hidden_layers, form, "num_hidden_layers")?,
        num_attention_heads: req(raw.num_attention_heads, form, "num_attention_heads")?,
        head_dim: req(raw.head_dim, form, "head_dim")?,
        qk_rope_head_dim: req(raw.qk_rope_head_dim, form, "qk_rope_head_dim")?,
        q_lora_rank: req(raw.q_lora_rank, form, "q_lora_rank")?,
        o_lora_rank: req(raw.o_lora_rank, form, "o_lora_rank")?,
        o_groups: req(raw.o_groups, form, "o_groups")?,
        rms_norm_eps: req(raw.rms_norm_eps, form, "rms_norm_eps")?,
        rope_theta: req(raw.rope_theta, form, "rope_theta")?,
        compress_rope_theta: req(raw.compress_rope_theta, form, "compress_rope_theta")?,
        rope_scaling: raw.rope_scaling.take().map(|r| build_yarn(r, form)).transpose()?,
        max_position_embeddings: req(raw.max_position_embeddings, form, "max_position_embeddings")?,
        n_routed_experts: req(raw.n_routed_experts, form, "n_routed_experts")?,
        n_shared_experts: req(raw.n_shared_experts, form, "n_shared_experts")?,
        num_experts_per_tok: req(raw.num_experts_per_tok, form, "num_experts_per_tok")?,
        moe_intermediate_size: req(raw.moe_intermediate_size, form, "moe_intermediate_size")?,
        routed_scaling_factor: req(raw.routed_scaling_factor, form, "routed_scaling_factor")?,
        gate_temp: raw.gate_temp.unwrap_or(1.0),
        swiglu_limit: req(raw.swiglu_limit, form, "swiglu_limit")?,
        scoring_func,
        norm_topk_prob: raw.norm_topk_prob.unwrap_or(true),
        sliding_window: req(raw.sliding_window, form, "sliding_window")?,
        compress_ratios: req(raw.compress_ratios.take(), form, "compress_ratios")?,
        kv_source_layer_ids: req(raw.kv_source_layer_ids.take(), form, "kv_source_layer_ids")?,
        index_source_layer_ids: req(raw.index_source_layer_ids.take(), form, "index_source_layer_ids")?,
        index_n_heads: req(raw.index_n_heads, form, "index_n_heads")?,
        index_head_dim: req(raw.index_head_dim, form, "index_head_dim")?,
        index_topk: req(raw.index_topk, form, "index_topk")?,
        candidate_source_layer_id: candidate,
        candidate_topk_blocks: cand_field(raw.candidate_topk_blocks, "candidate_topk_blocks")?,
        candidate_block_size: cand_field(raw.candidate_block_size, "candidate_block_size")?,
        hc_mult: req(raw.hc_mult, form, "hc_mult")?,
        hc_sinkhorn_iters: req(raw.hc_sinkhorn_iters, form, "hc_sinkhorn_iters")?,
        hc_eps: req(raw.hc_eps, form, "hc_eps")?,
        engram,
        bos_token_id: raw.bos_token_id.unwrap_or(DEFAULT_BOS),
        eos_token_id: raw.eos_token_id.unwrap_or(DEFAULT_EOS),
        pad_token_id,
        image_token_id: raw.image_token_id,
        num_nextn_predict_layers: raw.num_nextn_predict_layers.unwrap_or(0),
        quantization: raw.quantization_config.take().map(|q| build_quantization(q, form)).transpose()?,
        layers: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_names_fields_in_the_files_spelling() {
        assert_eq!(Form::HfFlat.name("hidden_size"), "hidden_size");
        assert_eq!(Form::HfNested.name("hidden_size"), "text_config.hidden_size");
        assert_eq!(Form::HfNested.name("compress_ratios[3]"), "text_config.compress_ratios[3]");
        assert_eq!(
            Form::HfNested.name("quantization_config.weight_block_size"),
            "quantization_config.weight_block_size"
        );
        assert_eq!(Form::HfNested.name("image_token_id"), "image_token_id");
        assert_eq!(Form::Inference.name("num_hidden_layers"), "n_layers");
        assert_eq!(Form::Inference.name("kv_source_layer_ids"), "kv_source_layers");
        assert_eq!(Form::Inference.name("rope_scaling.factor"), "rope_factor");
        assert_eq!(Form::Inference.name("rope_scaling.original_max_position_embeddings"), "original_seq_len");
        assert_eq!(Form::Inference.name("quantization_config.expert_dtype"), "expert_dtype");
        assert_eq!(Form::Inference.name("head_dim"), "head_dim");
    }

    #[test]
    fn config_type_errors_name_the_offending_key() {
        let mut map = Map::new();
        map.insert("hidden_size".into(), Value::from(1.5));
        map.insert("vocab_size".into(), Value::from(10));
        let err = deserialize(map, Form::Inference).unwrap_err();
        assert!(matches!(&err, ConfigError::FieldType { field, .. } if field == "dim"), "{err}");
    }

    #[test]
    fn config_inference_rename_refuses_two_spellings() {
        let mut map = Map::new();
        map.insert("kv_source_layers".into(), Value::from(vec![1u64]));
        map.insert("kv_source_layer_ids".into(), Value::from(vec![1u64]));
        let err = rename(&mut map, "kv_source_layers", "kv_source_layer_ids").unwrap_err();
        assert!(err.to_string().contains("kv_source_layers") && err.to_string().contains("kv_source_layer_ids"));
    }
}
