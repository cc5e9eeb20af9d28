//! GPU tests of the tensor-core path of the grouped MXFP4 experts (`kernels/moe_experts_gemm.cu`:
//! `cuda::moe_experts_device_with` with `MoeExpertsKernel::Gemm`, and `Auto` above 8 slots per
//! expert) against the CPU reference of the MoE's expert loop (spec §8), with the checks and
//! tolerances of tests/cuda_moe_experts.rs:
//! * gate/up: each slot's SwiGLU activation (times its routing weight) against
//!   `quant::mxfp4_linear_ref` for `w1` and `w3` and the SwiGLU ops of `model::Expert` on the CPU;
//!   only the f32 summation order differs: bit-equal or within 2 bf16 ulp (or a cancellation),
//!   at most 5 % inexact;
//! * down: each slot's expert output against `mxfp4_linear_ref` of the device's activations;
//! * combine: bit for bit the CPU's f32 sum in expert-id order plus the shared expert's output;
//! * end to end against the all-CPU pipeline (relative Frobenius error);
//! * slot tiles of 128 (experts with 1..16, 17..128, 129 and many slots, skewed routings with most
//!   experts empty), N and K not multiples of the 128 x 128 tile (and K / 32 not a multiple of 4:
//!   the byte-copy scale path), outputs over NaN-poisoned memory;
//! * scale bytes outside the fast path's 33..=128 (tiny and large weights) on some experts only,
//!   so that the bf16 path and the exact f32 path run in one launch; out-of-range bytes over
//!   all-zero blocks on the others (they stay on the fast path and add 0); the NaN byte 255
//!   against the streaming kernels (same NaN positions);
//! * both kernels on the same routing at small and large T; the errors.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_moe_experts_gemm`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::cuda::{moe_experts_device_with, moe_route_device, GroupedExperts, MoeExpertsKernel, MoeExpertsOutput};
use deepseek_v41::quant::Mxfp4Weight;

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_moe_experts_gemm.rs needs a CUDA device (none found): these tests must run on a GPU")
}

/// Scale bytes of the random experts.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Scales {
    /// 118..=128 (2^-9 .. 2^1): every expert on the bf16 path.
    Normal,
    /// A tenth of the blocks of odd experts at bytes 0..=3 (the subnormal 2^-127 and tiny scales)
    /// or 129..=136 (weights up to 6 · 2^9): those experts run the exact path. A twentieth of the
    /// blocks of even experts all-zero (codes ±0) under bytes 0, 200 or 254: still the bf16 path.
    OddExperts,
}

/// A random MXFP4 weight `[n, k]` on the CPU: codes over every byte, scale bytes 118..=128, and
/// with `odd` the blocks of [`Scales::OddExperts`] for an odd (`Some(true)`) or even expert.
fn weight(rng: &mut Rng, n: usize, k: usize, odd: Option<bool>) -> Result<Mxfp4Weight> {
    let mut codes: Vec<u8> = (0..n * k / 2).map(|_| rng.below(256) as u8).collect();
    let mut scales: Vec<u8> = (0..n * k / 32).map(|_| 118 + rng.below(11) as u8).collect();
    match odd {
        Some(true) => {
            for s in scales.iter_mut() {
                if rng.below(10) == 0 {
                    *s = if rng.below(2) == 0 { rng.below(4) as u8 } else { 129 + rng.below(8) as u8 };
                }
            }
        }
        Some(false) => {
            for (b, s) in scales.iter_mut().enumerate() {
                if rng.below(20) == 0 {
                    *s = [0u8, 200, 254][rng.below(3)];
                    for c in &mut codes[b * 16..b * 16 + 16] {
                        *c = [0x00u8, 0x08, 0x80, 0x88][rng.below(4)];
                    }
                }
            }
        }
        None => {}
    }
    Ok(Mxfp4Weight::from_bytes(codes, scales, n, k, &Device::Cpu)?)
}

#[path = "support/moe_check.rs"]
mod moe_check;
use moe_check::{host_f32, to_dev, MoeCase};

/// `c` with random experts of `scales` ([`weight`]), checked by [`moe_check::run_case`].
fn run_case(c: MoeCase, scales: Scales, seed: u64) -> Result<()> {
    let odd = |e: usize| (scales == Scales::OddExperts).then_some(e % 2 == 1);
    moe_check::run_case(&gpu(), &c, &format!("{scales:?}"), seed, |rng, e, n, k| weight(rng, n, k, odd(e)))
}

