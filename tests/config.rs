//! Config parsing, role resolution and validation against the released Flash config (spec §1.4),
//! the tiny golden config (spec §15.1) and one broken config per invariant.

use deepseek_v41::config::{
    AttentionRole, CandidateRole, Config, ConfigError, LayerRole, Quantization, ScoringFunc, TopkRole, YarnScaling,
};
use serde_json::{json, Value};

const FLASH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/deepseek-v41-flash");
const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny");

fn read(dir: &str, name: &str) -> String {
    std::fs::read_to_string(format!("{dir}/{name}")).expect("fixture readable")
}

fn value(dir: &str, name: &str) -> Value {
    serde_json::from_str(&read(dir, name)).expect("fixture is JSON")
}

// ---- role constructors, mirroring the columns of the spec tables ----

fn window(layer: usize, engram: bool) -> LayerRole {
    LayerRole { layer, attention: AttentionRole::WindowOnly, engram }
}

fn full(layer: usize, ratio: usize, candidates: CandidateRole, engram: bool) -> LayerRole {
    LayerRole {
        layer,
        attention: AttentionRole::Compressed { ratio, kv_source: layer, topk: TopkRole::Full { candidates } },
        engram,
    }
}

fn reuse(layer: usize, ratio: usize, kv_source: usize, index_source: usize, engram: bool) -> LayerRole {
    LayerRole {
        layer,
        attention: AttentionRole::Compressed { ratio, kv_source, topk: TopkRole::Reuse { index_source } },
        engram,
    }
}

fn reindex(layer: usize, ratio: usize, key_owner: usize, candidates: CandidateRole) -> LayerRole {
    LayerRole {
        layer,
        attention: AttentionRole::Compressed {
            ratio,
            kv_source: key_owner,
            topk: TopkRole::Reindex { key_owner, candidates },
        },
        engram: false,
    }
}

const NO: CandidateRole = CandidateRole::None;
const PUBLISH: CandidateRole = CandidateRole::Publish;

// ---- the released config (spec §1.1, §1.4) ----

/// Spec §1.4, written out layer by layer.
fn flash_table() -> Vec<LayerRole> {
    let c20 = CandidateRole::Consume { source: 20 };
    vec![
        window(0, false),
        window(1, true),
        full(2, 2, NO, false),
        reuse(3, 2, 2, 2, false),
        reuse(4, 2, 2, 2, false),
        reuse(5, 2, 2, 2, false),
        reuse(6, 2, 2, 2, false),
        reuse(7, 2, 2, 2, false),
        full(8, 2, NO, false),
        reuse(9, 2, 8, 8, false),
        reuse(10, 2, 8, 8, false),
        reuse(11, 2, 8, 8, false),
        reuse(12, 2, 8, 8, false),
        reuse(13, 2, 8, 8, false),
        full(14, 2, NO, true),
        reuse(15, 2, 14, 14, false),
        reuse(16, 2, 14, 14, false),
        reuse(17, 2, 14, 14, false),
        reuse(18, 2, 14, 14, false),
        reuse(19, 2, 14, 14, false),
        full(20, 1, PUBLISH, false),
        reuse(21, 1, 20, 20, false),
        reuse(22, 1, 20, 20, false),
        reuse(23, 1, 20, 20, false),
        reindex(24, 1, 20, c20),
        reuse(25, 1, 20, 24, false),
        reuse(26, 1, 20, 24, false),
        reuse(27, 1, 20, 24, false),
        reindex(28, 1, 20, c20),
        reuse(29, 1, 20, 28, false),
        reuse(30, 1, 20, 28, false),
        reuse(31, 1, 20, 28, false),
        reindex(32, 1, 20, c20),
        reuse(33, 1, 20, 32, false),
        reuse(34, 1, 20, 32, false),
        reuse(35, 1, 20, 32, false),
        reindex(36, 1, 20, c20),
        reuse(37, 1, 20, 36, false),
        reuse(38, 1, 20, 36, false),
        reuse(39, 1, 20, 36, false),
    ]
}

#[test]
fn flash_hf_config_resolves_to_the_spec_table() {
    let cfg = Config::from_hf_json(&read(FLASH, "config.json")).unwrap();
    let table = flash_table();
    assert_eq!(cfg.layers.len(), 40);
    for (l, want) in table.iter().enumerate() {
        assert_eq!(&cfg.layers[l], want, "layer {l}");
    }
    assert_eq!(cfg.layers, table);
}

