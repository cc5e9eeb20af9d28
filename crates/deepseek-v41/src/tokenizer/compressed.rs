//! The Engram compressed token map (spec §9.1).

use std::collections::HashMap;

use tokenizers::normalizers::{Lowercase, Replace, Sequence, Strip, StripAccents, NFD, NFKC};
use tokenizers::{NormalizedString, Normalizer, NormalizerWrapper};

use super::error::backend;
use super::{Result, Tokenizer};
use crate::model::TokenMap;

/// Private-use character that shields a token that is exactly one space from the final strip.
const SENTINEL: &str = "\u{E000}";

/// The key normalizer: NFKC, NFD, strip accents, lowercase, collapse runs of `[ \t\r\n]` to one
/// space, protect a lone " ", strip, restore " ". Built from the same `tokenizers` normalizers
/// the reference uses, so every step (Unicode tables included) is identical.
fn key_normalizer() -> Result<Sequence> {
    let replace = |pattern: tokenizers::normalizers::replace::ReplacePattern, with: &str| {
        Replace::new(pattern, with).map(NormalizerWrapper::Replace).map_err(|e| backend("normalize", e))
    };
    use tokenizers::normalizers::replace::ReplacePattern::{Regex, String as Literal};
    Ok(Sequence::new(vec![
        NormalizerWrapper::NFKC(NFKC),
        NormalizerWrapper::NFD(NFD),
        NormalizerWrapper::StripAccents(StripAccents),
        NormalizerWrapper::Lowercase(Lowercase),
        replace(Regex("[ \t\r\n]+".into()), " ")?,
        replace(Regex("^ $".into()), SENTINEL)?,
        NormalizerWrapper::StripNormalizer(Strip::new(true, true)),
        replace(Literal(SENTINEL.into()), " ")?,
    ]))
}

/// Maps every token id `0..tok.vocab_size()` to its Engram compressed id (spec §9.1): ids whose
/// text normalizes alike share one compressed id, numbered in order of first appearance.
///
/// Each id is decoded alone (special tokens kept); if the text holds U+FFFD (a partial UTF-8
/// byte token) the key is the raw token string, otherwise the normalized text, or the text
/// itself when normalization leaves nothing. The number of compressed ids is
/// `map.iter().max() + 1`: 99,092 for the DeepSeek-V4 tokenizer, 3,109 for the Shakespeare one.
/// The Engram pad id is `map[engram_pad_token_id]` with the pad id taken from the config.
pub fn compressed_token_map(tok: &Tokenizer) -> Result<Vec<u32>> {
    let normalizer = key_normalizer()?;
    let n = tok.vocab_size();
    let mut keys: HashMap<String, u32> = HashMap::with_capacity(n);
    let mut map = Vec::with_capacity(n);
    for id in 0..n as u32 {
        let text = tok.decode(&[id], false)?;
        let key = if text.contains('\u{FFFD}') {
            tok.id_to_token(id).ok_or_else(|| backend("decode", format!("id {id} decodes but has no token string")))?
        } else {
            let mut s = NormalizedString::from(text.as_str());
            normalizer.normalize(&mut s).map_err(|e| backend("normalize", e))?;
            if s.get().is_empty() {
                text
            } else {
                s.get().to_string()
            }
        };
        let next = keys.len() as u32;
        map.push(*keys.entry(key).or_insert(next));
    }
    Ok(map)
}