#[test]
fn auto_picks_the_gemm_above_8_slots_per_expert() -> Result<()> {
    use MoeExpertsKernel::*;
    ensure!(!Auto.uses_gemm(64, 1, 8) && Auto.uses_gemm(65, 1, 8) && Auto.uses_gemm(65, 2, 8));
    ensure!(!Auto.uses_gemm(512, 6, 384) && Auto.uses_gemm(513, 6, 384) && Auto.uses_gemm(4096, 6, 384));
    ensure!(Gemm.uses_gemm(1, 1, 384) && !Stream.uses_gemm(4096, 6, 384));
    Ok(())
}

#[test]
fn slot_tiles_and_loads() -> Result<()> {
    // Auto at T = 65, E = 8, k = 2 (16 slots per expert) and above; skewed: experts 0..k with T
    // slots each (tiles 128 + 1, 128 + 128 + 1), the rest empty.
    for (i, &(t, skew)) in [(65, false), (257, false), (129, true), (257, true)].iter().enumerate() {
        run_case(MoeCase::new(8, 2, 512, 256, t).skewed(skew), Scales::Normal, 0x3f_0001 + i as u64)?;
    }
    // 48 slots per expert over 32 experts, top-6.
    run_case(MoeCase::new(32, 6, 512, 128, 257), Scales::Normal, 0x3f_0010)?;
    Ok(())
}

#[test]
fn partial_tiles_and_byte_scales() -> Result<()> {
    use MoeExpertsKernel::Gemm;
    // N and K not multiples of 128 (w1 / w3 [96, 192], w2 [192, 96]: K / 32 = 6 and 3, the
    // byte-copy scale path), and K / 32 = 10 / 5.
    run_case(MoeCase::new(8, 2, 192, 96, 65), Scales::Normal, 0x3f_0101)?;
    run_case(MoeCase::new(8, 2, 192, 96, 300).skewed(true).on(Gemm), Scales::Normal, 0x3f_0102)?;
    run_case(MoeCase::new(16, 4, 320, 160, 200).on(Gemm), Scales::Normal, 0x3f_0103)?;
    // Multiples of 128 with several slot and row tiles (w1 / w3 [384, 1024]).
    run_case(MoeCase::new(8, 2, 1024, 384, 700), Scales::Normal, 0x3f_0104)?;
    Ok(())
}

#[test]
fn extreme_scales_take_the_exact_path() -> Result<()> {
    use MoeExpertsKernel::Gemm;
    run_case(MoeCase::new(8, 2, 256, 128, 200).on(Gemm), Scales::OddExperts, 0x3f_0201)?;
    run_case(MoeCase::new(8, 2, 192, 96, 100).on(Gemm), Scales::OddExperts, 0x3f_0202)?;
    run_case(MoeCase::new(16, 4, 512, 256, 257).skewed(true), Scales::OddExperts, 0x3f_0203)?;
    Ok(())
}

#[test]
fn both_kernels_on_small_and_large_batches() -> Result<()> {
    use MoeExpertsKernel::{Gemm, Stream};
    for (i, &t) in [1usize, 5, 9, 64].iter().enumerate() {
        run_case(MoeCase::new(32, 6, 512, 128, t).on(Gemm), Scales::Normal, 0x3f_0301 + i as u64)?;
    }
    run_case(MoeCase::new(8, 2, 256, 128, 257).on(Stream), Scales::Normal, 0x3f_0310)?;
    run_case(MoeCase::new(8, 2, 256, 128, 257).on(Gemm), Scales::Normal, 0x3f_0310)?;
    Ok(())
}

#[test]
fn a_long_prefill() -> Result<()> {
    run_case(MoeCase::new(16, 2, 256, 64, 4097), Scales::Normal, 0x3f_0401)?;
    run_case(MoeCase::new(64, 6, 512, 128, 4097), Scales::OddExperts, 0x3f_0402)?;
    Ok(())
}

/// NaN positions of the outputs (a NaN element of `t`).
fn nan_mask(t: &Tensor) -> Result<Vec<bool>> {
    Ok(host_f32(t)?.into_iter().map(f32::is_nan).collect())
}