#[test]
fn flash_hf_config_values() {
    let cfg = Config::from_hf_json(&read(FLASH, "config.json")).unwrap();
    assert_eq!(
        (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim),
        (129280, 5120, 40, 64, 512)
    );
    assert_eq!((cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups), (64, 1280, 1024, 8));
    assert_eq!(cfg.rms_norm_eps, 1e-20);
    assert_eq!((cfg.rope_theta, cfg.compress_rope_theta), (10000.0, 160000.0));
    assert_eq!(
        cfg.rope_scaling,
        Some(YarnScaling { factor: 16.0, beta_fast: 32.0, beta_slow: 1.0, original_max_position_embeddings: 65536 })
    );
    assert_eq!(cfg.max_position_embeddings, 1048576);
    assert_eq!((cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok), (384, 1, 6));
    assert_eq!(cfg.moe_intermediate_size, 2304);
    assert_eq!((cfg.routed_scaling_factor, cfg.gate_temp, cfg.swiglu_limit), (1.5, 1.0, 10.0));
    assert_eq!(cfg.scoring_func, ScoringFunc::SqrtSoftplus);
    assert!(cfg.norm_topk_prob);
    assert_eq!(cfg.sliding_window, 128);
    assert_eq!(cfg.compress_ratios.len(), 43);
    assert_eq!((cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk), (32, 128, 512));
    assert_eq!(cfg.candidate_source_layer_id, Some(20));
    assert_eq!((cfg.candidate_topk_blocks, cfg.candidate_block_size), (2048, 8));
    assert_eq!((cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps), (4, 20, 1e-6));
    let e = cfg.engram.as_ref().unwrap();
    assert_eq!(e.layer_ids, vec![1, 14]);
    assert_eq!(e.num_embeddings, vec![384006168, 384016682]);
    assert_eq!((e.max_ngram_size, e.vocab_size, e.n_heads, e.head_dim), (4, 16000000, 8, 256));
    assert_eq!((e.pad_token_id, e.compressed_vocab_size), (2, 99092));
    assert_eq!((cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id), (0, 1, 2));
    assert_eq!(cfg.image_token_id, Some(129264));
    assert_eq!(cfg.num_nextn_predict_layers, 3);
    assert_eq!(cfg.quantization, Some(Quantization { weight_block_size: [32, 32] }));
}

#[test]
fn flash_inference_config_equals_hf_config() {
    let hf = Config::from_hf_json(&read(FLASH, "config.json")).unwrap();
    let inf = Config::from_inference_json(&read(FLASH, "inference_config.json")).unwrap();
    assert_eq!(inf.layers, flash_table());
    assert_eq!(
        (inf.hidden_size, inf.num_hidden_layers, inf.num_attention_heads, inf.head_dim, inf.qk_rope_head_dim),
        (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.head_dim, hf.qk_rope_head_dim)
    );
    // Every field agrees: the inference form's omissions take the release defaults.
    assert_eq!(inf, hf);
}

#[test]
fn flash_convenience_queries() {
    let cfg = Config::from_file(format!("{FLASH}/config.json")).unwrap();
    assert_eq!(cfg.n_layers(), 40);
    assert_eq!(cfg.role(24), Some(&reindex(24, 1, 20, CandidateRole::Consume { source: 20 })));
    assert_eq!(cfg.role(40), None);
    assert_eq!((cfg.compress_ratio(2), cfg.compress_ratio(20), cfg.compress_ratio(40)), (Some(2), Some(1), None));
    let kv: Vec<usize> = (0..45).filter(|&l| cfg.is_kv_source(l)).collect();
    assert_eq!(kv, vec![2, 8, 14, 20]);
    let index: Vec<usize> = (0..45).filter(|&l| cfg.is_index_source(l)).collect();
    assert_eq!(index, vec![2, 8, 14, 20, 24, 28, 32, 36]);
    assert!(cfg.is_candidate_source(20) && !cfg.is_candidate_source(24));
    assert_eq!((cfg.engram_slot(1), cfg.engram_slot(14), cfg.engram_slot(2)), (Some(0), Some(1), None));
    assert_eq!(
        (cfg.latest_kv_source(1), cfg.latest_kv_source(13), cfg.latest_kv_source(39)),
        (None, Some(8), Some(20))
    );
    assert_eq!((cfg.latest_index_source(27), cfg.latest_index_source(39)), (Some(24), Some(36)));
    assert_eq!((cfg.nope_head_dim(), cfg.heads_per_group()), (448, 8));
    let owners: Vec<Option<usize>> = [2, 3, 24, 25].iter().map(|&l| cfg.layers[l].index_key_owner()).collect();
    assert_eq!(owners, vec![Some(2), None, Some(20), None]);
    let topk: Vec<Option<usize>> = [0, 3, 24, 25].iter().map(|&l| cfg.layers[l].topk_source()).collect();
    assert_eq!(topk, vec![None, Some(2), Some(24), Some(24)]);
}

