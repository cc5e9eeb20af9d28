//! GPU tests of the grouped MXFP4 expert kernels (`kernels/moe_experts.cu`,
//! `cuda::moe_experts_device`) against the CPU reference of the MoE's expert loop (spec §8):
//! * gate/up: each slot's SwiGLU activation (times its routing weight) against the CPU path —
//!   `quant::mxfp4_linear_ref` (FP8 activation quantization, f32 products over the host-dequantized
//!   weight, bf16 output) for `w1` and `w3`, then the SwiGLU ops of `model::Expert` on the CPU.
//!   Only the f32 summation order differs: most elements are bit-equal, the rest within 2 bf16 ulp;
//! * down: each slot's expert output against `mxfp4_linear_ref` of the device's activations;
//! * combine: bit for bit the CPU's f32 sum in expert-id order plus the shared expert's output;
//! * end to end against the all-CPU pipeline (relative Frobenius error);
//! * routings: near-uniform, skewed (all tokens on the same k experts, most experts empty),
//!   T = 1 / 8 / 9 / 63 / 64 / 65 / 257 / 4097 (chunks of 8 slots), small and large expert counts,
//!   K / 32 not a multiple of 4 (the byte scale path, with a partial last group of 4 blocks), K / 128
//!   odd (one load group in flight) and even (two), CTA runs over several chunks and experts with
//!   rounds of 16 units spanning two chunks, outputs over NaN-poisoned memory;
//! * the errors.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_moe_experts`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::cuda::{moe_experts_device, moe_experts_device_with, moe_route_device, GroupedExperts, MoeExpertsKernel};
use deepseek_v41::quant::{mxfp4_linear_ref, Mxfp4Weight};

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_moe_experts.rs needs a CUDA device (none found): these tests must run on a GPU")
}

/// A random MXFP4 weight `[n, k]` on the CPU: codes over every byte, scale bytes 118..=128
/// (2^-9 .. 2^1), a tenth of them 0..=3 (the subnormal 2^-127 and tiny scales) when `tiny`.
fn weight(rng: &mut Rng, n: usize, k: usize, tiny: bool) -> Result<Mxfp4Weight> {
    let codes: Vec<u8> = (0..n * k / 2).map(|_| rng.below(256) as u8).collect();
    let scales: Vec<u8> =
        (0..n * k / 32).map(|_| if tiny && rng.below(10) == 0 { rng.below(4) as u8 } else { 118 + rng.below(11) as u8 }).collect();
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
    tiny_scales: bool,
}

