//! Helpers for unit tests: the vendored fixtures, deterministic random bytes and activations.

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

/// `n` deterministic bytes (xorshift64 from `seed`), each mapped by `f`.
pub fn xorshift_bytes(seed: u64, n: usize, f: impl Fn(u8) -> u8) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            f((s >> 24) as u8)
        })
        .collect()
}

/// `[m, k]` f32 activations from [`xorshift_bytes`], their magnitude varying by 32-block
/// (2^-4 .. 2^4): what the FP8 activation quantization sees.
pub fn x_rows(m: usize, k: usize, seed: u64) -> candle_core::Tensor {
    let v: Vec<f32> = xorshift_bytes(seed, m * k, |b| b).iter().enumerate().map(|(i, &b)| (b as f32 - 127.5) / 64.0 * 2f32.powi((i / 32 % 9) as i32 - 4)).collect();
    candle_core::Tensor::from_vec(v, (m, k), &candle_core::Device::Cpu).unwrap()
}