// ---- the tiny golden config (spec §15.1) ----

/// Spec §15.1, written out layer by layer.
fn tiny_table() -> Vec<LayerRole> {
    vec![
        window(0, false),
        full(1, 2, NO, true),
        reuse(2, 2, 1, 1, false),
        full(3, 2, NO, false),
        full(4, 1, PUBLISH, false),
        reuse(5, 1, 4, 4, true),
        reindex(6, 1, 4, CandidateRole::Consume { source: 4 }),
        reuse(7, 1, 4, 6, false),
        window(8, false),
    ]
}

#[test]
fn tiny_configs_resolve_to_the_spec_roles_and_agree() {
    let hf = Config::from_hf_json(&read(TINY, "config.json")).unwrap();
    let inf = Config::from_inference_json(&read(TINY, "inference_config.json")).unwrap();
    assert_eq!(hf.layers, tiny_table());
    assert_eq!(inf.layers, tiny_table());
    assert_eq!((hf.hidden_size, hf.num_hidden_layers, hf.head_dim, hf.index_topk), (256, 9, 128, 4));
    assert_eq!((hf.candidate_topk_blocks, hf.candidate_block_size), (3, 2));
    assert_eq!(hf.engram.as_ref().unwrap().num_embeddings, vec![420, 508]);
    assert_eq!(inf, hf);
    // from_file detects both forms.
    assert_eq!(Config::from_file(format!("{TINY}/config.json")).unwrap(), hf);
    assert_eq!(Config::from_file(format!("{TINY}/inference_config.json")).unwrap(), hf);
}

#[test]
fn tiny_case_variant_reads_its_own_swiglu_limit() {
    let base = Config::from_file(format!("{TINY}/config.json")).unwrap();
    let variant = Config::from_file(format!("{TINY}/prefill_full_swiglu/config.json")).unwrap();
    let variant_inf = Config::from_file(format!("{TINY}/prefill_full_swiglu/inference_config.json")).unwrap();
    assert_eq!((base.swiglu_limit, variant.swiglu_limit, variant_inf.swiglu_limit), (10.0, 0.5, 0.5));
    assert_eq!(Config { swiglu_limit: 10.0, ..variant }, base);
}

// ---- accepted variations ----

fn tiny_hf_with(edit: impl FnOnce(&mut Value)) -> Result<Config, ConfigError> {
    let mut v = value(TINY, "config.json");
    edit(&mut v);
    Config::from_hf_json(&v.to_string())
}

fn tiny_inf_with(edit: impl FnOnce(&mut Value)) -> Result<Config, ConfigError> {
    let mut v = value(TINY, "inference_config.json");
    edit(&mut v);
    Config::from_inference_json(&v.to_string())
}

fn text(v: &mut Value) -> &mut serde_json::Map<String, Value> {
    v["text_config"].as_object_mut().unwrap()
}

fn tiny() -> Config {
    Config::from_hf_json(&read(TINY, "config.json")).unwrap()
}

#[test]
fn flat_hf_form_is_accepted() {
    let mut v = value(TINY, "config.json");
    let inner = v.as_object_mut().unwrap().remove("text_config").unwrap();
    for (k, x) in inner.as_object().unwrap() {
        v[k] = x.clone();
    }
    assert_eq!(Config::from_hf_json(&v.to_string()).unwrap(), tiny());
    assert_eq!(Config::from_json(&v.to_string()).unwrap(), tiny());
}

#[test]
fn source_list_aliases_are_accepted_in_both_forms() {
    let cfg = tiny_hf_with(|v| {
        let t = text(v);
        for (alias, name) in [
            ("kv_source_layers", "kv_source_layer_ids"),
            ("index_source_layers", "index_source_layer_ids"),
            ("candidate_source_layer", "candidate_source_layer_id"),
        ] {
            let x = t.remove(name).unwrap();
            t.insert(alias.into(), x);
        }
    })
    .unwrap();
    assert_eq!(cfg, tiny());
    let cfg = tiny_inf_with(|v| {
        let m = v.as_object_mut().unwrap();
        for (name, alias) in [
            ("kv_source_layers", "kv_source_layer_ids"),
            ("index_source_layers", "index_source_layer_ids"),
            ("candidate_source_layer", "candidate_source_layer_id"),
        ] {
            let x = m.remove(name).unwrap();
            m.insert(alias.into(), x);
        }
    })
    .unwrap();
    assert_eq!(cfg, tiny());
}

