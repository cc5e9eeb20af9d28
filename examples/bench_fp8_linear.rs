//! The block-scaled FP8 linear on CUDA (issue 21): `cuda::fp8_linear` over weights kept in FP8
//! (e4m3 codes + e8m0 32×32 block scales) against today's path (the weight dequantized to bf16
//! at load, `nn::Linear` = FP8 activation quant kernel + Candle's cuBLAS bf16 matmul), at the
//! V4.1-Flash shapes and m = 1, 16, 64, 256, 4096.
//!
//! ```text
//! cargo build --release --features cuda --example bench_fp8_linear
//! bench_fp8_linear [--m 1,16,64,256,4096] [--shapes wq_a,wq_b,wo_b,w13,w2,wq_a+wkv] [--variants pipeline,registers,warp]
//!                  [--no-act-quant] [--reps 9]
//! ```
//!
//! Rows per shape and m:
//! * `fp8 auto`: `fp8_linear` (streaming kernel, shared-memory pipeline variant, for m <= 64,
//!   else dequantize + cuBLAS);
//! * `fp8 stream (pipeline | registers | warp)`: the streaming kernel's variants forced (`--variants`;
//!   up to m = 256, warp up to m = 64), one after the other for each shape and m;
//! * `fp8 stream (registers, fused act | prep kernel)`: m <= 16, the activation quantized inside
//!   the streaming kernel (`Fp8Prep::Fused`) or by the prep kernel (`Fp8Prep::Kernel`);
//! * `fp8 dequant+cuBLAS`: that path forced (m = 64 .. 256);
//! * `fp8 gemm (wgmma)`: the FP8 wgmma GEMM forced (m >= 64; with `--no-act-quant` it falls back
//!   to dequantize + cuBLAS);
//! * `bf16 linear`: today's `nn::Linear` forward over the bf16 dequantized weight;
//! * `dequant only`: the dequantization kernel alone (FP8 -> bf16 scratch).
//!
//! Timing: CUDA events ([`Timer::graph`]: the calls captured into a CUDA graph and replayed, so
//! the GPU time without the host's launch work; `calls_us` = back-to-back eager calls, host work
//! included), median of `--reps`, after warm-up. The weights rotate over enough copies to exceed
//! 4x the L2 cache (`bench::rotation_sets`), so every call reads its weight from HBM (the
//! activations stay hot, as they are in a model). GB/s = weight bytes (FP8 codes + scales, or
//! bf16) per call over the time, against the 4.26 TB/s HBM read ceiling; TFLOP/s = 2·m·n·k over
//! the time (FP8 dense peak ~1,450 effective, bf16 ~790). The torch anchors (cuBLASLt FP8
//! `torch._scaled_mm`, bf16 `torch.mm`) come from `examples/anchors/scaled_mm.py` in the same run.

#[path = "support/bench.rs"]
mod bench;

use anyhow::Result;
use bench::{cuda_device, gbps, l2_bytes, parse_args, rotation_sets, tflops, BenchArgs, Timer};
use candle_core::{DType, Device, Module, Tensor};
use clap::Parser;
use deepseek_v41::cuda::{
    fp8_dequantize_device, fp8_linear, fp8_linear_split, fp8_linear_with, Fp8LinearOptions, Fp8LinearPath, Fp8Prep, Fp8StreamVariant, FP8_STREAM_MAX_M, FP8_WARP_MAX_M,
};
use deepseek_v41::nn::{Linear, LinearKind};
use deepseek_v41::quant::Fp8Weight;
use deepseek_v41::Numerics;

/// The HBM read ceiling the issue measures against (GB/s).
const HBM_GBPS: f64 = 4260.0;

#[derive(Parser, Debug)]
#[command(about = "FP8 linear: weight streaming vs dequantize + cuBLAS vs today's bf16 linear")]
struct Args {
    #[command(flatten)]
    common: BenchArgs,
    /// Token counts.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256,4096")]
    m: Vec<usize>,
    /// Shapes (wq_a 5120->1280, wq_b 1280->32768, wo_b 8192->5120, w13 5120->2304, w2 2304->5120;
    /// wq_a+wkv: the two of one input, two calls against one stacked call).
    #[arg(long, value_delimiter = ',', default_value = "wq_a,wq_b,wo_b,w13,w2")]
    shapes: Vec<String>,
    /// Streaming-kernel variants timed forced (pipeline, registers, warp).
    #[arg(long, value_delimiter = ',', default_value = "pipeline,registers,warp")]
    variants: Vec<String>,
    /// Run with the activation quantization off.
    #[arg(long)]
    no_act_quant: bool,
}

/// The forced streaming variants: (`--variants` name, row label, variant, largest m).
const VARIANTS: [(&str, &str, Fp8StreamVariant, usize); 3] = [
    ("pipeline", "fp8 stream (pipeline)", Fp8StreamVariant::Pipeline, FP8_STREAM_MAX_M),
    ("registers", "fp8 stream (registers)", Fp8StreamVariant::Registers, FP8_STREAM_MAX_M),
    ("warp", "fp8 stream (warp)", Fp8StreamVariant::Warp, FP8_WARP_MAX_M),
];

