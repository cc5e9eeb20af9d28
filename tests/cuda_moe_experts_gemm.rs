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
use deepseek_v41::quant::{mxfp4_linear_ref, Mxfp4Weight};

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
use moe_check::{compare, host_f32, poison, swiglu_cpu, to_dev};

struct Case {
    e: usize,
    k: usize,
    d: usize,
    inter: usize,
    t: usize,
    skew: bool,
    scales: Scales,
    kernel: MoeExpertsKernel,
}

fn run_case(c: &Case, seed: u64) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(seed);
    let name = format!("{:?} E {} k {} D {} inter {} T {} skew {} {:?}", c.kernel, c.e, c.k, c.d, c.inter, c.t, c.skew, c.scales);
    let limit = Some(10.0f64);
    let host: Vec<[Mxfp4Weight; 3]> = (0..c.e)
        .map(|e| -> Result<[Mxfp4Weight; 3]> {
            let odd = (c.scales == Scales::OddExperts).then_some(e % 2 == 1);
            Ok([weight(&mut rng, c.inter, c.d, odd)?, weight(&mut rng, c.inter, c.d, odd)?, weight(&mut rng, c.d, c.inter, odd)?])
        })
        .collect::<Result<_>>()?;
    let grouped = GroupedExperts::new(host.iter().map(|[a, b, w]| Ok([to_dev(a, &dev)?, to_dev(b, &dev)?, to_dev(w, &dev)?])).collect::<Result<_>>()?)?;
    let x_h: Vec<f32> = (0..c.t * c.d).map(|_| rng.normal()).collect();
    let x_cpu = Tensor::from_vec(x_h, (c.t, c.d), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let shared_cpu = Tensor::from_vec((0..c.t * c.d).map(|_| rng.normal()).collect::<Vec<f32>>(), (c.t, c.d), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let (x, shared) = (x_cpu.to_device(&dev)?, shared_cpu.to_device(&dev)?);
    // Routing on the device: random logits, or every token on experts 0..k (the rest empty).
    let logits: Vec<f32> = (0..c.t * c.e).map(|_| rng.normal()).collect();
    let bias: Vec<f32> = (0..c.e).map(|i| if c.skew && i < c.k { 100.0 } else { 0.0 }).collect();
    let routing = moe_route_device(&Tensor::from_vec(logits, (c.t, c.e), &dev)?, &Tensor::from_vec(bias, c.e, &dev)?, c.k, 1.0, 1.5)?;
    poison(&dev, c.t * c.k * (c.d + c.inter) + c.t * c.d)?;
    let got = moe_experts_device_with(&x, &routing, &grouped, limit.map(|l| l as f32), Some(&shared), c.kernel)?;
    let (act, y, out) = (host_f32(&got.act)?, host_f32(&got.y)?, host_f32(&got.out)?);

    let ids = routing.ids.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u32>()?;
    let weights = routing.weights.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    let order = routing.order.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
    let offsets = routing.offsets.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
    let act_dev_cpu = got.act.to_device(&Device::Cpu)?;
    let mut pos = vec![0usize; c.t * c.k];
    let (mut act_ref, mut y_ref, mut y_full) = (vec![0f32; act.len()], vec![0f32; y.len()], vec![0f32; y.len()]);
    for e in 0..c.e {
        let (p0, p1) = (offsets[e] as usize, offsets[e + 1] as usize);
        if p0 == p1 {
            continue;
        }
        let slots: Vec<usize> = order[p0..p1].iter().map(|&s| s as usize).collect();
        for (i, &s) in slots.iter().enumerate() {
            pos[s] = p0 + i;
        }
        let rows = Tensor::from_vec(slots.iter().map(|&s| (s / c.k) as u32).collect::<Vec<_>>(), slots.len(), &Device::Cpu)?;
        let w = Tensor::from_vec(slots.iter().map(|&s| weights[s]).collect::<Vec<_>>(), (slots.len(), 1), &Device::Cpu)?;
        let xr = x_cpu.index_select(&rows, 0)?;
        let [w1, w3, w2] = &host[e];
        let a = swiglu_cpu(&mxfp4_linear_ref(&xr, w1, true)?, &mxfp4_linear_ref(&xr, w3, true)?, &w, limit)?;
        act_ref[p0 * c.inter..p1 * c.inter].copy_from_slice(&host_f32(&a)?);
        let yd = mxfp4_linear_ref(&act_dev_cpu.narrow(0, p0, p1 - p0)?, w2, true)?;
        y_ref[p0 * c.d..p1 * c.d].copy_from_slice(&host_f32(&yd)?);
        y_full[p0 * c.d..p1 * c.d].copy_from_slice(&host_f32(&mxfp4_linear_ref(&a, w2, true)?)?);
    }
    let (act_diff, act_worst) = compare(&format!("{name}: act"), &act, &act_ref, c.inter, 2.0)?;
    let (y_diff, y_worst) = compare(&format!("{name}: y"), &y, &y_ref, c.d, 2.0)?;
    ensure!(act_diff * 20 <= act.len() && y_diff * 20 <= y.len(), "{name}: too many inexact elements: act {act_diff} / {}, y {y_diff} / {}", act.len(), y.len());
    // The combine: the CPU's f32 sum in expert-id order of the device's y, plus shared; exact.
    let sh = host_f32(&shared_cpu)?;
    let combine = |ys: &[f32]| -> Vec<f32> {
        let mut o = vec![0f32; c.t * c.d];
        for t in 0..c.t {
            let mut sel: Vec<(u32, usize)> = (0..c.k).map(|j| (ids[t * c.k + j], pos[t * c.k + j])).collect();
            sel.sort();
            for col in 0..c.d {
                let mut acc = 0f32;
                for &(_, p) in &sel {
                    acc += ys[p * c.d + col];
                }
                acc += sh[t * c.d + col];
                o[t * c.d + col] = half::bf16::from_f32(acc).to_f32();
            }
        }
        o
    };
    let out_ref = combine(&y);
    let bad = out.iter().zip(&out_ref).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    ensure!(bad == 0, "{name}: combine differs from the CPU sum in {bad} of {} elements", out.len());
    // End to end against the all-CPU pipeline.
    let full = combine(&y_full);
    let (num, den) = out.iter().zip(&full).fold((0f64, 0f64), |(n, d), (&a, &b)| (n + ((a - b) as f64).powi(2), d + (b as f64).powi(2)));
    let rel = (num / den.max(1e-30)).sqrt();
    ensure!(rel <= 1e-2, "{name}: end to end rel_fro {rel:e}");
    println!("{name}: act {act_diff}/{} inexact (worst {act_worst} ulp), y {y_diff}/{} (worst {y_worst}), end to end rel_fro {rel:.2e}", act.len(), y.len());
    Ok(())
}

/// E experts, top-k, hidden D, inter, T tokens: random routing, normal scales, `Auto`.
fn case(e: usize, k: usize, d: usize, inter: usize, t: usize) -> Case {
    Case { e, k, d, inter, t, skew: false, scales: Scales::Normal, kernel: MoeExpertsKernel::Auto }
}

impl Case {
    /// With `skew`, every token on experts 0..k (the rest empty).
    fn skewed(self, skew: bool) -> Self {
        Case { skew, ..self }
    }
    fn scales(self, scales: Scales) -> Self {
        Case { scales, ..self }
    }
    fn on(self, kernel: MoeExpertsKernel) -> Self {
        Case { kernel, ..self }
    }
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
        run_case(&case(8, 2, 512, 256, t).skewed(skew), 0x3f_0001 + i as u64)?;
    }
    // 48 slots per expert over 32 experts, top-6.
    run_case(&case(32, 6, 512, 128, 257), 0x3f_0010)?;
    Ok(())
}

