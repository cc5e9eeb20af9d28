//! Property / fuzz suite (issue 20): random and mutated inputs never panic and never allocate
//! unboundedly; they either work or return an error.
//!
//! * `config.json`: the repository's configs with fields replaced by random JSON values or
//!   removed, and random text;
//! * safetensors files: crafted headers (header length, offsets, dtypes, shapes — including
//!   tensors declaring 2^60 bytes and header lengths up to 2^64 − 1) loaded through
//!   `ReleaseCheckpoint`, then every tensor read;
//! * `weights.toml`: random entries and byte-mutated copies of the repository's file;
//! * `Model::forward` on the embedded model: random token ids (in and out of the vocabulary)
//!   and lengths, random chunking, random truncations.
//!
//! Case counts are fixed and small so the whole file runs in seconds; a proptest failure
//! prints the shrunk input.

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::{DType, Device};
use deepseek_v41::loader::ReleaseCheckpoint;
use deepseek_v41::model::Pretrained;
use deepseek_v41::weights::WeightsCatalog;
use deepseek_v41::{Config, Numerics};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn cases(n: u32) -> ProptestConfig {
    ProptestConfig { cases: n, failure_persistence: None, ..ProptestConfig::default() }
}

// ---- config.json --------------------------------------------------------------------------

fn repo_configs() -> &'static [Value] {
    static CONFIGS: OnceLock<Vec<Value>> = OnceLock::new();
    CONFIGS.get_or_init(|| {
        ["models/v41-shakespeare-tiny/config.json", "tests/fixtures/v41-tiny/config.json", "tests/fixtures/v41-tiny/inference_config.json"]
            .iter()
            .map(|p| serde_json::from_str(&std::fs::read_to_string(repo().join(p)).expect("config")).expect("json"))
            .collect()
    })
}

/// A JSON value of any kind, with numbers at the edges (0, negative, huge, fractional).
fn any_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop_oneof![Just(0u64), Just(1), Just(2), Just(3), Just(u32::MAX as u64), Just(1 << 40), Just(u64::MAX), 0u64..70_000].prop_map(Value::from),
        prop_oneof![Just(-1i64), Just(i64::MIN), -5i64..0].prop_map(Value::from),
        prop_oneof![Just(f64::MAX), Just(1e-300), Just(0.5), Just(-0.0), -1e3f64..1e6].prop_map(Value::from),
        "[a-z_]{0,8}".prop_map(Value::from),
        proptest::collection::vec(0u64..70, 0..8).prop_map(Value::from),
        Just(Value::Object(Default::default())),
    ]
}

/// Replaces (or with `None`, removes) the `index`-th field of `v` in depth-first order,
/// descending into objects (so `text_config`, `rope_scaling`, `quantization_config` fields are
/// reached too).
fn mutate(v: &mut Value, index: &mut usize, new: &Option<Value>) -> bool {
    let Value::Object(map) = v else { return false };
    let keys: Vec<String> = map.keys().cloned().collect();
    for k in keys {
        if *index == 0 {
            match new {
                Some(x) => map.insert(k, x.clone()),
                None => map.remove(&k),
            };
            return true;
        }
        *index -= 1;
        if mutate(map.get_mut(&k).expect("key"), index, new) {
            return true;
        }
    }
    false
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn mutated_configs_parse_or_error(which in 0usize..3, edits in proptest::collection::vec((0usize..200, proptest::option::weighted(0.85, any_json())), 1..4)) {
        let mut v = repo_configs()[which].clone();
        for (index, new) in &edits {
            let mut i = *index;
            mutate(&mut v, &mut i, new);
        }
        if let Ok(cfg) = Config::from_json(&v.to_string()) {
            // A config that parses is consistent: every role lookup works.
            for l in 0..cfg.n_layers() {
                prop_assert!(cfg.role(l).is_some());
            }
        }
    }

    #[test]
    fn random_text_is_not_a_config(text in ".{0,200}", cut in 0usize..3000) {
        let _ = Config::from_json(&text);
        let real = repo_configs()[0].to_string();
        let _ = Config::from_json(&real[..cut.min(real.len())]);
    }
}

proptest! {
    #![proptest_config(cases(32))]

    /// The embedded model's checkpoint under a config with integer fields changed: the model
    /// loads (the change does not touch a shape) or the load errors; a cache and a forward call
    /// either work or error.
    #[test]
    fn mutated_configs_against_a_real_checkpoint_load_or_error(field in any::<prop::sample::Index>(), pick in any::<prop::sample::Index>()) {
        let mut v = repo_configs()[0].clone();
        let text = v["text_config"].as_object_mut().expect("text_config");
        // Every integer field, those that size run-time work with no weight shape to check them
        // against included (the config bounds them: config/validate.rs).
        let ints: Vec<String> = text.iter().filter(|(_, x)| x.is_u64()).map(|(k, _)| k.clone()).collect();
        let key = field.get(&ints).clone();
        let orig = text[&key].as_u64().expect("u64");
        let choices = [0u64, 1, orig.saturating_sub(1), orig + 1, orig.saturating_mul(2), orig / 2, 1 << 40, u64::MAX];
        text.insert(key, Value::from(*pick.get(&choices)));
        let Ok(cfg) = Config::from_json(&v.to_string()) else { return Ok(()) };
        let dir = repo().join("models/v41-shakespeare-tiny");
        let tokenizer = model().tokenizer.clone();
        let ckpt = ReleaseCheckpoint::open_dir(&dir).expect("checkpoint");
        if let Ok(p) = Pretrained::load(cfg, tokenizer, ckpt, Numerics::REFERENCE, DType::BF16, &Device::Cpu) {
            if let Ok(mut cache) = p.new_cache() {
                let _ = p.model.forward(&[0, 5, 9], &mut cache);
            }
        }
    }
}

