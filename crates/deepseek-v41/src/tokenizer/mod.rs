//! The tokenizer (spec §11): a thin wrapper over the `tokenizers` crate's `tokenizer.json`
//! loader, the chat / thinking prompt formats, a streaming decoder and the Engram compressed
//! token map (spec §9.1).
//!
//! DeepSeek's tokenizers (V4's and the embedded Shakespeare model's) have no post-processor that
//! adds BOS, so [`Tokenizer::encode`] prepends it itself when asked.

mod chat;
mod compressed;
mod error;
mod stream;

pub use chat::{ChatPrompt, ReasoningEffort};
pub use compressed::{compressed_token_map, engram_token_map};
pub use error::{Result, TokenizerError};
pub use stream::StreamDecoder;

use std::io::Read;
use std::path::Path;

/// BOS spelling of DeepSeek tokenizers (id 0).
pub const BOS_TOKEN: &str = "<｜begin▁of▁sentence｜>";
/// EOS spelling of DeepSeek tokenizers (id 1).
pub const EOS_TOKEN: &str = "<｜end▁of▁sentence｜>";
/// Pad spelling of DeepSeek tokenizers (id 2).
pub const PAD_TOKEN: &str = "<｜▁pad▁｜>";
/// Start of a user turn.
pub const USER_TOKEN: &str = "<｜User｜>";
/// Start of an assistant turn.
pub const ASSISTANT_TOKEN: &str = "<｜Assistant｜>";
/// Start of a system message (new in V4.1).
pub const SYSTEM_TOKEN: &str = "<｜System｜>";
/// Opens the reasoning of a thinking-mode answer.
pub const THINK_START_TOKEN: &str = "<think>";
/// Closes the reasoning (and opens the answer directly in chat mode).
pub const THINK_END_TOKEN: &str = "</think>";

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// A `tokenizer.json` tokenizer with DeepSeek's special tokens resolved.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: u32,
    eos: u32,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json`, plain or gzip-compressed (detected from the content, so a
    /// `tokenizer.json.gz` works too).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
        Self::from_bytes_named(&bytes, &path.display().to_string())
    }

    /// Parses the bytes of a `tokenizer.json`, plain or gzip-compressed.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        Self::from_bytes_named(bytes, "bytes")
    }

    fn from_bytes_named(bytes: &[u8], what: &str) -> Result<Self> {
        let json: std::borrow::Cow<[u8]> = if bytes.starts_with(&GZIP_MAGIC) {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(bytes)
                .read_to_end(&mut out)
                .map_err(|source| TokenizerError::Gzip { what: what.to_string(), source })?;
            out.into()
        } else {
            bytes.into()
        };
        let inner = tokenizers::Tokenizer::from_bytes(&json)
            .map_err(|e| TokenizerError::Parse { what: what.to_string(), message: e.to_string() })?;
        Self::from_inner(inner)
    }

    /// Wraps an already-built `tokenizers` tokenizer; fails if it lacks DeepSeek's BOS or EOS.
    pub fn from_inner(inner: tokenizers::Tokenizer) -> Result<Self> {
        let find = |token: &str, purpose| {
            inner.token_to_id(token).ok_or_else(|| TokenizerError::MissingToken {
                kind: "token",
                token: token.to_string(),
                purpose,
            })
        };
        let bos = find(BOS_TOKEN, "BOS")?;
        let eos = find(EOS_TOKEN, "EOS")?;
        Ok(Self { inner, bos, eos })
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Id of BOS (0 for DeepSeek tokenizers).
    pub fn bos_id(&self) -> u32 {
        self.bos
    }

    /// Id of EOS (1 for DeepSeek tokenizers); generation stops on it.
    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// Number of ids, added tokens included (what `len(tokenizer)` reports in Python).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Id of the added token spelled `token` (an entry of `added_tokens` in `tokenizer.json`);
    /// the error names the token and `purpose`.
    pub fn added_token_id(&self, token: &str, purpose: &'static str) -> Result<u32> {
        self.inner.get_added_vocabulary().get_vocab().get(token).copied().ok_or_else(|| TokenizerError::MissingToken {
            kind: "added token",
            token: token.to_string(),
            purpose,
        })
    }

    /// The token string of `id` (the raw vocabulary entry, e.g. byte-level `Ġthe`), if any.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Token ids of `text`; added tokens written in the text (e.g. `<｜User｜>`) become their
    /// ids. With `add_bos`, BOS is prepended (the tokenizer itself never adds it).
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| error::backend("encode", e))?;
        let mut ids = Vec::with_capacity(enc.len() + usize::from(add_bos));
        if add_bos {
            ids.push(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids`; with `skip_special_tokens`, tokens flagged special (BOS, EOS, pad, ...)
    /// are left out. Invalid UTF-8 (a character split across the end of `ids`) shows as U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| error::backend("decode", e))
    }

    /// A decoder that turns ids into text as they are generated.
    pub fn stream(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special_tokens)
    }
}

#[cfg(test)]
pub(crate) mod test_tokenizers;

#[cfg(test)]
mod tests;
