//! Benchmark of `deepseek_v41::cuda::sparse_attention_two_source` (bf16 rows) with
//! DeepSeek-V4.1-Flash shapes: 64 heads x 512, per query token 128 window rows and 512 extra
//! rows.
//!
//! * Decode, B = 1, 64, 256 sequences, one query token each: the window = the sequence's own
//!   ring of 128 rows, extra = 512 rows drawn at random from a pool of 128K compressed positions
//!   (128 MB, mostly not in L2). Each B with the launcher's choice, the all-heads kernel (its
//!   split choice) and the head-split kernel forced in both loops (`HeadSplit`: one consumer,
//!   two-stage ring; `HeadSplitPingPong`: two consumers on a slot ring) and the dims-split pair
//!   (`DimSplitPair`: all heads, the dims split over a 2-CTA cluster); B = 64 also with forced
//!   split counts.
//! * Prefill, T = 4096, 16384, 65536 query tokens of one sequence: token i's window = positions
//!   i-127 ..= i (−1 before the start), extra = 512 random entries of a compressed pool of T/4
//!   rows (compression ratio 4).
//!
//! Timing: CUDA events on candle's stream, median of `reps` repetitions of back-to-back calls
//! after a warm-up (options, median, GB/s and TFLOP/s from examples/support/bench.rs; the
//! blocker method below is this bench's own). Each repetition first queues a "blocker" (bf16 matmuls long enough for the
//! host to enqueue all the repetition's calls behind it), then the start event, the calls and
//! the end event: the figure is the GPU time per call (kernel + launch gaps), not the host's
//! enqueue rate. The host-bound rate (plain back-to-back without the blocker) is printed too.
//! GB/s: unique bytes (q + gathered rows + out) over the time vs 4.17 TB/s; TFLOP/s: 2·2·H·D
//! per valid row and token (Q·Kᵀ and P·V) vs ~790 TFLOP/s bf16. Baseline: the same attention with
//! plain Candle ops on the same GPU (`index_select` gather, bf16 `matmul`, f32 softmax, `matmul`;
//! no sink), for the decode sizes and prefill T = 4096 (larger T does not fit its gathers).
//!
//! * Decode over packed rows (`KvRows::Packed`: 528 B window rows, 288 B compressed rows,
//!   dequantized in the kernel), B = 1, 64, 256 (default, all-heads and head-split kernels): GB/s
//!   counted with the packed row sizes.
//!
//! * In-stream decode B = 64, 1, 256 (see [`in_stream`]): repeated [top-k -> attention] pairs with the
//!   indexer's real top-k kernel as the producer of the extra index lists; the attention's share
//!   = pair - top-k alone, for the launcher's choice (the dims-split pair at B = 1 and 64, the
//!   all-heads kernel at B = 256), the head-split two-stage loop (`SparseAttentionKernel::HeadSplit`),
//!   the ping-pong loop and the dims-split pair (`SparseAttentionKernel::DimSplitPair`), next to the
//!   standalone figures above (which are back-to-back calls of the attention alone: its rows
//!   largely stay in L2 between calls), and the attention after an L2 flush.
//!
//! Run: `cargo run --release --features cuda --example bench_sparse_attention` (needs a GPU).
//! `--trace` and `--diag` need the kernels' diagnostics, which only a diagnostic build has:
//! `cargo run --release --features cuda,cuda-diag --example bench_sparse_attention -- --trace`
//! (the launchers then read `DSV41_SPARSE_ATTENTION_TRACE` / `_DIAG` at every call; see
//! `kernels/include/dsv41_sparse_attention_common.cuh`). Time production figures with a build
//! without `cuda-diag`.

use std::time::Instant;

use anyhow::Result;
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use deepseek_v41::cuda::{
    index_topk, sparse_attention_two_source, sparse_attention_two_source_with, KvRows, PackedLayout, SparseAttentionInputs,
    SparseAttentionKernel, SparseAttentionOptions, Visibility,
};
use deepseek_v41::quant::QatFormat;

