//! Benchmark of the lightning indexer on the GPU (`deepseek_v41::cuda::{masked_index_scores,
//! index_topk, index_select}`) with DeepSeek-V4.1-Flash shapes: 32 index heads x 128, top-k 512,
//! a ratio-2 key source at 128K context (65536 keys per sequence), bf16 rows (256 B) and packed
//! MXFP4 rows (68 B).
//!
//! * Decode: B = 1, 64, 256 queries, each sequence with its OWN 64K keys (one cache, per-query
//!   base row): scores alone, top-k alone (on precomputed scores), both (`index_select`,
//!   `select_us`). The queries are fake-quantized with Q3 (e2m1 x UE8M0 per 32-block, spec §2.3)
//!   as the model's index queries are (the packed-key kernel takes its integer
//!   MMAs for such queries, `kernels/include/dsv41_ix_int8.cuh`).
//! * Prefill: a chunk of T = 4K / 16K / 32K tokens at the end of a 128K context (one sequence,
//!   causal, ~64K visible keys per token), `index_select` (scores in query chunks + top-k); the
//!   queries fake-quantized with Q3 as well, as the model's are (the prefill kernel runs the bf16
//!   path on them: its integer path was 10 % slower, docs/cuda.md "indexer_scores: tried and not kept").
//!
//! Timing: `Timer::calls` of examples/support/bench.rs: CUDA events on candle's stream around
//! back-to-back calls after a warm-up, median of `reps` repetitions. GB/s: key bytes read (+ q, w, scores written and read back by the top-k)
//! over the time, against the H200's 4.17 TB/s; TFLOP/s: 2·H·D per (query, visible key) against
//! ~790 TFLOP/s dense bf16. Baseline: the same decode scoring with plain Candle ops on the same
//! GPU (batched bf16 matmul, relu, weighted head sum in f32, top-k via `arg_sort_last_dim`).
//!
//! Run: `cargo run --release --features cuda --example bench_indexer` (needs a GPU).

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use clap::Parser;
use deepseek_v41::cuda::{
    index_select, index_topk, masked_index_scores, IndexKeys, KeySource, PackedLayout, Visibility,
};
use deepseek_v41::quant::fake_quant::{fake_quant, QatFormat};

#[path = "support/bench.rs"]
mod bench;
use bench::{cuda_device, gbps, parse_args, tflops, Timer, BenchArgs, BF16_TFLOPS, HBM_READ_GBPS};

const HEADS: usize = 32;
const DIM: usize = 128;
const TOPK: usize = 512;
const KEYS: usize = 65536;
const CONTEXT: usize = 131072;
const PAGE: usize = 64;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    common: BenchArgs,
    /// Prefill chunk sizes (tokens).
    #[arg(long, value_delimiter = ',', default_value = "4096,16384,32768")]
    prefill: Vec<usize>,
    /// Decode batch sizes (queries).
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    batches: Vec<usize>,
}

/// Random bf16 key rows `[rows, 128]` and the same count of packed rows (random e2m1 codes,
/// scales 2^-1..2^1) in pages of 64.
fn caches(rows: usize, dev: &Device) -> Result<(Tensor, Tensor, PackedLayout)> {
    let layout = PackedLayout::new(QatFormat::Fp4Ue8m0B32, DIM, PAGE)?;
    let bf = Tensor::randn(0f32, 1.0, (rows, DIM), dev)?.to_dtype(DType::BF16)?;
    let pages = rows.div_ceil(PAGE);
    let data = Tensor::rand(0f32, 255.99, (pages, PAGE * 64), dev)?.floor()?.to_dtype(DType::U8)?;
    let scales = Tensor::rand(126f32, 128.99, (pages, PAGE * 4), dev)?.floor()?.to_dtype(DType::U8)?;
    let packed = Tensor::cat(&[data, scales], 1)?.contiguous()?;
    Ok((bf, packed, layout))
}

/// Plain Candle scores: per sequence `relu(q·Kᵀ)` (bf16 matmul), weighted head sum in f32.
fn baseline_scores(q: &Tensor, w: &Tensor, keys: &Tensor) -> Result<Tensor> {
    let (b, h, d) = q.dims3()?;
    let k = keys.reshape((b, KEYS, d))?;
    let s = q.matmul(&k.t()?)?.relu()?.to_dtype(DType::F32)?; // [B, H, N]
    Ok(s.broadcast_mul(&w.reshape((b, h, 1))?)?.sum(1)?) // [B, N]
}

/// Plain Candle top-k: a full descending sort of each row.
fn baseline_topk(scores: &Tensor) -> Result<Tensor> {
    Ok(scores.arg_sort_last_dim(false)?.narrow(D::Minus1, 0, TOPK)?)
}

