//! The text-model tensors of a release checkpoint and their logical shapes, derived from a
//! `config.json` (spec §4.0, §8, §9, §12.1). Shared by the loader tests and the synthetic
//! checkpoint writer.

use std::collections::BTreeMap;

/// The text-model tensors and their logical shapes for a config (spec §4.0, §8, §9, §12.1).
pub fn expected_shapes(cfg: &serde_json::Value) -> BTreeMap<String, Vec<usize>> {
    let t = &cfg["text_config"];
    let u = |k: &str| t[k].as_u64().unwrap_or_else(|| panic!("config field {k}")) as usize;
    let ids = |k: &str| -> Vec<usize> {
        t[k].as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect()
    };
    let (d, v, h, hd) = (
        u("hidden_size"),
        u("vocab_size"),
        u("num_attention_heads"),
        u("head_dim"),
    );
    let (ql, og, ol, hc) = (u("q_lora_rank"), u("o_groups"), u("o_lora_rank"), u("hc_mult"));
    let (ne, mi, ih, ihd) = (
        u("n_routed_experts"),
        u("moe_intermediate_size"),
        u("index_n_heads"),
        u("index_head_dim"),
    );
    // One ratio per backbone layer, optionally followed by the MTP layers' (spec §1.1).
    let mut ratios = ids("compress_ratios");
    assert!(ratios.len() >= u("num_hidden_layers"), "compress_ratios shorter than num_hidden_layers");
    ratios.truncate(u("num_hidden_layers"));
    let (kv_src, idx_src, eng) = (
        ids("kv_source_layer_ids"),
        ids("index_source_layer_ids"),
        ids("engram_layer_ids"),
    );
    let eng_rows = ids("engram_num_embeddings");
    let (eh, ehd, emax) = (u("engram_n_heads"), u("engram_head_dim"), u("engram_max_ngram_size"));
    let mut m = BTreeMap::new();
    let mut add = |n: String, s: &[usize]| {
        m.insert(n, s.to_vec());
    };
    add("embed.weight".into(), &[v, d]);
    add("head.weight".into(), &[v, d]);
    add("norm.weight".into(), &[d]);
    for (l, &ratio) in ratios.iter().enumerate() {
        let p = format!("layers.{l}");
        add(format!("{p}.attn_norm.weight"), &[d]);
        add(format!("{p}.ffn_norm.weight"), &[d]);
        for s in ["attn", "ffn"] {
            add(format!("{p}.hc_{s}_fn"), &[(2 + hc) * hc, hc * d]);
            add(format!("{p}.hc_{s}_base"), &[(2 + hc) * hc]);
            add(format!("{p}.hc_{s}_scale"), &[3]);
        }
        add(format!("{p}.attn.wq_a.weight"), &[ql, d]);
        add(format!("{p}.attn.q_norm.weight"), &[ql]);
        add(format!("{p}.attn.wq_b.weight"), &[h * hd, ql]);
        add(format!("{p}.attn.wkv.weight"), &[hd, d]);
        add(format!("{p}.attn.kv_norm.weight"), &[hd]);
        add(format!("{p}.attn.wo_a.weight"), &[og * ol, h * hd / og]);
        add(format!("{p}.attn.wo_b.weight"), &[d, og * ol]);
        add(format!("{p}.attn.attn_sink"), &[h]);
        if kv_src.contains(&l) {
            add(format!("{p}.attn.compressor.wkv.weight"), &[hd, d]);
            if ratio > 1 {
                add(format!("{p}.attn.compressor.wgate.weight"), &[hd, d]);
            }
            add(format!("{p}.attn.compressor.norm.weight"), &[hd]);
            add(format!("{p}.attn.indexer.wk.weight"), &[ihd, hd]);
            add(format!("{p}.attn.indexer.k_norm.weight"), &[ihd]);
        }
        if idx_src.contains(&l) {
            add(format!("{p}.attn.indexer.wq_b.weight"), &[ih * ihd, ql]);
            add(format!("{p}.attn.indexer.weights_proj.weight"), &[ih, d]);
        }
        add(format!("{p}.ffn.gate.weight"), &[ne, d]);
        add(format!("{p}.ffn.gate.bias"), &[ne]);
        add(format!("{p}.ffn.gate.bias_vl"), &[ne]);
        let mut ffn = |e: String| {
            add(format!("{e}.w1.weight"), &[mi, d]);
            add(format!("{e}.w3.weight"), &[mi, d]);
            add(format!("{e}.w2.weight"), &[d, mi]);
        };
        for e in 0..ne {
            ffn(format!("{p}.ffn.experts.{e}"));
        }
        ffn(format!("{p}.ffn.shared_experts"));
        if let Some(k) = eng.iter().position(|&x| x == l) {
            add(format!("{p}.engram.embed.weight"), &[eng_rows[k], ehd]);
            add(format!("{p}.engram.wkv.weight"), &[(hc + 1) * d, (emax - 1) * eh * ehd]);
            add(format!("{p}.engram.q_weight"), &[hc, d]);
            add(format!("{p}.engram.k_weight"), &[hc, d]);
        }
    }
    m
}
