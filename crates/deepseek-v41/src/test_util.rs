//! Helpers for unit tests: the vendored fixtures.

use std::path::PathBuf;

use crate::config::Config;

/// `tests/fixtures` of the repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The golden set's tiny config (spec §15.1).
pub fn tiny_config() -> Config {
    Config::from_file(fixtures().join("v41-tiny/config.json")).expect("tiny config parses")
}
