//! The vendored tokenizers, loaded once per test process.

use std::path::PathBuf;
use std::sync::OnceLock;

use super::Tokenizer;

/// Root of the repository.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `tests/fixtures/deepseek-v4-tokenizer/` (the official V4 tokenizer, gzip-compressed).
pub fn deepseek_v4_dir() -> PathBuf {
    repo_root().join("tests/fixtures/deepseek-v4-tokenizer")
}

/// The official DeepSeek-V4 tokenizer (129,280 ids).
pub fn deepseek_v4() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_file(deepseek_v4_dir().join("tokenizer.json.gz")).expect("V4 tokenizer loads"))
}

/// The embedded Shakespeare model's byte-level BPE (4,096 ids).
pub fn shakespeare() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        Tokenizer::from_file(repo_root().join("models/v41-shakespeare-tiny/tokenizer.json"))
            .expect("Shakespeare tokenizer loads")
    })
}
