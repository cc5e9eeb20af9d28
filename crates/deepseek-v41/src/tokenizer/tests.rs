//! Tests of the tokenizer wrapper against the vendored model's golden ids and the Python
//! `tokenizers` reference ids of the V4 tokenizer.

use super::test_tokenizers::{deepseek_v4, deepseek_v4_dir, repo_root, shakespeare};
use super::*;

fn read_json(path: std::path::PathBuf) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn shakespeare_special_ids_and_size() {
    let tok = shakespeare();
    assert_eq!((tok.bos_id(), tok.eos_id(), tok.vocab_size()), (0, 1, 4096));
    assert_eq!(tok.added_token_id(PAD_TOKEN, "test").unwrap(), 2);
}

#[test]
fn shakespeare_golden_prompts_encode_to_the_golden_ids() {
    let golden = read_json(repo_root().join("models/v41-shakespeare-tiny/golden_greedy.json"));
    let tok = shakespeare();
    let prompts = golden["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 3);
    for p in prompts {
        let text = p["prompt"].as_str().unwrap();
        let want = ids_of(&p["prompt_ids"]);
        assert_eq!(tok.encode(text, true).unwrap(), want, "{text:?}");
        assert_eq!(tok.encode(text, false).unwrap(), want[1..], "{text:?} without BOS");
        assert_eq!(tok.decode(&ids_of(&p["new_ids"]), true).unwrap(), p["new_text"].as_str().unwrap());
    }
}

#[test]
fn shakespeare_samples_decode_to_their_text() {
    let samples = read_json(repo_root().join("models/v41-shakespeare-tiny/samples.json"));
    for s in samples["samples"].as_array().unwrap() {
        let ids = ids_of(&s["ids"]);
        assert_eq!(ids[0], 0, "samples start with BOS");
        assert_eq!(shakespeare().decode(&ids, true).unwrap(), s["text"].as_str().unwrap());
    }
}

#[test]
fn bos_is_prepended_only_on_request() {
    let tok = deepseek_v4();
    let plain = tok.encode("Hello world", false).unwrap();
    let with = tok.encode("Hello world", true).unwrap();
    assert_eq!(with[0], 0);
    assert_eq!(with[1..], plain[..]);
    assert!(!plain.contains(&0));
}

#[test]
fn deepseek_v4_special_ids() {
    let tok = deepseek_v4();
    assert_eq!((tok.bos_id(), tok.eos_id(), tok.vocab_size()), (0, 1, 129_280));
    for (t, id) in [
        (USER_TOKEN, 128803),
        (ASSISTANT_TOKEN, 128804),
        (THINK_START_TOKEN, 128821),
        (THINK_END_TOKEN, 128822),
        (PAD_TOKEN, 2),
    ] {
        assert_eq!(tok.added_token_id(t, "test").unwrap(), id, "{t}");
    }
    let err = tok.added_token_id(SYSTEM_TOKEN, "a system message").unwrap_err().to_string();
    assert!(err.contains("<｜System｜>") && err.contains("a system message"), "{err}");
    // A plain vocabulary entry is not an added token.
    assert!(tok.added_token_id("Hello", "test").is_err());
}

/// The reference ids were produced by the Python `tokenizers` library
/// (`scripts/make_v4_tokenizer_reference.py`).
#[test]
fn deepseek_v4_matches_python_reference_ids() {
    let reference = read_json(deepseek_v4_dir().join("reference_ids.json"));
    let tok = deepseek_v4();
    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    let mut failures = Vec::new();
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids_of(&c["ids"]);
        let got = tok.encode(text, false).unwrap();
        if got != want {
            failures.push(format!("{text:?}\n  want {want:?}\n  got  {got:?}"));
        }
        // Byte-level BPE round-trips exactly (the reference agrees: decoded == text).
        assert_eq!(c["decoded"].as_str().unwrap(), text);
        assert_eq!(tok.decode(&got, false).unwrap(), text, "round trip of {text:?}");
    }
    assert!(failures.is_empty(), "{} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn deepseek_v4_compressed_map_matches_python_reference() {
    let reference = read_json(deepseek_v4_dir().join("reference_ids.json"));
    let r = &reference["compressed_token_map"];
    let map = compressed_token_map(deepseek_v4()).unwrap();
    assert_eq!(map.len() as u64, r["len"].as_u64().unwrap());
    assert_eq!(map.iter().max().map(|m| *m as u64 + 1), r["distinct"].as_u64());
    let checksum = map.iter().enumerate().fold(0u64, |acc, (i, &c)| {
        acc.wrapping_add((i as u64 + 1).wrapping_mul(c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    });
    assert_eq!(checksum, r["checksum"].as_u64().unwrap(), "whole-map checksum (see the script)");
    for pair in r["samples"].as_array().unwrap() {
        let (id, c) = (pair[0].as_u64().unwrap() as usize, pair[1].as_u64().unwrap() as u32);
        assert_eq!(map[id], c, "map[{id}]");
    }
}

#[test]
fn gzip_and_plain_loads_agree() {
    let gz = std::fs::read(deepseek_v4_dir().join("tokenizer.json.gz")).unwrap();
    let mut plain = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut plain).unwrap();
    let a = Tokenizer::from_bytes(&plain).unwrap();
    let text = "fn main() { println!(\"héllo, 世界\"); }";
    assert_eq!(a.encode(text, true).unwrap(), deepseek_v4().encode(text, true).unwrap());
}

#[test]
fn load_errors_are_clear() {
    let err = Tokenizer::from_file("/nonexistent/tokenizer.json").unwrap_err().to_string();
    assert!(err.contains("/nonexistent/tokenizer.json"), "{err}");

    let err = Tokenizer::from_bytes(b"{\"not\": \"a tokenizer\"}").unwrap_err().to_string();
    assert!(err.contains("not a valid tokenizer.json"), "{err}");

    let gz = std::fs::read(deepseek_v4_dir().join("tokenizer.json.gz")).unwrap();
    let err = Tokenizer::from_bytes(&gz[..gz.len() / 2]).unwrap_err().to_string();
    assert!(err.contains("gzip"), "{err}");

    // A valid tokenizer without DeepSeek's BOS.
    let json = std::fs::read_to_string(repo_root().join("models/v41-shakespeare-tiny/tokenizer.json")).unwrap();
    let renamed = json.replace("<｜begin▁of▁sentence｜>", "<s>");
    let err = Tokenizer::from_bytes(renamed.as_bytes()).unwrap_err().to_string();
    assert!(err.contains("<｜begin▁of▁sentence｜>") && err.contains("BOS"), "{err}");

    // Converts into a candle error.
    let candle: candle_core::Error = Tokenizer::from_bytes(b"[]").unwrap_err().into();
    assert!(candle.to_string().contains("tokenizer"));
}