#[test]
fn both_spellings_of_an_alias_are_rejected() {
    let err = tiny_hf_with(|v| v["text_config"]["kv_source_layers"] = json!([1, 3, 4])).unwrap_err();
    assert_msg(&err, &["kv_source_layers", "kv_source_layer_ids", "only one"]);
    let err = tiny_inf_with(|v| v["candidate_source_layer_id"] = json!(4)).unwrap_err();
    assert_msg(&err, &["candidate_source_layer", "candidate_source_layer_id"]);
}

#[test]
fn optional_fields_take_release_defaults_and_are_read_when_present() {
    let base = tiny();
    assert_eq!((base.gate_temp, base.norm_topk_prob), (1.0, true));
    let cfg = tiny_hf_with(|v| v["text_config"]["gate_temp"] = json!(2.5)).unwrap();
    assert_eq!(cfg.gate_temp, 2.5);
    let cfg = tiny_hf_with(|v| {
        let m = v.as_object_mut().unwrap();
        for k in ["bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"] {
            m.remove(k);
        }
        text(v).remove("engram_pad_token_id");
    })
    .unwrap();
    assert_eq!((cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.image_token_id), (0, 1, 2, None));
    assert_eq!(cfg.engram.unwrap().pad_token_id, 2);
}

#[test]
fn engram_is_optional() {
    let cfg = tiny_hf_with(|v| text(v).retain(|k, _| !k.starts_with("engram_"))).unwrap();
    assert_eq!(cfg.engram, None);
    assert!(cfg.layers.iter().all(|r| !r.engram));
    assert!(!cfg.is_engram_layer(1));
    let cfg = tiny_hf_with(|v| v["text_config"]["engram_layer_ids"] = json!([])).unwrap();
    assert_eq!(cfg.engram, None);
}

#[test]
fn no_candidate_source_means_no_candidates() {
    let cfg = tiny_hf_with(|v| {
        let t = text(v);
        t.remove("candidate_source_layer_id");
        t.remove("candidate_topk_blocks");
        t.remove("candidate_block_size");
    })
    .unwrap();
    assert_eq!(cfg.candidate_source_layer_id, None);
    assert_eq!(cfg.layers[4], full(4, 1, NO, false));
    assert_eq!(cfg.layers[6], reindex(6, 1, 4, NO));
}

#[test]
fn kv_source_owners_after_the_candidate_source_consume_candidates() {
    // Spec §0.1b.4: every index source with a larger id consumes, kv-source owners included.
    let cfg = tiny_hf_with(|v| v["text_config"]["kv_source_layer_ids"] = json!([1, 3, 4, 6])).unwrap();
    assert_eq!(cfg.layers[6], full(6, 1, CandidateRole::Consume { source: 4 }, false));
    assert_eq!(cfg.layers[7], reuse(7, 1, 6, 6, false));
    assert_eq!(cfg.layers[5], reuse(5, 1, 4, 4, true));
}

#[test]
fn inference_dtype_bf16_means_unquantized() {
    let cfg = tiny_inf_with(|v| {
        v["dtype"] = json!("bf16");
        v.as_object_mut().unwrap().remove("expert_dtype");
    })
    .unwrap();
    assert_eq!(cfg.quantization, None);
    let cfg = tiny_inf_with(|v| v["max_seq_len"] = json!(4096)).unwrap();
    assert_eq!(cfg.max_position_embeddings, 4096);
}

#[test]
fn resolve_recomputes_roles_after_an_edit() {
    let mut cfg = tiny();
    cfg.candidate_source_layer_id = Some(6);
    let cfg = cfg.resolve().unwrap();
    assert_eq!(cfg.layers[4], full(4, 1, NO, false));
    assert_eq!(cfg.layers[6], reindex(6, 1, 4, PUBLISH));
    // Layer 4 consumes from a ratio-2 source: rejected by validate() as well.
    let mut bad = cfg.clone();
    bad.candidate_source_layer_id = Some(1);
    assert_msg(
        &bad.validate().unwrap_err(),
        &["layer 4", "layer 1", "compress_ratios[4] = 1", "compress_ratios[1] = 2"],
    );
    let err: candle_core::Error = bad.resolve().unwrap_err().into();
    assert!(err.to_string().contains("consumes the candidate blocks of layer 1"), "{err}");
}

// ---- one broken config per invariant ----

/// Asserts that the message of `err` contains every part.
fn assert_msg(err: &ConfigError, parts: &[&str]) {
    let msg = err.to_string();
    for p in parts {
        assert!(msg.contains(p), "error message {msg:?} lacks {p:?}");
    }
}