fn run_case(c: &Case, seed: u64) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(seed);
    let name = format!("E {} k {} D {} inter {} T {} skew {}", c.e, c.k, c.d, c.inter, c.t, c.skew);
    let limit = Some(10.0f64);
    // Experts and the shared expert's output.
    let host: Vec<[Mxfp4Weight; 3]> = (0..c.e)
        .map(|_| -> Result<[Mxfp4Weight; 3]> {
            Ok([
                weight(&mut rng, c.inter, c.d, c.tiny_scales)?,
                weight(&mut rng, c.inter, c.d, c.tiny_scales)?,
                weight(&mut rng, c.d, c.inter, c.tiny_scales)?,
            ])
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
    let routing = moe_route_device(
        &Tensor::from_vec(logits, (c.t, c.e), &dev)?,
        &Tensor::from_vec(bias, c.e, &dev)?,
        c.k,
        1.0,
        1.5,
    )?;
    poison(&dev, c.t * c.k * (c.d + c.inter) + c.t * c.d)?;
    // The streaming kernels at every size (Auto takes the GEMM above 8 slots per expert:
    // tests/cuda_moe_experts_gemm.rs).
    let got = moe_experts_device_with(&x, &routing, &grouped, limit.map(|l| l as f32), Some(&shared), MoeExpertsKernel::Stream)?;
    let (act, y, out) = (host_f32(&got.act)?, host_f32(&got.y)?, host_f32(&got.out)?);

    let ids = routing.ids.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u32>()?;
    let weights = routing.weights.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    let order = routing.order.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
    let offsets = routing.offsets.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
    let act_dev_cpu = got.act.to_device(&Device::Cpu)?;
    let y_dev_cpu = got.y.to_device(&Device::Cpu)?;
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
    let y_dev = host_f32(&y_dev_cpu)?;
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
    let out_ref = combine(&y_dev);
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

#[test]
fn small_models_shapes() -> Result<()> {
    // K / 32 = 2 and 3 (w2 of the tiny and Shakespeare models): the byte-copy scale path.
    for (i, &(e, k, d, inter, t, skew)) in
        [(8, 2, 256, 64, 1, false), (8, 2, 256, 64, 5, false), (8, 2, 192, 96, 63, false), (8, 2, 192, 96, 64, true), (8, 2, 192, 96, 65, false)]
            .iter()
            .enumerate()
    {
        run_case(&Case { e, k, d, inter, t, skew, tiny_scales: i == 0 }, 0x3e_0001 + i as u64)?;
    }
    Ok(())
}

#[test]
fn token_tiles_and_loads() -> Result<()> {
    // Chunks of 8 slots: experts with 1..7, exactly 8, 9 and many slots (all tokens on k experts).
    for (i, &(t, skew)) in [(64, false), (65, false), (8, true), (9, true), (257, true), (257, false)].iter().enumerate() {
        run_case(&Case { e: 32, k: 6, d: 512, inter: 128, t, skew, tiny_scales: true }, 0x3e_0100 + i as u64)?;
    }
    Ok(())
}

#[test]
fn many_experts_few_tokens_and_a_long_prefill() -> Result<()> {
    run_case(&Case { e: 384, k: 6, d: 1024, inter: 256, t: 1, skew: false, tiny_scales: false }, 0x3e_0200)?;
    run_case(&Case { e: 384, k: 6, d: 1024, inter: 256, t: 4, skew: false, tiny_scales: false }, 0x3e_0201)?;
    run_case(&Case { e: 16, k: 2, d: 256, inter: 64, t: 4097, skew: false, tiny_scales: false }, 0x3e_0202)?;
    Ok(())
}

#[test]
fn load_pipelines_and_rounds() -> Result<()> {
    // 64 row groups per projection: each CTA runs ~40 units over several chunks and experts, and
    // rounds of 16 units span a chunk boundary; K / 128 = 8 and 4 (two load groups in flight).
    run_case(&Case { e: 64, k: 6, d: 1024, inter: 512, t: 33, skew: false, tiny_scales: true }, 0x3e_0400)?;
    // K / 128 = 3 and 5: one load group in flight, 4-byte scale words.
    run_case(&Case { e: 16, k: 4, d: 384, inter: 640, t: 20, skew: false, tiny_scales: false }, 0x3e_0401)?;
    // K / 32 = 7 and 5: two groups per unit, the last partial (byte scale path); 20 / 14 row groups.
    run_case(&Case { e: 8, k: 2, d: 224, inter: 160, t: 17, skew: true, tiny_scales: true }, 0x3e_0402)?;
    Ok(())
}

#[test]
fn errors() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x3e_0300);
    let w = |n, k, rng: &mut Rng| -> Result<Mxfp4Weight> { to_dev(&weight(rng, n, k, false)?, &dev) };
    ensure!(GroupedExperts::new(vec![]).is_err());
    let wide = GroupedExperts::new(vec![[w(64, 5152, &mut rng)?, w(64, 5152, &mut rng)?, w(5152, 64, &mut rng)?]]);
    ensure!(wide.as_ref().is_err_and(|e| e.to_string().contains("5120")), "{:?}", wide.err());
    let bad = GroupedExperts::new(vec![[w(64, 256, &mut rng)?, w(64, 256, &mut rng)?, w(256, 64, &mut rng)?], [w(64, 256, &mut rng)?, w(32, 256, &mut rng)?, w(256, 64, &mut rng)?]]);
    ensure!(bad.as_ref().is_err_and(|e| e.to_string().contains("expert 1 w3")), "{:?}", bad.err());
    let g = GroupedExperts::new(vec![[w(64, 256, &mut rng)?, w(64, 256, &mut rng)?, w(256, 64, &mut rng)?]; 4])?;
    let routing = moe_route_device(&Tensor::ones((3, 4), DType::F32, &dev)?, &Tensor::zeros(4, DType::F32, &dev)?, 2, 1.0, 1.0)?;
    let x = Tensor::ones((3, 256), DType::BF16, &dev)?;
    ensure!(moe_experts_device(&x, &routing, &g, None, None).is_ok());
    ensure!(moe_experts_device(&Tensor::ones((3, 128), DType::BF16, &dev)?, &routing, &g, None, None).is_err());
    ensure!(moe_experts_device(&x.to_dtype(DType::F32)?, &routing, &g, None, None).is_err());
    ensure!(moe_experts_device(&Tensor::ones((2, 256), DType::BF16, &dev)?, &routing, &g, None, None).is_err());
    ensure!(moe_experts_device(&x, &routing, &g, None, Some(&Tensor::ones((3, 255), DType::BF16, &dev)?)).is_err());
    ensure!(moe_experts_device(&x, &routing, &g, Some(f32::NAN), None).is_err());
    let five = moe_route_device(&Tensor::ones((3, 5), DType::F32, &dev)?, &Tensor::zeros(5, DType::F32, &dev)?, 2, 1.0, 1.0)?;
    ensure!(moe_experts_device(&x, &five, &g, None, None).is_err());
    Ok(())
}
