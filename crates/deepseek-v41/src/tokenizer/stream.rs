//! Streaming decoding: text as tokens arrive.

use super::{Result, Tokenizer};

/// Turns generated ids into text incrementally.
///
/// A byte-level BPE token may hold only part of a multi-byte UTF-8 character; decoding it alone
/// gives U+FFFD. The decoder keeps the ids since the last emitted text and emits new text only
/// once the decoded tail no longer ends in U+FFFD, so a character split across tokens comes out
/// whole. (A genuinely generated U+FFFD is therefore held back until the next token or
/// [`StreamDecoder::finish`].)
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special_tokens: bool,
    /// Ids not yet fully emitted, preceded by the ids of the last emitted piece (context).
    ids: Vec<u32>,
    /// `ids[..prefix]` is context already emitted before the last piece (dropped lazily).
    prefix: usize,
    /// `ids[prefix..read]` is the last emitted piece; `ids[read..]` is pending.
    read: usize,
}

impl<'a> StreamDecoder<'a> {
    pub(super) fn new(tok: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        Self { tok, skip_special_tokens, ids: Vec::new(), prefix: 0, read: 0 }
    }

    /// Adds one id; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let before = self.tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let after = self.tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        if after.len() <= before.len() || after.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let text = after[common_prefix_len(&before, &after)..].to_string();
        // Keep the emitted piece as context for the next step, drop what precedes it.
        self.ids.drain(..self.read);
        self.prefix = 0;
        self.read = self.ids.len();
        Ok(Some(text))
    }

    /// Flushes the pending ids (an incomplete character shows as U+FFFD); returns their text,
    /// if any, and resets the decoder.
    pub fn finish(&mut self) -> Result<Option<String>> {
        let before = self.tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let after = self.tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        self.ids.clear();
        self.prefix = 0;
        self.read = 0;
        let text = &after[common_prefix_len(&before, &after)..];
        Ok((!text.is_empty()).then(|| text.to_string()))
    }
}

/// Byte length of the longest common prefix of `a` and `b` that ends on a char boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices().zip(b.chars()).find(|((_, ca), cb)| ca != cb).map_or_else(|| a.len().min(b.len()), |((i, _), _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_tokenizers::{deepseek_v4, shakespeare};

    fn stream_all(tok: &Tokenizer, ids: &[u32], skip: bool) -> (Vec<String>, String) {
        let mut s = tok.stream(skip);
        let mut pieces = Vec::new();
        for &id in ids {
            if let Some(t) = s.push(id).unwrap() {
                pieces.push(t);
            }
        }
        if let Some(t) = s.finish().unwrap() {
            pieces.push(t);
        }
        let joined = pieces.concat();
        (pieces, joined)
    }

    #[test]
    fn common_prefix_respects_char_boundaries() {
        assert_eq!(common_prefix_len("abc", "abd"), 2);
        assert_eq!(common_prefix_len("ab", "abcd"), 2);
        assert_eq!(common_prefix_len("aé", "aè"), 1);
        assert_eq!(common_prefix_len("", "x"), 0);
    }

    #[test]
    fn multibyte_characters_split_across_tokens_come_out_whole() {
        let tok = deepseek_v4();
        let text = "naïve café — 東京の夜 🦀🚀 done";
        let ids = tok.encode(text, false).unwrap();
        // Negative control: decoding token by token breaks some characters.
        let naive: String = ids.iter().map(|&i| tok.decode(&[i], false).unwrap()).collect();
        assert!(naive.contains('\u{FFFD}'), "the text should have a character split across tokens");
        let (pieces, joined) = stream_all(tok, &ids, false);
        assert_eq!(joined, text);
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert!(pieces.len() > 5, "text should stream in many pieces: {pieces:?}");
    }

    #[test]
    fn streaming_equals_full_decode_and_skips_specials() {
        let tok = shakespeare();
        let mut ids = vec![tok.bos_id()];
        ids.extend(tok.encode("ROMEO:\nBut soft, what light through yonder window breaks?", false).unwrap());
        ids.push(tok.eos_id());
        let (_, kept) = stream_all(tok, &ids, false);
        assert_eq!(kept, tok.decode(&ids, false).unwrap());
        assert!(kept.starts_with(crate::tokenizer::BOS_TOKEN));
        let (_, skipped) = stream_all(tok, &ids, true);
        assert_eq!(skipped, "ROMEO:\nBut soft, what light through yonder window breaks?");
    }

    #[test]
    fn finish_flushes_an_incomplete_character() {
        let tok = deepseek_v4();
        let ids = tok.encode("🦀", false).unwrap();
        assert!(ids.len() > 1, "the crab should take several byte tokens: {ids:?}");
        let mut s = tok.stream(false);
        assert_eq!(s.push(ids[0]).unwrap(), None);
        assert_eq!(s.finish().unwrap().as_deref(), Some("\u{FFFD}"));
        assert_eq!(s.finish().unwrap(), None);
    }
}