fn tiny_err(key: &str, x: Value) -> ConfigError {
    let key = key.to_string();
    tiny_hf_with(move |v| {
        text(v).insert(key, x);
    })
    .expect_err("config must be rejected")
}

#[test]
fn kv_source_must_be_index_source() {
    let err = tiny_err("index_source_layer_ids", json!([1, 4, 6]));
    assert_msg(&err, &["layer 3", "text_config.kv_source_layer_ids", "text_config.index_source_layer_ids"]);
}

#[test]
fn sources_must_have_nonzero_ratio() {
    let err = tiny_hf_with(|v| {
        text(v).insert("kv_source_layer_ids".into(), json!([0, 1, 3, 4]));
        text(v).insert("index_source_layer_ids".into(), json!([0, 1, 3, 4, 6]));
    })
    .unwrap_err();
    assert_msg(&err, &["layer 0", "text_config.kv_source_layer_ids", "compress_ratios[0] = 0"]);
    let err = tiny_err("index_source_layer_ids", json!([1, 3, 4, 6, 8]));
    assert_msg(&err, &["layer 8", "text_config.index_source_layer_ids", "compress_ratios[8] = 0"]);
    let err = tiny_err("candidate_source_layer_id", json!(8));
    assert_msg(&err, &["layer 8", "text_config.candidate_source_layer_id", "compress_ratios[8] = 0"]);
}

#[test]
fn sources_must_be_backbone_layers() {
    let err = tiny_err("index_source_layer_ids", json!([1, 3, 4, 6, 9]));
    assert_msg(&err, &["layer 9", "text_config.index_source_layer_ids", "9 layers"]);
    let mut v = value(FLASH, "config.json");
    text(&mut v).insert("kv_source_layer_ids".into(), json!([2, 8, 14, 20, 40]));
    text(&mut v).insert("index_source_layer_ids".into(), json!([2, 8, 14, 20, 24, 28, 32, 36, 40]));
    let err = Config::from_hf_json(&v.to_string()).unwrap_err();
    assert_msg(&err, &["layer 40", "text_config.kv_source_layer_ids", "40 layers", "MTP"]);
    let err = tiny_err("candidate_source_layer_id", json!(12));
    assert_msg(&err, &["layer 12", "text_config.candidate_source_layer_id"]);
}

#[test]
fn ratios_must_be_0_1_or_2() {
    let err = tiny_err("compress_ratios", json!([0, 2, 2, 2, 1, 3, 1, 1, 0]));
    assert_msg(&err, &["layer 5", "compress_ratios[5] = 3"]);
    let mut v = value(FLASH, "config.json");
    v["text_config"]["compress_ratios"][41] = json!(4);
    let err = Config::from_hf_json(&v.to_string()).unwrap_err();
    assert_msg(&err, &["layer 41", "compress_ratios[41] = 4"]);
}

#[test]
fn compressed_layer_needs_a_kv_source_at_or_below() {
    let err = tiny_err("compress_ratios", json!([2, 2, 2, 2, 1, 1, 1, 1, 0]));
    assert_msg(&err, &["layer 0", "compress_ratios[0] = 2", "text_config.kv_source_layer_ids", "kv source"]);
}

#[test]
fn latest_kv_source_must_have_the_layers_ratio() {
    // Brief example: layer 4 (ratio 1) would read the compressed cache of layer 3 (ratio 2).
    let err = tiny_hf_with(|v| {
        text(v).insert("kv_source_layer_ids".into(), json!([1, 3]));
    })
    .unwrap_err();
    assert_msg(&err, &["layer 4: compress_ratios[4] = 1 but its latest kv source (layer 3) has ratio 2"]);
    // §0.1b.5: an earlier kv source of the right ratio (layer 1) does not help; the latest counts.
    let err = tiny_hf_with(|v| {
        let t = text(v);
        t.insert("compress_ratios".into(), json!([0, 1, 2, 1, 1, 1, 1, 1, 0]));
        t.insert("kv_source_layer_ids".into(), json!([1, 2, 4]));
        t.insert("index_source_layer_ids".into(), json!([1, 2, 4, 6]));
    })
    .unwrap_err();
    assert_msg(&err, &["layer 3: compress_ratios[3] = 1 but its latest kv source (layer 2) has ratio 2"]);
}

#[test]
fn latest_index_source_must_have_the_layers_ratio() {
    // Layer 7 (ratio 1) would reuse the top-k of index source 6 (ratio 2). The index source
    // itself is the first layer whose latest kv source (4, ratio 1) disagrees, so the error
    // names it; either way the layout is rejected.
    let err = tiny_err("compress_ratios", json!([0, 2, 2, 2, 1, 1, 2, 1, 0]));
    assert_msg(&err, &["layer 6: compress_ratios[6] = 2 but its latest kv source (layer 4) has ratio 1"]);
}