/// (name, in = k, out = n).
const SHAPES: [(&str, usize, usize); 5] = [("wq_a", 5120, 1280), ("wq_b", 1280, 32768), ("wo_b", 8192, 5120), ("w13", 5120, 2304), ("w2", 2304, 5120)];

/// A random FP8 weight on `dev`: codes over every byte but the NaNs, scales 2^-9 .. 2^8.
fn random_weight(n: usize, k: usize, dev: &Device) -> Result<Fp8Weight> {
    let mag = Tensor::rand(0f32, 126.99, (n, k), dev)?.floor()?;
    let sign = (Tensor::rand(0f32, 1.99, (n, k), dev)?.floor()? * 128.0)?;
    let codes = (mag + sign)?.to_dtype(DType::U8)?;
    let scales = Tensor::rand(118f32, 135.99, (n.div_ceil(32), k.div_ceil(32)), dev)?.floor()?.to_dtype(DType::U8)?;
    Ok(Fp8Weight::new(codes, scales)?)
}

struct Row<'a> {
    shape: &'a str,
    m: usize,
    what: &'static str,
    graph_ms: f64,
    calls_ms: Option<f64>,
    weight_bytes: f64,
    flops: f64,
}

fn print(r: &Row) {
    let calls = r.calls_ms.map(|c| format!("{:.1}", c * 1e3)).unwrap_or_else(|| "-".into());
    let gb = gbps(r.weight_bytes, r.graph_ms);
    println!(
        "| {} | {} | {} | {:.1} | {} | {:.0} | {:.0} % | {:.1} |",
        r.shape,
        r.m,
        r.what,
        r.graph_ms * 1e3,
        calls,
        gb,
        100.0 * gb / HBM_GBPS,
        tflops(r.flops, r.graph_ms)
    );
}

/// Graph-replayed (and, if `eager`, back-to-back) median ms per call of `f(set)` over `sets`.
fn time(timer: &Timer, sets: usize, eager: bool, mut f: impl FnMut(usize) -> Result<()>) -> Result<(f64, Option<f64>)> {
    let mut i = 0usize;
    let g = timer.graph(sets, || {
        let r = f(i % sets);
        i += 1;
        r
    })?;
    let c = if eager {
        let mut j = 0usize;
        Some(timer.calls(|| {
            let r = f(j % sets);
            j += 1;
            r
        })?)
    } else {
        None
    };
    Ok((g, c))
}

