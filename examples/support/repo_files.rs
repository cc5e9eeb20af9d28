//! Files of the repository that the examples read by default (the embedded model, test
//! fixtures), found from a binary built elsewhere too, and a model folder's tokenizer file (include it with
//! `#[path = "support/repo_files.rs"] mod repo_files;`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// `rel` (a path from the repository root) under the repository the binary was built from, or,
/// when that checkout is absent (a binary copied to another machine, `docs/cuda.md`), relative to
/// the working directory: run such a binary from the root of a copy of the repository.
pub fn repo_file(rel: &str) -> PathBuf {
    let built = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).join(rel);
    if built.exists() {
        built
    } else {
        PathBuf::from(rel)
    }
}

/// The tokenizer file of the model folder `dir`: `tokenizer.json`, else `tokenizer.json.gz`.
pub fn find_tokenizer(dir: &Path) -> Result<PathBuf> {
    ["tokenizer.json", "tokenizer.json.gz"]
        .iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
        .with_context(|| format!("{} holds no tokenizer.json(.gz)", dir.display()))
}