// ---- safetensors headers ----------------------------------------------------------------

/// A tensor entry of a crafted header: dtype string, shape, `[start, end)` offsets.
#[derive(Debug, Clone)]
struct Entry {
    dtype: String,
    shape: Vec<u64>,
    offsets: (u64, u64),
}

fn entry() -> impl Strategy<Value = Entry> {
    let dtype = prop_oneof![
        Just("F32".to_string()),
        Just("BF16".to_string()),
        Just("F8_E4M3".to_string()),
        Just("F8_E8M0".to_string()),
        Just("I8".to_string()),
        Just("F4".to_string()),
        "[A-Z0-9_]{0,6}",
    ];
    let dim = prop_oneof![0u64..9, Just(1 << 20), Just(1 << 30), Just(1 << 60), Just(u64::MAX)];
    let offset = prop_oneof![0u64..300, Just(1 << 60), Just(u64::MAX)];
    (dtype, proptest::collection::vec(dim, 0..4), offset.clone(), offset)
        .prop_map(|(dtype, shape, a, b)| Entry { dtype, shape, offsets: (a, b) })
}

/// A safetensors file: `header_len` (the true length unless overridden), the JSON header with
/// `entries` (named t0, t1, …), then `data` bytes.
fn safetensors_bytes(entries: &[Entry], header_len: Option<u64>, data: usize, raw_header: Option<&str>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    for (i, e) in entries.iter().enumerate() {
        header.insert(
            format!("t{i}"),
            serde_json::json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [e.offsets.0, e.offsets.1]}),
        );
    }
    let text = raw_header.map_or_else(|| Value::Object(header).to_string(), str::to_string);
    let mut bytes = header_len.unwrap_or(text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.extend((0..data).map(|i| i as u8));
    bytes
}

