//! Benchmark of `deepseek_v41::cuda::sparse_attention_two_source` (decode, bf16 rows) with
//! DeepSeek-V4.1-Flash shapes: 64 heads x 512, per token 128 window rows (its own ring of 128)
//! and 512 extra rows drawn at random from a pool of 128K compressed positions, B = 1, 64, 256
//! decode tokens (one per sequence).
//!
//! Timing: CUDA events on candle's stream around back-to-back calls after a warm-up, median of
//! `reps` repetitions, per call. GB/s: unique bytes (q + the gathered rows + out) over the time,
//! against the H200's 4.17 TB/s. Baseline: the same attention with plain Candle ops on the same
//! GPU (`index_select` gather, bf16 `matmul`, f32 softmax, `matmul`; no sink, timing only).
//!
//! Run: `cargo run --release --features cuda --example bench_sparse_attention` (needs a GPU).

use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::cuda_backend::cudarc::driver::{sys::CUevent_flags, CudaStream};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use deepseek_v41::cuda::sparse_attention_two_source;

const HBM_GBPS: f64 = 4170.0;
const HEADS: usize = 64;
const HEAD_DIM: usize = 512;
const WINDOW: usize = 128;
const TOPK: usize = 512;
const POOL: usize = 128 * 1024;

#[derive(Parser, Debug)]
struct Args {
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 11)]
    reps: usize,
    /// Warm-up calls before timing.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Target time of one repetition in milliseconds.
    #[arg(long, default_value_t = 4.0)]
    rep_ms: f64,
    /// Skip the plain-Candle baseline.
    #[arg(long)]
    no_baseline: bool,
}

fn time(stream: &Arc<CudaStream>, args: &Args, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..args.warmup.max(1) {
        f()?;
    }
    stream.synchronize()?;
    let mut span = |iters: usize| -> Result<f64> {
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for _ in 0..iters {
            f()?;
        }
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        Ok(start.elapsed_ms(&end)? as f64 / iters as f64)
    };
    let probe = span(3)?;
    let iters = ((args.rep_ms / probe.max(1e-4)) as usize).clamp(3, 5000);
    let mut s: Vec<f64> = (0..args.reps.max(1)).map(|_| span(iters)).collect::<Result<_>>()?;
    s.sort_by(|a, b| a.total_cmp(b));
    Ok(s[s.len() / 2])
}

/// Plain Candle ops: gather, scores, softmax, P·V (no sink).
fn baseline(q: &Tensor, kvw: &Tensor, iw: &Tensor, kvc: &Tensor, ic: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, d) = q.dims3()?;
    let kw = kvw.index_select(&iw.flatten_all()?, 0)?.reshape((b, WINDOW, d))?;
    let kc = kvc.index_select(&ic.flatten_all()?, 0)?.reshape((b, TOPK, d))?;
    let k = Tensor::cat(&[kw, kc], 1)?;
    let s = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale)?;
    let p = candle_nn::ops::softmax_last_dim(&s)?.to_dtype(DType::BF16)?;
    Ok(p.matmul(&k)?.reshape((b, h, d))?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::new_cuda(0).context("bench_sparse_attention needs a CUDA device")?;
    let stream = match &dev {
        Device::Cuda(c) => c.cuda_stream(),
        _ => unreachable!(),
    };
    let scale = (HEAD_DIM as f64).powf(-0.5);
    let pool = Tensor::randn(0f32, 1.0, (POOL, HEAD_DIM), &dev)?.to_dtype(DType::BF16)?;
    let sink = Tensor::randn(0f32, 1.0, HEADS, &dev)?;
    println!(
        "sparse attention decode, H={HEADS} D={HEAD_DIM}, {WINDOW} window + {TOPK} extra rows per token, pool {POOL} rows"
    );
    println!(
        "{:<8} {:>10} {:>9} {:>8} {:>12} {:>9}",
        "B", "fused_us", "GB/s", "of_HBM", "candle_us", "speedup"
    );
    for b in [1usize, 64, 256] {
        let q = Tensor::randn(0f32, 1.0, (b, HEADS, HEAD_DIM), &dev)?.to_dtype(DType::BF16)?;
        let kvw = Tensor::randn(0f32, 1.0, (b * WINDOW, HEAD_DIM), &dev)?.to_dtype(DType::BF16)?;
        let iw: Vec<i64> = (0..b * WINDOW).map(|i| i as i64).collect();
        let iw = Tensor::from_vec(iw, (b, WINDOW), &dev)?;
        let ic = Tensor::rand(0f32, POOL as f32, (b, TOPK), &dev)?.floor()?.clamp(0f32, (POOL - 1) as f32)?.to_dtype(DType::I64)?;
        let bytes = (b * HEADS * HEAD_DIM * 2 * 2 + b * (WINDOW + TOPK) * HEAD_DIM * 2) as f64;
        let t = time(&stream, &args, || {
            sparse_attention_two_source(&q, &kvw, &iw, &pool, &ic, &sink, scale as f32)?;
            Ok(())
        })?;
        let gbps = bytes / (t * 1e-3) / 1e9;
        let base = if args.no_baseline {
            String::new()
        } else {
            match time(&stream, &args, || {
                baseline(&q, &kvw, &iw, &pool, &ic, scale)?;
                Ok(())
            }) {
                Ok(tb) => format!("{:>12.2} {:>8.1}x", tb * 1e3, tb / t),
                Err(e) => format!("  baseline failed: {e}"),
            }
        };
        println!("{b:<8} {:>10.2} {:>9.1} {:>7.1}% {base}", t * 1e3, gbps, 100.0 * gbps / HBM_GBPS);
    }
    Ok(())
}
