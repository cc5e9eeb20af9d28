//! The routed MXFP4 experts of one V4.1-Flash MoE layer on CUDA (issue 22): the grouped kernels
//! (`cuda::moe_experts_device_with`: gate/up with SwiGLU, down, combine) after the device routing
//! (`cuda::moe_route_device`), at the real shapes (384 experts, top-6, hidden 5120, inter 2304,
//! experts as stored: e2m1 codes + e8m0 1×32 scales, 18.8 MB each) for B tokens.
//!
//! ```text
//! cargo build --release --features cuda --example bench_moe_experts
//! bench_moe_experts [--b 1,64,256,1024,4096] [--kernel auto|stream|gemm] [--reps 9]
//! ```
//!
//! Rows per B: `route+experts+combine` (router logits → ids/weights/order → the three grouped
//! launches; no shared expert), `experts+combine` (the routing precomputed), the projections'
//! kernel (`--kernel auto`: weight streaming up to 8 slots per expert on average, B ≤ 512, the
//! tensor-core GEMM above), the TFLOP/s of the products (2 · 3 · 5120 · 2304 FLOP per slot), and
//! the bytes the step must read: the touched experts' codes + scales (distinct experts of the
//! routing), the roofline time of those bytes at the HBM read ceiling, and the achieved GB/s.
//!
//! Timing: CUDA events, each call graph-captured and replayed ([`Timer::graph`]), median of
//! `--reps`, after warm-up; the routing rotates over 8 random sets of router logits so that
//! consecutive calls touch different experts (the layer's 7.2 GB of experts exceed the L2 cache
//! many times; at B = 1 a call reads ~113 MB). The torch anchor (`torch._grouped_mm` over bf16
//! experts) is `examples/anchors/grouped_mm.py`, run in the same session.

#[path = "support/bench.rs"]
mod bench;

use anyhow::Result;
use bench::{cuda_device, parse_args, tflops, BenchArgs};
use candle_core::{DType, Device, Tensor};
use clap::{Parser, ValueEnum};
use deepseek_v41::cuda::{moe_experts_device_with, moe_route_device, GroupedExperts, MoeExpertsKernel};
use deepseek_v41::quant::Mxfp4Weight;

/// The HBM read ceilings (GB/s): the H200 figure of the issues, and the H100's measured one
/// (`examples/anchors/hbm_read.cu`, docs/perf.md).
const HBM_GBPS_H200: f64 = 4260.0;

#[derive(Parser, Debug)]
#[command(about = "Grouped MXFP4 experts of one V4.1-Flash MoE layer")]
struct Args {
    #[command(flatten)]
    common: BenchArgs,
    /// Tokens per step.
    #[arg(long, value_delimiter = ',', default_value = "1,64,256,1024,4096")]
    b: Vec<usize>,
    /// Experts per layer.
    #[arg(long, default_value_t = 384)]
    experts: usize,
    /// The projections' kernels.
    #[arg(long, value_enum, default_value = "auto")]
    kernel: KernelArg,
}

/// `--kernel`: [`MoeExpertsKernel`].
#[derive(Debug, Clone, Copy, ValueEnum)]
enum KernelArg {
    Auto,
    Stream,
    Gemm,
}

impl KernelArg {
    fn kernel(self) -> MoeExpertsKernel {
        match self {
            KernelArg::Auto => MoeExpertsKernel::Auto,
            KernelArg::Stream => MoeExpertsKernel::Stream,
            KernelArg::Gemm => MoeExpertsKernel::Gemm,
        }
    }
}

const HIDDEN: usize = 5120;
const INTER: usize = 2304;
const TOP_K: usize = 6;

/// A random MXFP4 weight `[n, k]` on `dev`: codes over every byte, scales 2^-9 .. 2^1.
fn random_weight(n: usize, k: usize, dev: &Device) -> Result<Mxfp4Weight> {
    let codes = Tensor::rand(0f32, 255.99, (n, k / 2), dev)?.floor()?.to_dtype(DType::U8)?;
    let scales = Tensor::rand(118f32, 128.99, (n, k / 32), dev)?.floor()?.to_dtype(DType::U8)?;
    Ok(Mxfp4Weight::new(codes, scales)?)
}

