//! The released DeepSeek-V4.1-Flash `config.json` (`tests/fixtures/deepseek-v41-flash`, spec
//! §1.1) cut down to a chosen subset of its backbone layers, keeping every width and every
//! picked layer's role (spec §1.4), for a synthetic checkpoint at Flash widths (include it with
//! `#[path = "support/flash_config.rs"] mod flash_config;`).
//!
//! Picked layer `picks[i]` becomes layer `i`: the compress ratios, the kv / index / candidate
//! source ids, the Engram layer ids and the DSpark target ids are renumbered (ids of layers not
//! picked are dropped); the MTP tail of `compress_ratios` stays. The cut config is validated and
//! each layer's resolved role compared with its released role, so a pick that loses a layer's
//! source (layer 21 without 20, say) is an error naming the layer.
//!
//! Engram tables: a released table has ~384M rows (~101 GB as FP8 rows plus scales, spec §12.1);
//! the model leaves a table that large in the checkpoint and reads it by rows
//! (`model::EngramPlacement::Auto`), but writing it takes the disk space, so the rows can be
//! capped. The row count of a table is fixed by the hash's prime walk (spec §9.2: 24 primes
//! above `engram_vocab_size`, summed), so capping sets `engram_vocab_size` to about
//! `rows / 24` and `engram_num_embeddings` to the walk's sums: the hash differs from the
//! release's, the tensor shapes and formats do not.
#![allow(dead_code)]

use std::path::Path;

use anyhow::{bail, Context, Result};
use deepseek_v41::config::{AttentionRole, CandidateRole, Config, LayerRole, TopkRole};
use serde_json::{json, Value};

use crate::repo_files::repo_file;

/// The released HF `config.json` of DeepSeek-V4.1-Flash (from the repository root).
pub const FLASH_CONFIG: &str = "tests/fixtures/deepseek-v41-flash/config.json";
/// The released DeepSeek-V4 tokenizer (gzip), whose compressed token map has the 99092 ids the
/// Engram config expects (spec §9.1).
pub const FLASH_TOKENIZER: &str = "tests/fixtures/deepseek-v4-tokenizer/tokenizer.json.gz";

/// A cut Flash config and what it holds.
pub struct FlashConfig {
    /// The HF `config.json` document.
    pub json: Value,
    /// The resolved config.
    pub config: Config,
    /// The released layer id of each layer.
    pub picks: Vec<usize>,
    /// Rows of each Engram table, in `engram_layer_ids` order.
    pub engram_rows: Vec<usize>,
}

fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    let mut i = 2;
    while i * i <= n {
        if n.is_multiple_of(i) {
            return false;
        }
        i += 1;
    }
    true
}

/// Table rows of each Engram layer for `vocab`: the global prime walk of spec §9.2 (per layer,
/// per n-gram order, start above `vocab − 1` and take the next unused prime per head), summed.
pub fn engram_rows_for(layers: usize, orders: usize, heads: usize, vocab: u64) -> Vec<usize> {
    let mut seen = std::collections::HashSet::new();
    (0..layers)
        .map(|_| {
            let mut rows = 0u64;
            for _ in 0..orders {
                let mut c = vocab - 1;
                for _ in 0..heads {
                    c += 1;
                    while !is_prime(c) || seen.contains(&c) {
                        c += 1;
                    }
                    seen.insert(c);
                    rows += c;
                }
            }
            rows as usize
        })
        .collect()
}

/// `ids` restricted to picked layers, renumbered.
fn remap(ids: &[usize], picks: &[usize]) -> Vec<usize> {
    ids.iter().filter_map(|id| picks.iter().position(|p| p == id)).collect()
}

fn ids(t: &Value, key: &str) -> Result<Vec<usize>> {
    t[key]
        .as_array()
        .with_context(|| format!("released config: {key} is not a list"))?
        .iter()
        .map(|v| v.as_u64().map(|x| x as usize).with_context(|| format!("released config: {key} holds {v}")))
        .collect()
}

/// `role` with every layer id passed through `f`.
fn relabel(role: &LayerRole, f: impl Fn(usize) -> usize) -> LayerRole {
    let cand = |c: CandidateRole| match c {
        CandidateRole::Consume { source } => CandidateRole::Consume { source: f(source) },
        c => c,
    };
    let attention = match role.attention {
        AttentionRole::WindowOnly => AttentionRole::WindowOnly,
        AttentionRole::Compressed { ratio, kv_source, topk } => AttentionRole::Compressed {
            ratio,
            kv_source: f(kv_source),
            topk: match topk {
                TopkRole::Full { candidates } => TopkRole::Full { candidates: cand(candidates) },
                TopkRole::Reindex { key_owner, candidates } => TopkRole::Reindex { key_owner: f(key_owner), candidates: cand(candidates) },
                TopkRole::Reuse { index_source } => TopkRole::Reuse { index_source: f(index_source) },
            },
        },
    };
    LayerRole { layer: f(role.layer), attention, engram: role.engram }
}