fn main() -> Result<()> {
    let args: Args = parse_args(&[("reps", "9"), ("warmup", "3"), ("rep_ms", "20.0")]);
    if let Some(v) = args.variants.iter().find(|v| !VARIANTS.iter().any(|(name, ..)| name == v)) {
        anyhow::bail!("--variants: unknown variant {v:?} (pipeline, registers, warp)")
    }
    let (dev, stream) = cuda_device("bench_fp8_linear")?;
    let timer = args.common.timer(stream.clone());
    let l2 = l2_bytes(&stream)?;
    let aq = !args.no_act_quant;
    println!("FP8 linear (e4m3 + e8m0 32x32 scales), act quant {aq}; L2 {} MB; HBM read ceiling {HBM_GBPS} GB/s", l2 >> 20);
    println!("\n| shape | m | path | us (graph) | us (calls) | weight GB/s | % of HBM | TFLOP/s |");
    println!("|---|---|---|---|---|---|---|---|");
    let numerics = Numerics { activation_quant: aq, ..Numerics::PLAIN };
    for &(name, k, n) in SHAPES.iter().filter(|s| args.shapes.iter().any(|a| a == s.0)) {
        let fp8_bytes = (n * k + n.div_ceil(32) * k.div_ceil(32)) as f64;
        let sets = rotation_sets(n * k, l2, 8);
        let weights: Vec<Fp8Weight> = (0..sets).map(|_| random_weight(n, k, &dev)).collect::<Result<_>>()?;
        // Today's path holds the bf16 weight: fewer copies rotate over the same L2 excess.
        let bf_sets = rotation_sets(2 * n * k, l2, 8);
        let linears: Vec<Linear> = if args.common.no_baseline {
            Vec::new()
        } else {
            weights.iter().take(bf_sets).map(|w| Ok(Linear::from_weight(w.dequantize(DType::BF16)?, LinearKind::Quantized, numerics))).collect::<Result<_>>()?
        };
        let (g, _) = time(&timer, sets, false, |s| {
            fp8_dequantize_device(&weights[s], DType::BF16)?;
            Ok(())
        })?;
        print(&Row { shape: name, m: 0, what: "dequant only (r+w bytes)", graph_ms: g, calls_ms: None, weight_bytes: 3.0 * (n * k) as f64, flops: 0.0 });
        for &m in &args.m {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(DType::BF16)?;
            let flops = 2.0 * (m * n * k) as f64;
            let (g, c) = time(&timer, sets, m <= 64, |s| {
                fp8_linear(&x, &weights[s], aq)?;
                Ok(())
            })?;
            print(&Row { shape: name, m, what: "fp8 auto", graph_ms: g, calls_ms: c, weight_bytes: fp8_bytes, flops });
            for &(_, what, variant, _) in VARIANTS.iter().filter(|v| m <= v.3 && args.variants.iter().any(|a| a == v.0)) {
                let (g, _) = time(&timer, sets, false, |s| {
                    fp8_linear_with(&x, &weights[s], aq, Fp8LinearOptions { path: Fp8LinearPath::Stream, splits: 0, variant, ..Default::default() })?;
                    Ok(())
                })?;
                print(&Row { shape: name, m, what, graph_ms: g, calls_ms: None, weight_bytes: fp8_bytes, flops });
            }
            if m <= 16 {
                // The register ring with the activation fused and from a prep kernel, both forced.
                for (prep, what) in [(Fp8Prep::Fused, "fp8 stream (registers, fused act)"), (Fp8Prep::Kernel, "fp8 stream (registers, prep kernel)")] {
                    let opts = Fp8LinearOptions { path: Fp8LinearPath::Stream, variant: Fp8StreamVariant::Registers, prep, ..Default::default() };
                    let (g, _) = time(&timer, sets, false, |s| {
                        fp8_linear_with(&x, &weights[s], aq, opts)?;
                        Ok(())
                    })?;
                    print(&Row { shape: name, m, what, graph_ms: g, calls_ms: None, weight_bytes: fp8_bytes, flops });
                }
            }
            if m >= 64 {
                let (g, _) = time(&timer, sets, false, |s| {
                    fp8_linear_with(&x, &weights[s], aq, Fp8LinearOptions { path: Fp8LinearPath::Gemm, ..Default::default() })?;
                    Ok(())
                })?;
                print(&Row { shape: name, m, what: "fp8 gemm (wgmma)", graph_ms: g, calls_ms: None, weight_bytes: fp8_bytes, flops });
            }
            if (64..=FP8_STREAM_MAX_M).contains(&m) {
                let (g, _) = time(&timer, sets, false, |s| {
                    fp8_linear_with(&x, &weights[s], aq, Fp8LinearOptions { path: Fp8LinearPath::Dequant, ..Default::default() })?;
                    Ok(())
                })?;
                print(&Row { shape: name, m, what: "fp8 dequant+cuBLAS", graph_ms: g, calls_ms: None, weight_bytes: fp8_bytes, flops });
            }
            if !linears.is_empty() {
                let (g, c) = time(&timer, linears.len(), m <= 64, |s| {
                    linears[s].forward(&x)?;
                    Ok(())
                })?;
                print(&Row { shape: name, m, what: "bf16 linear (today)", graph_ms: g, calls_ms: c, weight_bytes: 2.0 * (n * k) as f64, flops });
            }
        }
    }
    if args.shapes.iter().any(|a| a == "wq_a+wkv") {
        stacked_pair(&args, &timer, &dev, l2, aq)?;
    }
    Ok(())
}

/// `wq_a` (5120 -> 1280) and `wkv` (5120 -> 512) of one input: two calls against one launch over
/// the stacked weight writing both outputs (`fp8_linear_split`, what `nn::LinearPair` runs).
fn stacked_pair(args: &Args, timer: &Timer, dev: &Device, l2: usize, aq: bool) -> Result<()> {
    let (k, n1, n2) = (5120, 1280, 512);
    let n = n1 + n2;
    let sets = rotation_sets(n * k, l2, 8);
    let pairs: Vec<(Fp8Weight, Fp8Weight)> = (0..sets).map(|_| Ok((random_weight(n1, k, dev)?, random_weight(n2, k, dev)?))).collect::<Result<_>>()?;
    let stacked: Vec<Fp8Weight> = pairs.iter().map(|(a, b)| Ok(a.stack(b)?)).collect::<Result<_>>()?;
    let fp8_bytes = (n * k + n.div_ceil(32) * k.div_ceil(32)) as f64;
    for &m in args.m.iter().filter(|&&m| m <= FP8_STREAM_MAX_M) {
        let x = Tensor::randn(0f32, 1.0, (m, k), dev)?.to_dtype(DType::BF16)?;
        let flops = 2.0 * (m * n * k) as f64;
        let (g, c) = time(timer, sets, m <= 64, |s| {
            fp8_linear(&x, &pairs[s].0, aq)?;
            fp8_linear(&x, &pairs[s].1, aq)?;
            Ok(())
        })?;
        print(&Row { shape: "wq_a+wkv", m, what: "fp8 auto, two calls", graph_ms: g, calls_ms: c, weight_bytes: fp8_bytes, flops });
        let (g, c) = time(timer, sets, m <= 64, |s| {
            fp8_linear_split(&x, &stacked[s], aq, Fp8LinearOptions::default(), n1)?;
            Ok(())
        })?;
        print(&Row { shape: "wq_a+wkv", m, what: "fp8 stacked, one call", graph_ms: g, calls_ms: c, weight_bytes: fp8_bytes, flops });
    }
    Ok(())
}