/// [`compressed_token_map`] as the model's [`TokenMap`] (what `Model::new` and
/// `EngramHasher::new` take).
pub fn engram_token_map(tok: &Tokenizer) -> candle_core::Result<TokenMap> {
    TokenMap::new(compressed_token_map(tok)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_tokenizers::{deepseek_v4, shakespeare};

    fn key(text: &str) -> String {
        let mut s = NormalizedString::from(text);
        key_normalizer().unwrap().normalize(&mut s).unwrap();
        s.get().to_string()
    }

    fn distinct(map: &[u32]) -> usize {
        map.iter().copied().max().map_or(0, |m| m as usize + 1)
    }

    #[test]
    fn normalizer_steps() {
        assert_eq!(key(" The"), "the");
        assert_eq!(key("  Café\t\n"), "cafe");
        assert_eq!(key("ＡＢＣ"), "abc"); // NFKC folds full-width forms
        assert_eq!(key("ﬁ"), "fi");
        assert_eq!(key("Ñandú"), "nandu");
        assert_eq!(key(" "), " "); // a lone space survives
        assert_eq!(key("\n\n"), " "); // any whitespace run is one space, then kept
        assert_eq!(key("\t"), " ");
        assert_eq!(key("a  b"), "a b");
        assert_eq!(key(" \u{a0}"), " "); // NFKC turns NBSP into a space first
        assert_eq!(key(" \u{85}"), ""); // NEL is not in [ \t\r\n] but is stripped
        assert_eq!(key("ΣΑΣ"), "σασ");
    }

    #[test]
    fn normalizer_matches_python_probes() {
        let path = crate::tokenizer::test_tokenizers::deepseek_v4_dir().join("reference_ids.json");
        let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let probes = reference["normalizer_probes"].as_array().unwrap();
        assert!(!probes.is_empty());
        for p in probes {
            let (input, want) = (p[0].as_str().unwrap(), p[1].as_str().unwrap());
            assert_eq!(key(input), want, "{input:?}");
        }
    }

    #[test]
    fn shakespeare_map_has_3109_ids() {
        let tok = shakespeare();
        let map = compressed_token_map(tok).unwrap();
        assert_eq!(map.len(), 4096);
        assert_eq!(distinct(&map), 3109);
        // First-seen numbering: ids 0, 1, 2 (BOS, EOS, pad) are the first three keys.
        assert_eq!(&map[..3], &[0, 1, 2]);
        // pad_c = map[2] = 2 (README of the model).
        assert_eq!(map[2], 2);
        // Every compressed id is used and first appears in increasing order.
        let mut seen = 0u32;
        for &c in &map {
            assert!(c <= seen, "id {c} appears before {seen}");
            if c == seen {
                seen += 1;
            }
        }
    }

    #[test]
    fn case_and_space_variants_share_an_id() {
        let tok = shakespeare();
        let map = compressed_token_map(tok).unwrap();
        let id = |t: &str| {
            let ids = tok.encode(t, false).unwrap();
            assert_eq!(ids.len(), 1, "{t:?} should be one token: {ids:?}");
            map[ids[0] as usize]
        };
        assert_eq!(id("the"), id(" the"));
        assert_eq!(id("The"), id(" The"));
        assert_eq!(id("the"), id("The"));
        assert_ne!(id("the"), id("and"));
    }

    #[test]
    fn shakespeare_map_fits_the_models_engram_config() {
        let root = crate::tokenizer::test_tokenizers::repo_root().join("models/v41-shakespeare-tiny");
        // The config's `image_token_id` is 4096 = vocab_size on purpose (no real token is an image
        // token, README); the config validator rejects that today, and Engram does not use it.
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(root.join("config.json")).unwrap()).unwrap();
        json.as_object_mut().unwrap().remove("image_token_id");
        let cfg = crate::Config::from_json(&json.to_string()).unwrap();
        let engram = cfg.engram.as_ref().expect("the Shakespeare model has Engram layers");
        let map = engram_token_map(shakespeare()).unwrap();
        assert_eq!(map.vocab_size(), cfg.vocab_size);
        assert_eq!(map.compressed_vocab_size(), engram.compressed_vocab_size);
        let hasher = crate::model::EngramHasher::new(engram, map).unwrap();
        assert_eq!(hasher.pad_compressed(), 2);
    }

    #[test]
    fn deepseek_v4_map_has_99092_ids() {
        let tok = deepseek_v4();
        let map = compressed_token_map(tok).unwrap();
        assert_eq!(map.len(), 129_280);
        assert_eq!(distinct(&map), 99_092);
        assert_eq!(map[2], 2);
    }
}
