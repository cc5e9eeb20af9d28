//! Errors of the tokenizer module.

use std::path::PathBuf;

/// Everything that can go wrong while loading or using a [`super::Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The tokenizer file could not be read.
    #[error("cannot read tokenizer file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The bytes start with the gzip magic but do not decompress.
    #[error("tokenizer {what}: gzip stream is corrupt: {source}")]
    Gzip {
        /// What was being loaded (a path or "bytes").
        what: String,
        /// The decompression error.
        source: std::io::Error,
    },
    /// The `tokenizers` crate rejected the JSON.
    #[error("tokenizer {what}: not a valid tokenizer.json: {message}")]
    Parse {
        /// What was being loaded (a path or "bytes").
        what: String,
        /// The parser's message.
        message: String,
    },
    /// A token the caller needs is not in the tokenizer.
    #[error("tokenizer has no {kind} `{token}` (needed for {purpose})")]
    MissingToken {
        /// "token" or "added token".
        kind: &'static str,
        /// The token's content.
        token: String,
        /// What it is needed for.
        purpose: &'static str,
    },
    /// Encoding or decoding failed inside the `tokenizers` crate.
    #[error("tokenizer {op} failed: {message}")]
    Backend {
        /// "encode", "decode" or "normalize".
        op: &'static str,
        /// The backend's message.
        message: String,
    },
    /// A reasoning effort outside 1..=100 or an unknown effort name.
    #[error("invalid reasoning effort {0:?}: expected an integer in 1..=100 or one of low, high, max")]
    InvalidEffort(String),
}

impl From<TokenizerError> for candle_core::Error {
    fn from(e: TokenizerError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Result of the tokenizer module.
pub type Result<T> = std::result::Result<T, TokenizerError>;

/// Wraps an error of the `tokenizers` crate.
pub(crate) fn backend(op: &'static str, e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Backend { op, message: e.to_string() }
}