/// Opens `bytes` as a one-file checkpoint and reads every tensor it declares.
fn load_all(bytes: &[u8]) -> Result<usize, String> {
    let dir = std::env::temp_dir().join(format!("dsv41-fuzz-{}-{:?}", std::process::id(), std::thread::current().id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let path = dir.join("model.safetensors");
    std::fs::write(&path, bytes).map_err(|e| e.to_string())?;
    let ckpt = ReleaseCheckpoint::open(&[&path]).map_err(|e| e.to_string())?;
    let mut read = 0;
    for name in ckpt.stored_names() {
        if ckpt.raw_bytes(&name).is_ok() {
            read += 1;
        }
        let _ = ckpt.get(&name, DType::F32, &Device::Cpu);
    }
    Ok(read)
}

proptest! {
    #![proptest_config(cases(192))]

    #[test]
    fn crafted_safetensors_headers_load_or_error(
        entries in proptest::collection::vec(entry(), 0..4),
        header_len in proptest::option::weighted(0.3, prop_oneof![Just(0u64), Just(7), 0u64..400, Just(u64::MAX), Just(1 << 60)]),
        data in 0usize..300,
    ) {
        let _ = load_all(&safetensors_bytes(&entries, header_len, data, None));
    }

    #[test]
    fn random_headers_and_truncated_files_error(raw in "[ -~]{0,80}", header_len in any::<u64>(), cut in 0usize..64) {
        let _ = load_all(&safetensors_bytes(&[], None, 16, Some(&raw)));
        let _ = load_all(&safetensors_bytes(&[], Some(header_len), 16, Some(&raw)));
        let good = safetensors_bytes(&[Entry { dtype: "F32".into(), shape: vec![2, 3], offsets: (0, 24) }], None, 24, None);
        let _ = load_all(&good[..cut.min(good.len())]);
    }
}

#[test]
fn huge_declared_tensors_and_headers_are_rejected_without_allocating() {
    // 2^60 bytes of F32, a header length of 2^64 − 1, a 2^60 × 2^60 shape: all errors.
    let huge = Entry { dtype: "F32".into(), shape: vec![1 << 58], offsets: (0, 1 << 60) };
    let err = load_all(&safetensors_bytes(&[huge], None, 16, None)).unwrap_err();
    assert!(err.contains("truncated") || err.contains("data ends"), "{err}");
    let err = load_all(&safetensors_bytes(&[], Some(u64::MAX), 16, Some("{}"))).unwrap_err();
    assert!(err.contains("header length"), "{err}");
    let overflow = Entry { dtype: "F32".into(), shape: vec![1 << 60, 1 << 60], offsets: (0, 16) };
    let err = load_all(&safetensors_bytes(&[overflow], None, 16, None)).unwrap_err();
    assert!(err.contains("overflows"), "{err}");
    let ok = Entry { dtype: "F32".into(), shape: vec![2, 2], offsets: (0, 16) };
    assert_eq!(load_all(&safetensors_bytes(&[ok], None, 16, None)), Ok(1));
}

// ---- weights.toml -------------------------------------------------------------------------

fn toml_entry() -> impl Strategy<Value = String> {
    let field = prop_oneof![
        "[a-z0-9.-]{0,12}".prop_map(|s| format!("name = \"{s}\"")),
        "[a-z]{1,5}/[a-z]{1,5}".prop_map(|s| format!("repo = \"{s}\"")),
        "[0-9a-f]{0,40}".prop_map(|s| format!("revision = \"{s}\"")),
        "[a-z/.]{0,12}".prop_map(|s| format!("local = \"{s}\"")),
        proptest::collection::vec("[a-z.]{0,8}", 0..3).prop_map(|v| format!("files = {v:?}")),
        "[a-z.]{0,12}".prop_map(|s| format!("index = \"{s}\"")),
        "[a-z0-9]{0,5}".prop_map(|s| format!("dtype = \"{s}\"")),
        any::<bool>().prop_map(|b| format!("default = {b}")),
        "[a-z.]{0,12}".prop_map(|s| format!("tokenizer = \"{s}\"")),
        Just("repo = 3".to_string()),
        Just("unknown = 1".to_string()),
    ];
    proptest::collection::vec(field, 0..8).prop_map(|fields| format!("[[model]]\n{}\n", fields.join("\n")))
}

fn check_catalog(text: &str) {
    if let Ok(cat) = text.parse::<WeightsCatalog>() {
        for entry in cat.models() {
            let _ = entry.source();
            let _ = entry.dtype();
            let _ = entry.weight_files();
            let _ = cat.local_dir(entry);
            let _ = cat.get_for_generation(&entry.name);
        }
        let _ = cat.default_model();
        let _ = cat.get("no such name");
    }
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn random_catalog_entries_parse_or_error(entries in proptest::collection::vec(toml_entry(), 0..4)) {
        check_catalog(&entries.concat());
    }

    #[test]
    fn mutated_repository_catalog_parses_or_errors(edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let mut bytes = deepseek_v41::weights::EMBEDDED.as_bytes().to_vec();
        for (at, b) in &edits {
            let i = at.index(bytes.len());
            bytes[i] = *b;
        }
        check_catalog(&String::from_utf8_lossy(&bytes));
    }
}

// ---- Model::forward -----------------------------------------------------------------------

fn model() -> &'static Pretrained {
    static MODEL: OnceLock<Pretrained> = OnceLock::new();
    MODEL.get_or_init(|| {
        Pretrained::load_dir(repo().join("models/v41-shakespeare-tiny"), Numerics::REFERENCE, DType::BF16, &Device::Cpu)
            .expect("the embedded model loads")
    })
}

fn token_id() -> impl Strategy<Value = u32> {
    prop_oneof![8 => 0u32..4096, 1 => Just(4096u32), 1 => any::<u32>()]
}

proptest! {
    #![proptest_config(cases(24))]

    #[test]
    fn random_tokens_run_or_error_and_truncation_never_panics(
        calls in proptest::collection::vec(proptest::collection::vec(token_id(), 0..12), 1..4),
        depth in 0usize..8,
        cut in any::<prop::sample::Index>(),
    ) {
        let p = model();
        let vocab = p.config.vocab_size;
        let mut cache = p.new_cache().expect("cache");
        cache.set_rollback_depth(depth).expect("empty cache");
        for ids in &calls {
            let before = cache.seq_len();
            let valid = !ids.is_empty() && ids.iter().all(|&id| (id as usize) < vocab);
            match p.model.forward(ids, &mut cache) {
                Ok(logits) => {
                    prop_assert!(valid, "{ids:?} was accepted");
                    prop_assert_eq!(logits.dims(), &[ids.len(), vocab][..]);
                    prop_assert_eq!(cache.seq_len(), before + ids.len());
                }
                Err(e) => {
                    prop_assert!(!valid, "{ids:?} failed: {e}");
                    prop_assert_eq!(cache.seq_len(), before, "a rejected call changed the cache");
                }
            }
        }
        let len = cache.seq_len();
        let target = cut.index(len + 2);
        match cache.truncate(target) {
            Ok(()) => {
                prop_assert_eq!(cache.seq_len(), target);
                if target > 0 {
                    prop_assert!(p.model.forward(&[0], &mut cache).is_ok());
                }
            }
            Err(_) => prop_assert_eq!(cache.seq_len(), len),
        }
    }
}