#[path = "support/bench.rs"]
mod bench;
use bench::{cuda_device, gbps, median, parse_args, tflops, BenchArgs, BF16_TFLOPS, HBM_READ_GBPS};

const HEADS: usize = 64;
const HEAD_DIM: usize = 512;
const WINDOW: usize = 128;
const TOPK: usize = 512;
const POOL: usize = 128 * 1024;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    common: BenchArgs,
    /// Skip the prefill sizes.
    #[arg(long)]
    no_prefill: bool,
    /// Skip the decode cases over packed rows (528 B window rows, 288 B compressed rows).
    #[arg(long)]
    no_packed: bool,
    /// Print the kernel's phase trace (CTA 0) once per case (DSV41_SPARSE_ATTENTION_TRACE; needs
    /// a build with the `cuda-diag` feature), and the dims-split pair's trace of the 4th of 4
    /// back-to-back calls.
    #[arg(long)]
    trace: bool,
    /// Also time each default case without the mma, without the gather and (the dims-split
    /// pair) without its merge and epilogue (DSV41_SPARSE_ATTENTION_DIAG, wrong results, timing
    /// only; needs a build with the `cuda-diag` feature).
    #[arg(long)]
    diag: bool,
}

/// Timing behind a blocker (see the module doc), with the shared options' stream, warm-up,
/// repetitions and repetition length.
struct Timer {
    opts: bench::Timer,
    blocker: Tensor,
    blocker_ms: f64,
}

impl Timer {
    fn new(dev: &Device, opts: bench::Timer) -> Result<Self> {
        let blocker = Tensor::randn(0f32, 1.0, (4096, 4096), dev)?.to_dtype(DType::BF16)?;
        let mut t = Timer { opts, blocker, blocker_ms: 0.0 };
        for _ in 0..3 {
            t.block(1)?;
        }
        let start = t.event()?;
        t.block(5)?;
        let end = t.event()?;
        t.blocker_ms = start.elapsed_ms(&end)? as f64 / 5.0;
        Ok(t)
    }
    fn event(&self) -> Result<candle_core::cuda_backend::cudarc::driver::CudaEvent> {
        Ok(self.opts.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }
    fn block(&self, n: usize) -> Result<()> {
        for _ in 0..n {
            self.blocker.matmul(&self.blocker)?;
        }
        Ok(())
    }
    /// (GPU ms per call behind a blocker, host-bound ms per call), medians.
    fn time(&self, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
        for _ in 0..self.opts.warmup.max(1) {
            f()?;
        }
        self.opts.stream.synchronize()?;
        // Calibrate: GPU time per call and host enqueue time per call.
        let wall = Instant::now();
        let start = self.event()?;
        for _ in 0..3 {
            f()?;
        }
        let end = self.event()?;
        let host_ms = wall.elapsed().as_secs_f64() * 1e3 / 3.0;
        let probe = start.elapsed_ms(&end)? as f64 / 3.0;
        let iters = ((self.opts.rep_ms / probe.max(1e-4)) as usize).clamp(3, 2000);
        let blocks = ((1.5 * host_ms * iters as f64 / self.blocker_ms.max(1e-3)).ceil() as usize).clamp(1, 400);
        let mut gpu = Vec::new();
        let mut plain = Vec::new();
        for _ in 0..self.opts.reps.max(1) {
            self.block(blocks)?;
            let start = self.event()?;
            for _ in 0..iters {
                f()?;
            }
            let end = self.event()?;
            gpu.push(start.elapsed_ms(&end)? as f64 / iters as f64);
            self.opts.stream.synchronize()?;
            let start = self.event()?;
            for _ in 0..iters {
                f()?;
            }
            let end = self.event()?;
            plain.push(start.elapsed_ms(&end)? as f64 / iters as f64);
        }
        Ok((median(gpu), median(plain)))
    }
}

/// Plain Candle ops: gather, scores, softmax, P·V (no sink).
fn baseline(q: &Tensor, kvw: &Tensor, iw: &Tensor, kvc: &Tensor, ic: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, d) = q.dims3()?;
    let kw = kvw.index_select(&iw.flatten_all()?, 0)?.reshape((b, iw.dim(1)?, d))?;
    let kc = kvc.index_select(&ic.flatten_all()?, 0)?.reshape((b, ic.dim(1)?, d))?;
    let k = Tensor::cat(&[kw, kc], 1)?;
    let s = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale)?;
    let p = candle_nn::ops::softmax_last_dim(&s)?.to_dtype(DType::BF16)?;
    Ok(p.matmul(&k)?.reshape((b, h, d))?)
}

