//! Files of the repository that the examples read by default (the embedded model, test
//! fixtures), found from a binary built elsewhere too (include it with
//! `#[path = "support/repo_files.rs"] mod repo_files;`).
#![allow(dead_code)]

use std::path::PathBuf;

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