#[test]
fn nan_scale_bytes_match_the_streaming_kernels() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x3f_0501);
    let (e, k, d, inter, t) = (8usize, 2usize, 256usize, 128usize, 150usize);
    let mut experts = Vec::new();
    for i in 0..e {
        let mut w = [weight(&mut rng, inter, d, None)?, weight(&mut rng, inter, d, None)?, weight(&mut rng, d, inter, None)?];
        // Expert 2: w1 row 5 block 3; expert 5: w2 row 7 block 1 (scale byte 255 = NaN).
        for (which, row, blk) in [(0usize, 5usize, 3usize), (2, 7, 1)] {
            if (i == 2 && which == 0) || (i == 5 && which == 2) {
                let kb = w[which].dims().1 / 32;
                let mut scales = w[which].scales().flatten_all()?.to_vec1::<u8>()?;
                scales[row * kb + blk] = 255;
                let codes = w[which].codes().flatten_all()?.to_vec1::<u8>()?;
                let dims = w[which].dims();
                w[which] = Mxfp4Weight::from_bytes(codes, scales, dims.0, dims.1, &Device::Cpu)?;
            }
        }
        experts.push([to_dev(&w[0], &dev)?, to_dev(&w[1], &dev)?, to_dev(&w[2], &dev)?]);
    }
    let grouped = GroupedExperts::new(experts)?;
    let x = Tensor::from_vec((0..t * d).map(|_| rng.normal()).collect::<Vec<f32>>(), (t, d), &dev)?.to_dtype(DType::BF16)?;
    let routing = moe_route_device(
        &Tensor::from_vec((0..t * e).map(|_| rng.normal()).collect::<Vec<f32>>(), (t, e), &dev)?,
        &Tensor::zeros(e, DType::F32, &dev)?,
        k,
        1.0,
        1.5,
    )?;
    let run = |kernel| -> Result<MoeExpertsOutput> { Ok(moe_experts_device_with(&x, &routing, &grouped, Some(10.0), None, kernel)?) };
    let (s, g) = (run(MoeExpertsKernel::Stream)?, run(MoeExpertsKernel::Gemm)?);
    for (what, a, b) in [("act", &s.act, &g.act), ("y", &s.y, &g.y), ("out", &s.out, &g.out)] {
        let (ma, mb) = (nan_mask(a)?, nan_mask(b)?);
        let n = ma.iter().filter(|&&v| v).count();
        // The SwiGLU's clamp at the limit maps a NaN gate to the limit (min, as the CPU's
        // `minimum`), so expert 2's NaN w1 block need not reach act; expert 5's NaN w2 block
        // must reach y and out.
        ensure!(n > 0 || what == "act", "{what}: the NaN scale bytes gave no NaN");
        ensure!(ma == mb, "{what}: NaN positions differ between the kernels ({n} vs {})", mb.iter().filter(|&&v| v).count());
    }
    Ok(())
}

#[test]
fn errors() -> Result<()> {
    use MoeExpertsKernel::Gemm;
    let dev = gpu();
    let mut rng = Rng(0x3f_0601);
    let w = |n, k, rng: &mut Rng| -> Result<Mxfp4Weight> { to_dev(&weight(rng, n, k, None)?, &dev) };
    let g = GroupedExperts::new(vec![[w(64, 256, &mut rng)?, w(64, 256, &mut rng)?, w(256, 64, &mut rng)?]; 4])?;
    let routing = moe_route_device(&Tensor::ones((3, 4), DType::F32, &dev)?, &Tensor::zeros(4, DType::F32, &dev)?, 2, 1.0, 1.0)?;
    let x = Tensor::ones((3, 256), DType::BF16, &dev)?;
    ensure!(moe_experts_device_with(&x, &routing, &g, None, None, Gemm).is_ok());
    ensure!(moe_experts_device_with(&Tensor::ones((3, 128), DType::BF16, &dev)?, &routing, &g, None, None, Gemm).is_err());
    ensure!(moe_experts_device_with(&x.to_dtype(DType::F32)?, &routing, &g, None, None, Gemm).is_err());
    ensure!(moe_experts_device_with(&x, &routing, &g, Some(f32::NAN), None, Gemm).is_err());
    // Empty tensors from `zeros`: candle's CUDA `ones` launches its fill kernel with an empty
    // grid for zero elements, which the driver refuses.
    let empty = moe_route_device(&Tensor::zeros((0, 4), DType::F32, &dev)?, &Tensor::zeros(4, DType::F32, &dev)?, 2, 1.0, 1.0)?;
    let z = moe_experts_device_with(&Tensor::zeros((0, 256), DType::BF16, &dev)?, &empty, &g, None, None, Gemm)?;
    ensure!(z.out.dims() == [0, 256] && z.act.dims() == [0, 64] && z.y.dims() == [0, 256]);
    Ok(())
}