fn main() -> Result<()> {
    let args: Args = parse_args(&[("reps", "9"), ("warmup", "5"), ("rep_ms", "3.0")]);
    let (dev, stream) = cuda_device("bench_indexer")?;
    let timer = args.common.timer(stream.clone());
    println!(
        "lightning indexer, H={HEADS} D={DIM} top-k {TOPK}, ratio-2 source at {CONTEXT} context ({KEYS} keys/sequence), H200 ceilings {HBM_READ_GBPS} GB/s, {BF16_TFLOPS} TFLOP/s"
    );
    println!("\n## decode (each sequence its own keys)");
    println!(
        "{:<5} {:<7} {:>11} {:>8} {:>8} {:>10} {:>11} {:>8} {:>7} {:>12}",
        "B", "keys", "scores_us", "GB/s", "TFLOP/s", "topk_us", "select_us", "%HBM", "%peak", "candle_scores_us"
    );
    for &b in &args.batches {
        let (bf, packed, layout) = caches(b * KEYS, &dev)?;
        let q = fake_quant(&Tensor::randn(0f32, 1.0, (b, HEADS, DIM), &dev)?, QatFormat::Fp4Ue8m0B32)?.to_dtype(DType::BF16)?;
        let w = (Tensor::randn(0f32, 0.05, (b, HEADS), &dev)?.to_dtype(DType::BF16)?.to_dtype(DType::F32))?;
        let bases: Vec<u32> = (0..b as u32).map(|i| i * KEYS as u32).collect();
        let base = Tensor::new(bases.as_slice(), &dev)?;
        let counts = Tensor::new(vec![KEYS as u32; b].as_slice(), &dev)?;
        let flops = (b * KEYS * HEADS * DIM * 2) as f64;
        for (name, keys, row_bytes) in [
            ("bf16", IndexKeys::Rows(&bf), 2 * DIM),
            ("mxfp4", IndexKeys::Packed { cache: &packed, layout }, 68),
        ] {
            let src = KeySource { keys, base: Some(&base), pages: None, entries: KEYS, visibility: Visibility::Counts(&counts) };
            let ts = timer.calls(|| {
                masked_index_scores(&q, &w, &src, None)?;
                Ok(())
            })?;
            let scores = masked_index_scores(&q, &w, &src, None)?;
            let tk = timer.calls(|| {
                index_topk(&scores, &Visibility::Counts(&counts), TOPK)?;
                Ok(())
            })?;
            let tsel = timer.calls(|| {
                index_select(&q, &w, &src, TOPK, None, None)?;
                Ok(())
            })?;
            let bytes = (b * KEYS * row_bytes + b * KEYS * 2) as f64;
            let gbps = gbps(bytes, ts);
            let tflops = tflops(flops, ts);
            let base_col = if args.common.no_baseline || name != "bf16" {
                String::new()
            } else {
                match timer.calls(|| {
                    baseline_scores(&q, &w, &bf)?;
                    Ok(())
                }) {
                    Ok(tb) => format!("{:>12.1}", tb * 1e3),
                    Err(e) => format!("  baseline failed: {e}"),
                }
            };
            println!(
                "{b:<5} {name:<7} {:>11.1} {:>8.0} {:>8.1} {:>10.1} {:>11.1} {:>7.1}% {:>6.1}% {base_col}",
                ts * 1e3,
                gbps,
                tflops,
                tk * 1e3,
                tsel * 1e3,
                100.0 * gbps / HBM_READ_GBPS,
                100.0 * tflops / BF16_TFLOPS
            );
        }
    }

    println!("\n## prefill chunk at the end of a {CONTEXT} context (one sequence, causal ratio 2)");
    println!("{:<7} {:<7} {:>11} {:>9} {:>7} {:>12}", "T", "keys", "select_ms", "TFLOP/s", "%peak", "Mtok/s");
    let (bf, packed, layout) = caches(KEYS, &dev)?;
    let slow = Timer { stream, warmup: 1, reps: 3, rep_ms: 1.0 };
    for &t in &args.prefill {
        let start = CONTEXT - t;
        let q = fake_quant(&Tensor::randn(0f32, 1.0, (t, HEADS, DIM), &dev)?, QatFormat::Fp4Ue8m0B32)?.to_dtype(DType::BF16)?;
        let w = (Tensor::randn(0f32, 0.05, (t, HEADS), &dev)?.to_dtype(DType::BF16)?.to_dtype(DType::F32))?;
        let visible: f64 = (0..t).map(|i| (start + i).div_ceil(2).min(KEYS) as f64).sum();
        let flops = visible * (HEADS * DIM * 2) as f64;
        for (name, keys) in [("bf16", IndexKeys::Rows(&bf)), ("mxfp4", IndexKeys::Packed { cache: &packed, layout })] {
            let src = KeySource { keys, base: None, pages: None, entries: KEYS, visibility: Visibility::Causal { start, ratio: 2 } };
            let ts = slow.calls(|| {
                index_select(&q, &w, &src, TOPK, None, None)?;
                Ok(())
            })?;
            let tflops = tflops(flops, ts);
            println!(
                "{t:<7} {name:<7} {:>11.2} {:>9.1} {:>6.1}% {:>12.3}",
                ts,
                tflops,
                100.0 * tflops / BF16_TFLOPS,
                t as f64 / (ts * 1e-3) / 1e6
            );
        }
    }
    // Last (a failing launch must not spoil the rest): candle's sort-based top-k of 64K columns.
    if !args.common.no_baseline {
        let scores = Tensor::randn(0f32, 1.0, (64, KEYS), &dev)?;
        match slow.calls(|| {
            baseline_topk(&scores)?;
            Ok(())
        }) {
            Ok(t) => println!("\ncandle arg_sort top-k of [64, {KEYS}] f32: {:.1} us", t * 1e3),
            Err(e) => println!("\ncandle arg_sort top-k of [64, {KEYS}] f32 failed: {e}"),
        }
    }
    Ok(())
}