struct Problem {
    q: Tensor,
    kvw: Tensor,
    iw: Tensor,
    kvc: Tensor,
    ic: Tensor,
    /// `iw` with −1 replaced by 0 (the baseline's `index_select` takes no holes).
    iw_base: Tensor,
    /// Valid rows over all tokens.
    rows: usize,
    /// Distinct bytes read + written (q, distinct gathered rows, out).
    bytes: f64,
}

fn random_indices(n: usize, below: usize, seed: u64) -> Vec<i64> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % below as u64) as i64
        })
        .collect()
}

fn decode_problem(dev: &Device, pool: &Tensor, b: usize) -> Result<Problem> {
    let q = Tensor::randn(0f32, 1.0, (b, HEADS, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;
    let kvw = Tensor::randn(0f32, 1.0, (b * WINDOW, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;
    let iw: Vec<i64> = (0..b * WINDOW).map(|i| i as i64).collect();
    let iw = Tensor::from_vec(iw, (b, WINDOW), dev)?;
    let ic = Tensor::from_vec(random_indices(b * TOPK, POOL, b as u64 + 7), (b, TOPK), dev)?;
    let rows = b * (WINDOW + TOPK);
    let bytes = (b * HEADS * HEAD_DIM * 2 * 2 + rows * HEAD_DIM * 2) as f64;
    Ok(Problem { q, kvw, iw_base: iw.clone(), iw, kvc: pool.clone(), ic, rows, bytes })
}

/// Decode B = 64 with `win` valid window rows and no extra rows (−1): fixed per-call costs.
fn short_problem(dev: &Device, b: usize, win: usize) -> Result<Problem> {
    let q = Tensor::randn(0f32, 1.0, (b, HEADS, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;
    let kvw = Tensor::randn(0f32, 1.0, (b * WINDOW, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;
    let iw: Vec<i64> = (0..b * WINDOW).map(|i| if i % WINDOW < win { i as i64 } else { -1 }).collect();
    let iw_base = Tensor::from_vec(iw.iter().map(|&i| i.max(0)).collect::<Vec<_>>(), (b, WINDOW), dev)?;
    let iw = Tensor::from_vec(iw, (b, WINDOW), dev)?;
    let ic = Tensor::full(-1i64, (b, TOPK), dev)?;
    let rows = b * win;
    let bytes = (b * HEADS * HEAD_DIM * 2 * 2 + rows * HEAD_DIM * 2) as f64;
    Ok(Problem { q, kvc: kvw.clone(), kvw, iw_base, iw, ic, rows, bytes })
}

fn prefill_problem(dev: &Device, t: usize, pool: Option<usize>) -> Result<Problem> {
    let pool = pool.unwrap_or((t / 4).max(TOPK));
    let q = Tensor::randn(0f32, 1.0, (t, HEADS, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;
    let kvw = Tensor::randn(0f32, 1.0, (t, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;
    let kvc = Tensor::randn(0f32, 1.0, (pool, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;
    let mut iw = Vec::with_capacity(t * WINDOW);
    let mut rows = 0;
    for i in 0..t {
        for j in 0..WINDOW {
            let pos = i as i64 - (WINDOW - 1 - j) as i64;
            rows += usize::from(pos >= 0);
            iw.push(if pos >= 0 { pos } else { -1 });
        }
    }
    rows += t * TOPK;
    let iw_base = Tensor::from_vec(iw.iter().map(|&i| i.max(0)).collect::<Vec<_>>(), (t, WINDOW), dev)?;
    let iw = Tensor::from_vec(iw, (t, WINDOW), dev)?;
    let ic = Tensor::from_vec(random_indices(t * TOPK, pool, t as u64), (t, TOPK), dev)?;
    let bytes = (t * HEADS * HEAD_DIM * 2 * 2 + (t + pool.min(t * TOPK)) * HEAD_DIM * 2) as f64;
    Ok(Problem { q, kvw, iw_base, iw, kvc, ic, rows, bytes })
}

/// Decode over PACKED rows: the problem's window rows in format A and the pool in format B
/// (pages of 64 tokens), same indices; bytes counted with the packed row sizes. Prints one row
/// like [`report`] (no baseline; correctness is tests/cuda_sparse_attention_packed.rs).
fn report_packed(
    timer: &Timer,
    args: &Args,
    label: &str,
    pb: &Problem,
    pool: &(Tensor, PackedLayout),
    sink: &Tensor,
    opts: SparseAttentionOptions,
) -> Result<()> {
    let scale = (HEAD_DIM as f32).powf(-0.5);
    let a = PackedLayout::new(QatFormat::Fp8Ue8m0B32, HEAD_DIM, 64)?;
    let win = a.pack(&pb.kvw)?;
    let inputs = SparseAttentionInputs {
        q: &pb.q,
        window: KvRows::Packed(&win, a),
        idx_window: &pb.iw,
        extra: KvRows::Packed(&pool.0, pool.1),
        idx_extra: &pb.ic,
        sink,
        scale,
    };
    let (t, host) = timer.time(|| {
        inputs.forward(opts)?;
        Ok(())
    })?;
    if args.trace {
        traced(label, || inputs.forward(opts).map(|_| ()))?;
    }
    let b = pb.q.dim(0)?;
    let bytes = (b * HEADS * HEAD_DIM * 2 * 2 + b * (WINDOW * a.row_bytes() + TOPK * pool.1.row_bytes())) as f64;
    print_row(label, t, host, bytes, pb.rows, "");
    Ok(())
}

/// Score entries per row of the in-stream producer (the compressed keys of a 128K-token
/// context at compression ratio 4).
const TOPK_N: usize = 32 * 1024;

/// In-stream decode at batch `b`: repeated [producer -> attention] pairs on one stream, the producer
/// being the real top-k of the indexer (`index_topk` of `[b, TOPK_N]` bf16 scores, k = 512,
/// one CTA per row) whose output is the attention's extra index list (as in the layer's decode
/// step, where the attention follows the selection). Timed like every case (behind a blocker,
/// median): the producer alone, the pair, and the attention's share = pair - producer alone;
/// plus the attention alone on the top-k's (fixed) indices, and after an L2 flush. Kernels: the
/// launcher's choice (the dims-split pair at B = 64), the head-split two-stage and ping-pong loops and the
/// dims-split pair forced. (The top-k lets its dependents launch before its emit step and the attention uses
/// programmatic dependent launch: kernels/indexer_topk.cu and the chain contract in kernels/sparse_attention.cu.)
fn in_stream(timer: &Timer, args: &Args, dev: &Device, pool: &Tensor, sink: &Tensor, b: usize) -> Result<()> {
    let pb = decode_problem(dev, pool, b)?;
    let scores = Tensor::randn(0f32, 1.0, (b, TOPK_N), dev)?.to_dtype(DType::BF16)?;
    let vis = Visibility::Causal { start: TOPK_N, ratio: 1 };
    let scale = (HEAD_DIM as f32).powf(-0.5);
    let opts = SparseAttentionOptions::default();
    let attn = |ic: &Tensor| sparse_attention_two_source_with(&pb.q, &pb.kvw, &pb.iw, pool, ic, sink, scale, opts);
    let topk = || index_topk(&scores, &vis, TOPK);
    let idx = topk()?;
    let (want, _) = attn(&idx)?;
    let want = want.to_dtype(DType::F32)?;
    println!("in-stream B={b}: producer = index_topk of [{b}, {TOPK_N}] bf16 scores, k = {TOPK} (its output is the attention's extra list)");
    let (alone, _) = timer.time(|| {
        attn(&idx)?;
        Ok(())
    })?;
    println!("  attention alone on the top-k's indices (Auto, PDL): {:.2} us", alone * 1e3);
    // Calibration: the attention after a kernel that streams 2 x 96 MB through L2 (nothing of
    // the attention's inputs stays there), minus that kernel alone.
    let junk = Tensor::ones(24 << 20, DType::F32, dev)?;
    let (thrash, _) = timer.time(|| {
        junk.affine(1.0, 1.0)?;
        Ok(())
    })?;
    let (cold, _) = timer.time(|| {
        junk.affine(1.0, 1.0)?;
        attn(&idx)?;
        Ok(())
    })?;
    println!(
        "  attention after an L2 flush (96 MB copy): pair {:.2} us - flush alone {:.2} us = {:.2} us",
        cold * 1e3,
        thrash * 1e3,
        (cold - thrash) * 1e3
    );
    if args.trace {
        traced("  after an L2 flush", || {
            junk.affine(1.0, 1.0)?;
            attn(&idx).map(|_| ())
        })?;
    }
    let (prod, _) = timer.time(|| {
        topk()?;
        Ok(())
    })?;
    println!("  top-k alone: {:.2} us", prod * 1e3);
    let two_stage = SparseAttentionOptions { kernel: SparseAttentionKernel::HeadSplit, ..opts };
    let ping_pong = SparseAttentionOptions { kernel: SparseAttentionKernel::HeadSplitPingPong, ..opts };
    let dim_split = SparseAttentionOptions { kernel: SparseAttentionKernel::DimSplitPair, ..opts };
    for (name, o) in [("Auto", opts), ("head-split two-stage", two_stage), ("ping-pong", ping_pong), ("dims-split pair", dim_split)] {
        let attn = |ic: &Tensor| sparse_attention_two_source_with(&pb.q, &pb.kvw, &pb.iw, pool, ic, sink, scale, o);
        let (pair, _) = timer.time(|| {
            attn(&topk()?)?;
            Ok(())
        })?;
        // The pair's result against the launcher's choice on the fixed indices (bitwise expected).
        let (out, _) = attn(&topk()?)?;
        let diff = (out.to_dtype(DType::F32)? - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        println!(
            "  pair top-k -> attention [{name}]: pair {:.2} us, attention's share {:.2} us (max |diff| {diff})",
            pair * 1e3,
            (pair - prod) * 1e3
        );
        if args.trace {
            traced(&format!("  pair [{name}]"), || attn(&topk()?).map(|_| ()))?;
        }
    }
    Ok(())
}

/// One call with the launcher's phase trace of CTA 0 (printed on stderr).
fn traced(label: &str, f: impl FnOnce() -> candle_core::Result<()>) -> Result<()> {
    eprint!("{label}: ");
    std::env::set_var("DSV41_SPARSE_ATTENTION_TRACE", "1");
    let r = f();
    std::env::remove_var("DSV41_SPARSE_ATTENTION_TRACE");
    Ok(r?)
}

/// A result row: GPU and host-bound µs per call, GB/s and TFLOP/s (`rows` valid rows) against
/// the ceilings, then `tail` (the baseline columns).
fn print_row(label: &str, t: f64, host: f64, bytes: f64, rows: usize, tail: &str) {
    let gbps = gbps(bytes, t);
    let tflops = tflops((4 * HEADS * HEAD_DIM * rows) as f64, t);
    println!(
        "{label:<31} {:>10.2} {:>10.2} {:>8.0} {:>6.1}% {:>8.1} {:>6.1}% {tail}",
        t * 1e3,
        host * 1e3,
        gbps,
        100.0 * gbps / HBM_READ_GBPS,
        tflops,
        100.0 * tflops / BF16_TFLOPS
    );
}

fn report(
    timer: &Timer,
    args: &Args,
    label: &str,
    pb: &Problem,
    sink: &Tensor,
    opts: SparseAttentionOptions,
    with_baseline: bool,
) -> Result<()> {
    let scale = (HEAD_DIM as f64).powf(-0.5);
    let (t, host) = timer.time(|| {
        sparse_attention_two_source_with(&pb.q, &pb.kvw, &pb.iw, &pb.kvc, &pb.ic, sink, scale as f32, opts)?;
        Ok(())
    })?;
    let base = if !with_baseline || args.common.no_baseline {
        "           -        -".to_string()
    } else {
        match timer.time(|| {
            baseline(&pb.q, &pb.kvw, &pb.iw_base, &pb.kvc, &pb.ic, scale)?;
            Ok(())
        }) {
            Ok((tb, _)) => format!("{:>12.2} {:>7.1}x", tb * 1e3, tb / t),
            Err(e) => format!("  baseline failed: {e}"),
        }
    };
    if args.diag && opts.num_splits.is_none() {
        for (what, v) in [("no mma", "2"), ("no gather", "4"), ("no epilogue, dims-split only", "64")] {
            std::env::set_var("DSV41_SPARSE_ATTENTION_DIAG", v);
            let r = timer.time(|| {
                sparse_attention_two_source_with(&pb.q, &pb.kvw, &pb.iw, &pb.kvc, &pb.ic, sink, scale as f32, opts)?;
                Ok(())
            });
            std::env::remove_var("DSV41_SPARSE_ATTENTION_DIAG");
            println!("  diag {label} ({what}): {:.2} us", r?.0 * 1e3);
        }
    }
    if args.trace {
        traced(label, || {
            sparse_attention_two_source_with(&pb.q, &pb.kvw, &pb.iw, &pb.kvc, &pb.ic, sink, scale as f32, opts).map(|_| ())
        })?;
        // Back to back behind a blocker (the dims-split pair prints its 4th call's trace).
        eprint!("{label} (4th of 4 back-to-back calls): ");
        std::env::set_var("DSV41_SPARSE_ATTENTION_TRACE", "2");
        timer.block(2)?;
        for _ in 0..4 {
            sparse_attention_two_source_with(&pb.q, &pb.kvw, &pb.iw, &pb.kvc, &pb.ic, sink, scale as f32, opts)?;
        }
        std::env::remove_var("DSV41_SPARSE_ATTENTION_TRACE");
        timer.opts.stream.synchronize()?;
        eprintln!();
    }
    print_row(label, t, host, pb.bytes, pb.rows, &base);
    Ok(())
}

fn main() -> Result<()> {
    let args: Args = parse_args(&[("reps", "11"), ("warmup", "5"), ("rep_ms", "3.0")]);
    if (args.trace || args.diag) && !cfg!(feature = "cuda-diag") {
        anyhow::bail!(
            "--trace and --diag need the kernels' diagnostics, which this build does not have: build with \
             `--features cuda,cuda-diag` (timing figures come from a build without it)"
        );
    }
    let (dev, stream) = cuda_device("bench_sparse_attention")?;
    let timer = Timer::new(&dev, args.common.timer(stream))?;
    let sink = Tensor::randn(0f32, 1.0, HEADS, &dev)?;
    println!(
        "sparse attention, H={HEADS} D={HEAD_DIM}, {WINDOW} window + {TOPK} extra rows per query token, bf16 rows; \
         blocker {:.3} ms",
        timer.blocker_ms
    );
    println!(
        "{:<31} {:>10} {:>10} {:>8} {:>7} {:>8} {:>7} {:>12} {:>8}",
        "case", "gpu_us", "host_us", "GB/s", "HBM", "TFLOP/s", "peak", "candle_us", "speedup"
    );
    let pool = Tensor::randn(0f32, 1.0, (POOL, HEAD_DIM), &dev)?.to_dtype(DType::BF16)?;
    let auto = SparseAttentionOptions::default();
    let all_heads = SparseAttentionOptions { kernel: SparseAttentionKernel::AllHeads, ..auto };
    let head_split = SparseAttentionOptions { kernel: SparseAttentionKernel::HeadSplit, ..auto };
    let pingpong = SparseAttentionOptions { kernel: SparseAttentionKernel::HeadSplitPingPong, ..auto };
    let dim_split = SparseAttentionOptions { kernel: SparseAttentionKernel::DimSplitPair, ..auto };
    for b in [1usize, 64, 256] {
        let pb = decode_problem(&dev, &pool, b)?;
        report(&timer, &args, &format!("decode B={b}"), &pb, &sink, auto, true)?;
        report(&timer, &args, &format!("decode B={b} all-heads"), &pb, &sink, all_heads, false)?;
        report(&timer, &args, &format!("decode B={b} head-split"), &pb, &sink, head_split, false)?;
        report(&timer, &args, &format!("decode B={b} ping-pong"), &pb, &sink, pingpong, false)?;
        report(&timer, &args, &format!("decode B={b} dims-split pair"), &pb, &sink, dim_split, false)?;
        if b == 64 {
            for s in [1usize, 2, 3, 4] {
                let opts = SparseAttentionOptions { num_splits: Some(s), ..auto };
                report(&timer, &args, &format!("decode B=64 splits={s}"), &pb, &sink, opts, false)?;
            }
        }
    }
    if !args.no_packed {
        // The same decode problems over packed rows (the pool dequantized to bf16 is another
        // pool, so the bf16 figures above are the comparison, not a bit-exact reference).
        let b_fmt = PackedLayout::new(QatFormat::Fp4E4m3B16, HEAD_DIM, 64)?;
        let packed_pool = (b_fmt.pack(&pool)?, b_fmt);
        for b in [1usize, 64, 256] {
            let pb = decode_problem(&dev, &pool, b)?;
            for (name, opts) in [("", auto), (" all-heads", all_heads), (" head-split", head_split)] {
                report_packed(&timer, &args, &format!("decode B={b} packed{name}"), &pb, &packed_pool, &sink, opts)?;
            }
        }
    }
    for b in [64usize, 1, 256] {
        in_stream(&timer, &args, &dev, &pool, &sink, b)?;
    }
    // Sanity: the default entry point agrees with the explicit one (same launcher choice).
    {
        let pb = decode_problem(&dev, &pool, 4)?;
        let scale = (HEAD_DIM as f32).powf(-0.5);
        let (a, _) = sparse_attention_two_source(&pb.q, &pb.kvw, &pb.iw, &pb.kvc, &pb.ic, &sink, scale)?;
        let (b, _) = sparse_attention_two_source_with(
            &pb.q,
            &pb.kvw,
            &pb.iw,
            &pb.kvc,
            &pb.ic,
            &sink,
            scale,
            SparseAttentionOptions::default(),
        )?;
        let diff = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        println!("check: default vs explicit options max |diff| = {diff}");
    }
    // Fixed costs: no valid row, one tile of 64 rows.
    for win in [0usize, 64] {
        let pb = short_problem(&dev, 64, win)?;
        report(&timer, &args, &format!("decode B=64 rows={win}"), &pb, &sink, auto, false)?;
        report(&timer, &args, &format!("decode B=64 rows={win} all-heads"), &pb, &sink, all_heads, false)?;
        report(&timer, &args, &format!("decode B=64 rows={win} ping-pong"), &pb, &sink, pingpong, false)?;
        report(&timer, &args, &format!("decode B=64 rows={win} dims-split"), &pb, &sink, dim_split, false)?;
    }
    drop(pool);
    if !args.no_prefill {
        for t in [4096usize, 16384, 65536] {
            let pb = prefill_problem(&dev, t, None)?;
            report(&timer, &args, &format!("prefill T={t}"), &pb, &sink, auto, t <= 4096)?;
        }
        let pb = prefill_problem(&dev, 4096, Some(POOL))?;
        report(&timer, &args, "prefill T=4096 pool128K", &pb, &sink, auto, false)?;
    }
    Ok(())
}