#[test]
fn candidate_source_must_be_an_index_source() {
    let err = tiny_err("candidate_source_layer_id", json!(5));
    assert_msg(
        &err,
        &["layer 5", "text_config.candidate_source_layer_id", "= 5", "text_config.index_source_layer_ids"],
    );
}

#[test]
fn candidate_pool_must_cover_topk() {
    let err = tiny_err("candidate_topk_blocks", json!(2));
    assert_msg(
        &err,
        &[
            "`text_config.candidate_topk_blocks` = 2",
            "`text_config.candidate_block_size` = 2",
            "2 * 2 - (2 - 1) = 3",
            "`text_config.index_topk` = 4",
        ],
    );
    // Exactly covering is fine: 4 blocks of 1 entry.
    let cfg = tiny_hf_with(|v| {
        text(v).insert("candidate_topk_blocks".into(), json!(4));
        text(v).insert("candidate_block_size".into(), json!(1));
    });
    assert!(cfg.is_ok(), "{cfg:?}");
    let err = tiny_err("candidate_block_size", json!(0));
    assert_msg(&err, &["text_config.candidate_block_size", "= 0"]);
}

#[test]
fn candidate_consumers_must_share_the_sources_ratio() {
    let err = tiny_err("candidate_source_layer_id", json!(1));
    assert_msg(&err, &["layer 4", "candidate blocks of layer 1", "compress_ratios[4] = 1", "compress_ratios[1] = 2"]);
}

#[test]
fn source_lists_must_be_strictly_ascending() {
    let err = tiny_err("kv_source_layer_ids", json!([3, 1, 4]));
    assert_msg(&err, &["text_config.kv_source_layer_ids", "entry 1 = 1 follows 3"]);
    let err = tiny_err("index_source_layer_ids", json!([1, 3, 3, 4, 6]));
    assert_msg(&err, &["text_config.index_source_layer_ids", "entry 2 = 3 follows 3"]);
    let err = tiny_err("engram_layer_ids", json!([5, 1]));
    assert_msg(&err, &["text_config.engram_layer_ids", "entry 1 = 1 follows 5"]);
}

#[test]
fn compress_ratios_must_cover_the_backbone() {
    let err = tiny_err("compress_ratios", json!([0, 2, 2, 2, 1, 1, 1, 1]));
    assert_msg(
        &err,
        &["text_config.compress_ratios", "8 entries", "text_config.num_hidden_layers = 9", "exactly 9 entries"],
    );
    let mut v = value(FLASH, "config.json");
    v["text_config"]["compress_ratios"].as_array_mut().unwrap().pop();
    let err = Config::from_hf_json(&v.to_string()).unwrap_err();
    assert_msg(&err, &["42 entries", "num_hidden_layers = 40", "num_nextn_predict_layers = 3", "40 or 43"]);
    // Without the MTP entries the released list is fine.
    let mut v = value(FLASH, "config.json");
    v["text_config"]["compress_ratios"].as_array_mut().unwrap().truncate(40);
    assert_eq!(Config::from_hf_json(&v.to_string()).unwrap().layers, flash_table());
}

#[test]
fn head_dims_must_fit_rope_and_quant_blocks() {
    let err = tiny_err("qk_rope_head_dim", json!(128));
    assert_msg(&err, &["text_config.head_dim", "= 128", "qk_rope_head_dim = 128"]);
    let err = tiny_err("qk_rope_head_dim", json!(63));
    assert_msg(&err, &["text_config.qk_rope_head_dim", "= 63", "even"]);
    let err = tiny_err("head_dim", json!(112));
    assert_msg(&err, &["text_config.head_dim", "= 112", "multiple of 32"]);
    let err = tiny_err("index_head_dim", json!(80));
    assert_msg(&err, &["text_config.index_head_dim", "= 80", "multiple of 32"]);
    let err = tiny_err("index_head_dim", json!(64));
    assert_msg(&err, &["text_config.index_head_dim", "= 64", "qk_rope_head_dim = 64"]);
}

#[test]
fn heads_must_split_into_output_groups() {
    let err = tiny_err("o_groups", json!(3));
    assert_msg(&err, &["text_config.num_attention_heads", "= 4", "o_groups = 3"]);
}

#[test]
fn widths_must_be_multiples_of_32() {
    for (key, bad) in [("hidden_size", 250), ("q_lora_rank", 48), ("o_lora_rank", 40), ("moe_intermediate_size", 72)] {
        let err = tiny_err(key, json!(bad));
        assert_msg(&err, &[&format!("text_config.{key}"), &format!("= {bad}"), "multiple of 32"]);
    }
}