fn main() -> Result<()> {
    let args: Args = parse_args(&[("reps", "9"), ("warmup", "3"), ("rep_ms", "20.0")]);
    let (dev, stream) = cuda_device("bench_moe_experts")?;
    let timer = args.common.timer(stream.clone());
    let e = args.experts;
    let expert_bytes = 3 * (INTER * HIDDEN / 2 + INTER * HIDDEN / 32);
    println!("MoE experts: {e} experts x [w1, w3 {INTER}x{HIDDEN}, w2 {HIDDEN}x{INTER}] MXFP4 ({:.1} MB each), top-{TOP_K}", expert_bytes as f64 / 1e6);
    let experts: Vec<[Mxfp4Weight; 3]> = (0..e)
        .map(|_| Ok([random_weight(INTER, HIDDEN, &dev)?, random_weight(INTER, HIDDEN, &dev)?, random_weight(HIDDEN, INTER, &dev)?]))
        .collect::<Result<_>>()?;
    let grouped = GroupedExperts::new(experts)?;
    let bias = Tensor::zeros(e, DType::F32, &dev)?;
    let kernel = args.kernel.kernel();
    println!("\n| B | what | kernel | us (graph) | TFLOP/s | touched experts | MB read | roofline us @ {HBM_GBPS_H200} GB/s | GB/s |");
    println!("|---|---|---|---|---|---|---|---|---|");
    const SETS: usize = 8;
    for &b in &args.b {
        let xs: Vec<Tensor> = (0..SETS).map(|_| Tensor::randn(0f32, 1.0, (b, HIDDEN), &dev)?.to_dtype(DType::BF16)).collect::<candle_core::Result<_>>()?;
        let logits: Vec<Tensor> = (0..SETS).map(|_| Tensor::randn(0f32, 1.0, (b, e), &dev)).collect::<candle_core::Result<_>>()?;
        let routings = logits.iter().map(|l| moe_route_device(l, &bias, TOP_K, 1.0, 1.5)).collect::<candle_core::Result<Vec<_>>>()?;
        // Distinct experts per set (host, outside the timing).
        let mut touched = 0usize;
        for r in &routings {
            touched += r.counts.to_vec1::<u32>()?.iter().filter(|&&c| c > 0).count();
        }
        let touched = touched as f64 / SETS as f64;
        let bytes = touched * expert_bytes as f64;
        let roof_us = bytes / (HBM_GBPS_H200 * 1e3);
        let mut i = 0usize;
        let full = timer.graph(SETS, || {
            let s = i % SETS;
            i += 1;
            let r = moe_route_device(&logits[s], &bias, TOP_K, 1.0, 1.5)?;
            moe_experts_device_with(&xs[s], &r, &grouped, Some(10.0), None, kernel)?;
            Ok(())
        })?;
        let mut j = 0usize;
        let experts_only = timer.graph(SETS, || {
            let s = j % SETS;
            j += 1;
            moe_experts_device_with(&xs[s], &routings[s], &grouped, Some(10.0), None, kernel)?;
            Ok(())
        })?;
        let which = if kernel.uses_gemm(b, TOP_K, e) { "gemm" } else { "stream" };
        let flop = 2.0 * 3.0 * (b * TOP_K) as f64 * (HIDDEN * INTER) as f64;
        for (what, ms) in [("route+experts+combine", full), ("experts+combine", experts_only)] {
            println!(
                "| {b} | {what} | {which} | {:.1} | {:.1} | {touched:.1} | {:.1} | {roof_us:.1} | {:.0} |",
                ms * 1e3,
                tflops(flop, ms),
                bytes / 1e6,
                bytes / (ms * 1e6)
            );
        }
    }
    Ok(())
}
