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
//!   K / 32 a multiple of 8 (ring stages of 8 blocks), of 4 only (stages of 4) and of neither (a
//!   partial last stage, the scale bytes stored by the issuing lanes), units shorter than the ring
//!   (the loads run several units ahead), the V4.1-Flash widths (K = 5120 and 2304), CTA runs
//!   over several chunks and experts with rounds of 16 units spanning two chunks, outputs over
//!   NaN-poisoned memory;
//! * the errors.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_moe_experts`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::cuda::{moe_experts_device, moe_route_device, GroupedExperts, MoeExpertsKernel};
use deepseek_v41::quant::Mxfp4Weight;

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
use moe_check::{to_dev, MoeCase};

/// `c` on the streaming kernels at every size (`Auto` takes the GEMM above 8 slots per expert:
/// tests/cuda_moe_experts_gemm.rs), with random experts ([`weight`], tiny scale bytes with
/// `tiny_scales`), checked by [`moe_check::run_case`].
fn run_case(c: MoeCase, tiny_scales: bool, seed: u64) -> Result<()> {
    let label = if tiny_scales { "tiny scales" } else { "" };
    moe_check::run_case(&gpu(), &c.on(MoeExpertsKernel::Stream), label, seed, |rng, _, n, k| weight(rng, n, k, tiny_scales))
}

#[test]
fn small_models_shapes() -> Result<()> {
    // K / 32 = 2 and 3 (w2 of the tiny and Shakespeare models): the byte-copy scale path.
    for (i, &(e, k, d, inter, t, skew)) in
        [(8, 2, 256, 64, 1, false), (8, 2, 256, 64, 5, false), (8, 2, 192, 96, 63, false), (8, 2, 192, 96, 64, true), (8, 2, 192, 96, 65, false)]
            .iter()
            .enumerate()
    {
        run_case(MoeCase::new(e, k, d, inter, t).skewed(skew), i == 0, 0x3e_0001 + i as u64)?;
    }
    Ok(())
}

#[test]
fn token_tiles_and_loads() -> Result<()> {
    // Chunks of 8 slots: experts with 1..7, exactly 8, 9 and many slots (all tokens on k experts).
    for (i, &(t, skew)) in [(64, false), (65, false), (8, true), (9, true), (257, true), (257, false)].iter().enumerate() {
        run_case(MoeCase::new(32, 6, 512, 128, t).skewed(skew), true, 0x3e_0100 + i as u64)?;
    }
    Ok(())
}

#[test]
fn many_experts_few_tokens_and_a_long_prefill() -> Result<()> {
    run_case(MoeCase::new(384, 6, 1024, 256, 1), false, 0x3e_0200)?;
    run_case(MoeCase::new(384, 6, 1024, 256, 4), false, 0x3e_0201)?;
    run_case(MoeCase::new(16, 2, 256, 64, 4097), false, 0x3e_0202)?;
    Ok(())
}

#[test]
fn load_pipelines_and_rounds() -> Result<()> {
    // 64 row groups per projection: each CTA runs ~40 units over several chunks and experts, and
    // rounds of 16 units span a chunk boundary; K / 32 = 32 and 16 (stages of 8 blocks).
    run_case(MoeCase::new(64, 6, 1024, 512, 33), true, 0x3e_0400)?;
    // K / 32 = 12 and 20: stages of 4 blocks, 3 and 5 per unit (a ring of 6 spans units).
    run_case(MoeCase::new(16, 4, 384, 640, 20), false, 0x3e_0401)?;
    // K / 32 = 7 and 5: two stages per unit, the last partial; 20 / 14 row groups.
    run_case(MoeCase::new(8, 2, 224, 160, 17).skewed(true), true, 0x3e_0402)?;
    // The V4.1-Flash widths: K / 32 = 160 (20 stages of 8 per unit) and 72 (9, a ring of 3).
    run_case(MoeCase::new(12, 6, 5120, 2304, 9), false, 0x3e_0403)?;
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