#[test]
fn engram_lists_must_match_and_stay_in_the_backbone() {
    let err = tiny_err("engram_num_embeddings", json!([420]));
    assert_msg(&err, &["text_config.engram_num_embeddings", "1 entries", "text_config.engram_layer_ids", "has 2"]);
    let err = tiny_err("engram_layer_ids", json!([1, 9]));
    assert_msg(&err, &["layer 9", "text_config.engram_layer_ids", "9 layers"]);
    let err = tiny_err("engram_max_ngram_size", json!(1));
    assert_msg(&err, &["text_config.engram_max_ngram_size", "= 1"]);
    let err = tiny_hf_with(|v| {
        text(v).remove("engram_n_heads");
    })
    .unwrap_err();
    assert_msg(&err, &["missing required field `text_config.engram_n_heads`", "engram_layer_ids"]);
}

/// Fields that size run-time work with no weight shape to check them against are bounded: a huge
/// value errors naming the field and the bound instead of allocating or looping without end.
#[test]
fn run_time_sizes_are_bounded() {
    let huge = json!(1u64 << 40);
    for key in ["max_position_embeddings", "sliding_window", "hc_sinkhorn_iters", "candidate_topk_blocks", "candidate_block_size"] {
        let err = tiny_err(key, huge.clone());
        assert_msg(&err, &[&format!("text_config.{key}"), "= 1099511627776", "at most"]);
    }
    // A window longer than the context.
    let err = tiny_hf_with(|v| {
        text(v).insert("max_position_embeddings".into(), json!(64));
        text(v).insert("sliding_window".into(), json!(128));
    })
    .expect_err("config must be rejected");
    assert_msg(&err, &["text_config.sliding_window", "= 128", "at most 64"]);
}

#[test]
fn small_counts_must_be_positive() {
    for key in ["hc_mult", "hc_sinkhorn_iters", "index_topk", "sliding_window", "index_n_heads", "num_experts_per_tok"]
    {
        let err = tiny_err(key, json!(0));
        assert_msg(&err, &[&format!("text_config.{key}"), "= 0", "at least 1"]);
    }
    let err = tiny_err("num_experts_per_tok", json!(9));
    assert_msg(&err, &["text_config.num_experts_per_tok", "= 9", "n_routed_experts = 8"]);
    for key in ["rms_norm_eps", "hc_eps", "gate_temp", "swiglu_limit", "routed_scaling_factor"] {
        let err = tiny_err(key, json!(-1.0));
        assert_msg(&err, &[&format!("text_config.{key}"), "= -1", "> 0"]);
    }
}

#[test]
fn rope_settings_are_checked() {
    let err = tiny_hf_with(|v| v["text_config"]["rope_scaling"]["beta_fast"] = json!(0.5)).unwrap_err();
    assert_msg(&err, &["text_config.rope_scaling.beta_fast", "= 0.5", "beta_slow = 1"]);
    let err = tiny_hf_with(|v| v["text_config"]["rope_scaling"]["rope_type"] = json!("linear")).unwrap_err();
    assert_msg(&err, &["text_config.rope_scaling.rope_type", "\"linear\"", "yarn"]);
    let err = tiny_err("compress_rope_theta", json!(0));
    assert_msg(&err, &["text_config.compress_rope_theta", "= 0"]);
}

#[test]
fn token_ids_must_be_in_the_vocabulary() {
    let err = tiny_hf_with(|v| v["bos_token_id"] = json!(600)).unwrap_err();
    assert_msg(&err, &["bos_token_id", "= 600", "vocab_size = 512"]);
    // An image token outside the vocab means "no image token" (text-only checkpoints).
    let cfg = tiny_hf_with(|v| v["image_token_id"] = json!(512)).unwrap();
    assert_eq!(cfg.image_token_id, Some(512));
    let err = tiny_err("engram_compressed_vocab_size", json!(513));
    assert_msg(&err, &["text_config.engram_compressed_vocab_size", "= 513", "vocab_size = 512"]);
}