#[test]
fn partial_tiles_and_byte_scales() -> Result<()> {
    use MoeExpertsKernel::Gemm;
    // N and K not multiples of 128 (w1 / w3 [96, 192], w2 [192, 96]: K / 32 = 6 and 3, the
    // byte-copy scale path), and K / 32 = 10 / 5.
    run_case(&case(8, 2, 192, 96, 65), 0x3f_0101)?;
    run_case(&case(8, 2, 192, 96, 300).skewed(true).on(Gemm), 0x3f_0102)?;
    run_case(&case(16, 4, 320, 160, 200).on(Gemm), 0x3f_0103)?;
    // Multiples of 128 with several slot and row tiles (w1 / w3 [384, 1024]).
    run_case(&case(8, 2, 1024, 384, 700), 0x3f_0104)?;
    Ok(())
}

#[test]
fn extreme_scales_take_the_exact_path() -> Result<()> {
    use MoeExpertsKernel::Gemm;
    run_case(&case(8, 2, 256, 128, 200).scales(Scales::OddExperts).on(Gemm), 0x3f_0201)?;
    run_case(&case(8, 2, 192, 96, 100).scales(Scales::OddExperts).on(Gemm), 0x3f_0202)?;
    run_case(&case(16, 4, 512, 256, 257).skewed(true).scales(Scales::OddExperts), 0x3f_0203)?;
    Ok(())
}

#[test]
fn both_kernels_on_small_and_large_batches() -> Result<()> {
    use MoeExpertsKernel::{Gemm, Stream};
    for (i, &t) in [1usize, 5, 9, 64].iter().enumerate() {
        run_case(&case(32, 6, 512, 128, t).on(Gemm), 0x3f_0301 + i as u64)?;
    }
    run_case(&case(8, 2, 256, 128, 257).on(Stream), 0x3f_0310)?;
    run_case(&case(8, 2, 256, 128, 257).on(Gemm), 0x3f_0310)?;
    Ok(())
}

#[test]
fn a_long_prefill() -> Result<()> {
    run_case(&case(16, 2, 256, 64, 4097), 0x3f_0401)?;
    run_case(&case(64, 6, 512, 128, 4097).scales(Scales::OddExperts), 0x3f_0402)?;
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
