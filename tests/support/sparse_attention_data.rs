//! Test data of the sparse attention GPU tests (`tests/cuda_sparse_attention.rs`): random bf16
//! tensors and index lists with padding, duplicates and holes.

use anyhow::Result;
use candle_core::{Device, Tensor};
use half::bf16;

use crate::rng::Rng;

pub(crate) fn random_bf16(rng: &mut Rng, shape: &[usize], amp: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<bf16> = (0..n).map(|_| bf16::from_f32(amp * rng.normal())).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// `[T, K]` index rows: token t has `lens[t]` valid entries (random rows of `0..n`, some
/// duplicated) followed by −1 padding, with `holes` of its valid slots replaced by −1.
pub(crate) fn index_rows(rng: &mut Rng, lens: &[usize], k: usize, n: usize, holes: usize) -> Vec<i64> {
    let mut v = vec![-1i64; lens.len() * k];
    for (t, &len) in lens.iter().enumerate() {
        for j in 0..len {
            v[t * k + j] = if j > 0 && rng.below(16) == 0 { v[t * k + j - 1] } else { rng.below(n) as i64 };
        }
        for _ in 0..holes.min(len) {
            v[t * k + rng.below(len)] = -1;
        }
    }
    v
}