#[test]
fn unsupported_settings_are_rejected() {
    let err = tiny_hf_with(|v| v["quantization_config"]["weight_block_size"] = json!([128, 128])).unwrap_err();
    assert_msg(&err, &["quantization_config.weight_block_size", "[128, 128]", "[32, 32]"]);
    let err = tiny_hf_with(|v| v["quantization_config"]["expert_dtype"] = json!("fp8")).unwrap_err();
    assert_msg(&err, &["quantization_config.expert_dtype", "\"fp8\"", "fp4"]);
    let err = tiny_err("num_key_value_heads", json!(4));
    assert_msg(&err, &["text_config.num_key_value_heads", "= 4"]);
    let err = tiny_err("scoring_func", json!("sigmoid"));
    assert_msg(&err, &["text_config.scoring_func", "\"sigmoid\"", "sqrtsoftplus"]);
    let err = tiny_err("num_hash_layers", json!(3));
    assert_msg(&err, &["text_config.num_hash_layers", "= 3", "hash routing"]);
    let err = tiny_err("model_type", json!("deepseek_v4"));
    assert_msg(&err, &["text_config.model_type", "\"deepseek_v4\""]);
    let err = tiny_inf_with(|v| v["dtype"] = json!("int4")).unwrap_err();
    assert_msg(&err, &["`dtype`", "\"int4\""]);
}

#[test]
fn inference_form_errors_use_inference_names() {
    let err = tiny_inf_with(|v| v["window_size"] = json!(0)).unwrap_err();
    assert_msg(&err, &["`window_size` = 0"]);
    let err = tiny_inf_with(|v| v["kv_source_layers"] = json!([3, 1, 4])).unwrap_err();
    assert_msg(&err, &["`kv_source_layers` must be strictly ascending", "entry 1 = 1 follows 3"]);
    let err = tiny_inf_with(|v| v["n_heads"] = json!(3)).unwrap_err();
    assert_msg(&err, &["`n_heads` = 3", "o_groups = 2"]);
    let err = tiny_inf_with(|v| v["rope_head_dim"] = json!(128)).unwrap_err();
    assert_msg(&err, &["`head_dim` = 128", "rope_head_dim = 128"]);
    let err = tiny_inf_with(|v| v["compress_ratios"].as_array_mut().unwrap().push(json!(0))).unwrap_err();
    assert_msg(&err, &["`compress_ratios`", "10 entries", "n_layers = 9", "n_mtp_layers = 0"]);
    let err = tiny_inf_with(|v| v["rope_factor"] = json!(0.5)).unwrap_err();
    assert_msg(&err, &["`rope_factor` = 0.5"]);
}

// ---- unreadable input ----

#[test]
fn missing_required_field_is_named() {
    let err = tiny_hf_with(|v| {
        text(v).remove("hidden_size");
    })
    .unwrap_err();
    assert_msg(&err, &["missing required field `text_config.hidden_size`"]);
    let err = tiny_inf_with(|v| {
        v.as_object_mut().unwrap().remove("dim");
    })
    .unwrap_err();
    assert_msg(&err, &["missing required field `dim`"]);
    let err = tiny_inf_with(|v| {
        v.as_object_mut().unwrap().remove("original_seq_len");
    })
    .unwrap_err();
    assert_msg(&err, &["missing required field `original_seq_len`"]);
    let err = tiny_hf_with(|v| {
        text(v).remove("candidate_block_size");
    })
    .unwrap_err();
    assert_msg(&err, &["`text_config.candidate_block_size`", "candidate_source_layer_id"]);
}

#[test]
fn wrongly_typed_field_is_named() {
    let err = tiny_err("hidden_size", json!("256"));
    assert_msg(&err, &["field `text_config.hidden_size`", "invalid type"]);
    let err = tiny_err("sliding_window", json!(-8));
    assert_msg(&err, &["field `text_config.sliding_window`", "-8"]);
    let err = tiny_err("compress_ratios", json!([0, 2, "x"]));
    assert_msg(&err, &["field `text_config.compress_ratios`"]);
    let err = tiny_inf_with(|v| v["n_layers"] = json!(9.5)).unwrap_err();
    assert_msg(&err, &["field `n_layers`"]);
    let err = tiny_hf_with(|v| v["text_config"] = json!([1])).unwrap_err();
    assert_msg(&err, &["`text_config` must be a JSON object"]);
}

#[test]
fn malformed_json_and_unknown_forms_are_rejected() {
    let err = Config::from_hf_json("{ \"text_config\": ").unwrap_err();
    assert!(matches!(err, ConfigError::Syntax(_)), "{err}");
    assert_msg(&err, &["not valid JSON", "line 1"]);
    assert_msg(&Config::from_inference_json("[1, 2]").unwrap_err(), &["must be a JSON object"]);
    assert!(matches!(Config::from_json("{\"foo\": 1}").unwrap_err(), ConfigError::UnknownForm));
    let err = Config::from_file(format!("{TINY}/no_such_config.json")).unwrap_err();
    assert_msg(&err, &["cannot read config file", "no_such_config.json"]);
    let err: candle_core::Error = err.into();
    assert!(err.to_string().contains("no_such_config.json"), "{err}");
}