/// The released Flash config cut to the released layers `picks` (strictly ascending) with
/// `experts` routed experts (`None`: all 384) and Engram tables of about `engram_rows` rows
/// (`None`: the released sizes).
pub fn flash_config(picks: &[usize], experts: Option<usize>, engram_rows: Option<usize>) -> Result<FlashConfig> {
    let path = repo_file(FLASH_CONFIG);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let released = Config::from_json(&text).context("the released Flash config does not validate")?;
    let mut json: Value = serde_json::from_str(&text)?;
    let n = released.num_hidden_layers;
    if picks.is_empty() {
        bail!("pick at least one layer");
    }
    if let Some(w) = picks.windows(2).find(|w| w[1] <= w[0]) {
        bail!("layer ids must be strictly ascending, got {} then {}", w[0], w[1]);
    }
    if let Some(&l) = picks.iter().find(|&&l| l >= n) {
        bail!("layer id {l} is not a backbone layer of the released config (0..{n})");
    }
    let t = json["text_config"].as_object_mut().context("released config: no text_config")?;
    let t_val = Value::Object(t.clone());
    let ratios = ids(&t_val, "compress_ratios")?;
    let mut cut: Vec<usize> = picks.iter().map(|&l| ratios[l]).collect();
    cut.extend_from_slice(&ratios[n..]);
    t.insert("num_hidden_layers".into(), picks.len().into());
    t.insert("compress_ratios".into(), json!(cut));
    for key in ["kv_source_layer_ids", "index_source_layer_ids", "dspark_target_layer_ids"] {
        t.insert(key.into(), json!(remap(&ids(&t_val, key)?, picks)));
    }
    match released.candidate_source_layer_id.map(|c| remap(&[c], picks)) {
        Some(c) if !c.is_empty() => t.insert("candidate_source_layer_id".into(), c[0].into()),
        _ => t.remove("candidate_source_layer_id"),
    };
    let engram = released.engram.as_ref().context("the released config has Engram layers")?;
    let engram_layers = remap(&engram.layer_ids, picks);
    let vocab = match engram_rows {
        None => engram.vocab_size,
        Some(rows) => (rows / ((engram.max_ngram_size - 1) * engram.n_heads)).max(2),
    };
    let rows = engram_rows_for(engram_layers.len(), engram.max_ngram_size - 1, engram.n_heads, vocab as u64);
    t.insert("engram_layer_ids".into(), json!(engram_layers));
    t.insert("engram_num_embeddings".into(), json!(rows));
    t.insert("engram_vocab_size".into(), vocab.into());
    if let Some(e) = experts {
        t.insert("n_routed_experts".into(), e.into());
    }
    let config = Config::from_json(&json.to_string()).context("the cut Flash config does not validate")?;
    for (i, &l) in picks.iter().enumerate() {
        let want = relabel(&released.layers[l], |x| picks.iter().position(|&p| p == x).unwrap_or(usize::MAX));
        if config.layers[i] != want {
            bail!(
                "released layer {l} (layer {i} here) would run as {:?} instead of its released role {:?}: \
                 also pick the layers its kv / index / candidate sources are in",
                config.layers[i],
                released.layers[l]
            );
        }
    }
    Ok(FlashConfig { json, config, picks: picks.to_vec(), engram_rows: rows })
}

/// One line per layer: its released id, ratio, mode and sources (released ids), Engram.
pub fn describe(fc: &FlashConfig) -> Vec<String> {
    let p = |x: usize| fc.picks[x];
    fc.config
        .layers
        .iter()
        .zip(&fc.picks)
        .map(|(r, &l)| {
            let mode = match r.attention {
                AttentionRole::WindowOnly => "window only".to_string(),
                AttentionRole::Compressed { ratio, kv_source, topk } => {
                    let cand = match topk.candidates() {
                        CandidateRole::None => String::new(),
                        CandidateRole::Publish => ", publishes candidates".into(),
                        CandidateRole::Consume { source } => format!(", consumes candidates of {}", p(source)),
                    };
                    let mode = match topk {
                        TopkRole::Full { .. } => "Full (kv + index source)".to_string(),
                        TopkRole::Reindex { key_owner, .. } => format!("Reindex (keys of {})", p(key_owner)),
                        TopkRole::Reuse { index_source } => format!("Reuse (top-k of {})", p(index_source)),
                    };
                    format!("ratio {ratio}, {mode}, compressed KV of {}{cand}", p(kv_source))
                }
            };
            let engram = if r.engram { " + Engram" } else { "" };
            format!("layer {} = released layer {l}: {mode}{engram}", r.layer)
        })
        .collect()
}

/// Writes `fc`'s `config.json` into `dir` and copies the release tokenizer next to it (removing
/// a `tokenizer.json` that a template-scaled model left, which would take precedence).
pub fn write_config(fc: &FlashConfig, dir: &Path) -> Result<()> {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&fc.json)?)?;
    let stale = dir.join("tokenizer.json");
    if stale.exists() {
        std::fs::remove_file(&stale)?;
    }
    let tokenizer = repo_file(FLASH_TOKENIZER);
    std::fs::copy(&tokenizer, dir.join("tokenizer.json.gz")).with_context(|| format!("copying {}", tokenizer.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_engram_rows_follow_from_the_walk() {
        // Spec §9.2 self-check: the sums are the released engram_num_embeddings.
        assert_eq!(engram_rows_for(2, 3, 8, 16_000_000), vec![384_006_168, 384_016_682]);
    }

    #[test]
    fn every_layer_kind_from_a_pick() -> Result<()> {
        let fc = flash_config(&[0, 1, 2, 3, 20, 21, 24], Some(8), Some(1 << 16))?;
        let c = &fc.config;
        assert_eq!((c.num_hidden_layers, c.n_routed_experts, c.hidden_size), (7, 8, 5120));
        assert_eq!(c.kv_source_layer_ids, vec![2, 4]);
        assert_eq!(c.index_source_layer_ids, vec![2, 4, 6]);
        assert_eq!(c.candidate_source_layer_id, Some(4));
        assert_eq!(c.engram.as_ref().map(|e| e.layer_ids.clone()), Some(vec![1]));
        assert!(fc.engram_rows[0] >= 1 << 16 && fc.engram_rows[0] < (1 << 16) * 21 / 20, "{:?}", fc.engram_rows);
        assert!(flash_config(&[0, 21], None, None).is_err(), "layer 21 without its kv source 20");
        assert!(flash_config(&[20, 24], None, None).is_ok());
        Ok(())
    }
}
