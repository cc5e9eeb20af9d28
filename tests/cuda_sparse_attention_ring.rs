//! GPU test of the head-split sparse attention kernel's slot-ring loop
//! (`kernels/sparse_attention_heads.cu`, an opt-in experiment: DSV41_SPARSE_ATTENTION_RING=1)
//! against its default two-stage loop: bitwise the same outputs and lse (docs/perf.md "Round 9").
//! The switch is an environment variable read by the launcher on every call, so this test lives
//! in its own binary (one test: no other thread calls the launcher while it changes the
//! environment). Random data, −1 holes and padding, duplicates.
//!
//! This test needs a CUDA device and FAILS without one.
//! Build: `cargo test --release --features cuda --test cuda_sparse_attention_ring`.

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use deepseek_v41::cuda::{sparse_attention_two_source_with, SparseAttentionKernel, SparseAttentionOptions};
use half::bf16;

const D: usize = 512;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_sparse_attention_ring.rs needs a CUDA device (none found)")
}

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;
#[path = "support/sparse_attention_data.rs"]
mod sparse_attention_data;
use sparse_attention_data::{index_rows, random_bf16};

#[test]
fn head_split_ring_and_two_stage_loops_agree_bitwise() -> Result<()> {
    // The head-split kernel's slot-ring loop (bf16 rows, DSV41_SPARSE_ATTENTION_RING=1, read per
    // call; an experiment) and its two-stage loop (the default) run the same products in the same
    // orders: outputs and lse bitwise equal, over a B = 64 decode batch (lengths 0 / 1 / 129 / 511
    // / 512 extra rows) and a 4096-index batch (fewer slots).
    let dev = gpu();
    let hs = SparseAttentionOptions { num_splits: None, kernel: SparseAttentionKernel::HeadSplit };
    let cases: [(u64, usize, Vec<usize>, Vec<usize>, usize, usize); 2] = [
        (110, 64, vec![128; 64], (0..64).map(|i| [512, 511, 129, 1, 0][i % 5]).collect(), 128, 512),
        (111, 4, vec![2048, 1000, 0], vec![2048, 2048, 5], 2048, 2048),
    ];
    for (seed, h, wl, el, kw, kc) in cases {
        let mut rng = Rng(seed);
        let t = wl.len();
        let (nw, nc) = (257usize, 1031usize);
        let q = random_bf16(&mut rng, &[t, h, D], 1.5)?.to_device(&dev)?;
        let kvw = random_bf16(&mut rng, &[nw, D], 1.0)?.to_device(&dev)?;
        let kvc = random_bf16(&mut rng, &[nc, D], 1.0)?.to_device(&dev)?;
        let iw = Tensor::from_vec(index_rows(&mut rng, &wl, kw, nw, 3), (t, kw), &dev)?;
        let ic = Tensor::from_vec(index_rows(&mut rng, &el, kc, nc, 3), (t, kc), &dev)?;
        let sink_v: Vec<f32> = (0..h).map(|_| 2.0 * rng.normal()).collect();
        let sink = Tensor::new(sink_v.as_slice(), &dev)?;
        let run = || -> Result<(Vec<bf16>, Vec<f32>)> {
            let (o, l) = sparse_attention_two_source_with(&q, &kvw, &iw, &kvc, &ic, &sink, 0.05, hs)?;
            Ok((o.flatten_all()?.to_vec1::<bf16>()?, l.flatten_all()?.to_vec1::<f32>()?))
        };
        let prev = std::env::var_os("DSV41_SPARSE_ATTENTION_RING");
        std::env::set_var("DSV41_SPARSE_ATTENTION_RING", "1");
        let ring = run();
        std::env::set_var("DSV41_SPARSE_ATTENTION_RING", "0");
        let two = run();
        match prev {
            Some(v) => std::env::set_var("DSV41_SPARSE_ATTENTION_RING", v),
            None => std::env::remove_var("DSV41_SPARSE_ATTENTION_RING"),
        }
        let ((o1, l1), (o2, l2)) = (ring?, two?);
        ensure!(o1.iter().all(|x| x.is_finite()), "seed {seed}: non-finite output");
        let diff = o1.iter().zip(&o2).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        ensure!(diff == 0, "seed {seed}: {diff} of {} outputs differ between the ring and two-stage loops", o1.len());
        ensure!(l1.iter().zip(&l2).all(|(a, b)| a.to_bits() == b.to_bits()), "seed {seed}: lse differs");
    }
    Ok(())
}
