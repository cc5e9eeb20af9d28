//! Batched decode step of one V4.1-Flash attention layer on CUDA (issue 6, deliverable 4): the
//! latency of one decode step of B sequences at once (B = 1, 64, 256 by default), each at a
//! `--context` of 128K tokens, with a per-phase breakdown, tokens/s and the step's roofline.
//!
//! ```text
//! cargo build --release --features cuda --example bench_batched_decode
//! bench_batched_decode [--batch 1,64,256] [--context 131072] [--steps 10] [--keys bf16,packed,packed-kv]
//!     [--closing half|all] [--rep-ms 50] [--graph]
//! ```
//!
//! The step is the library's (`deepseek_v41::attention::decode_batch`: `DecodeStep` over
//! `BatchedLayerCache` pools and `DecodeStepInputs`; its module docs list the ops of each phase),
//! run phase by phase through `examples/support/batched_step.rs` (phases projections, inserts,
//! selection, attention, output), shared with `examples/bench_flash_layer.rs`. The step inputs
//! are written once per (B, format) by `DecodeStepInputs::update` (not timed).
//!
//! Layer: the first ratio-2 kv + index source of the config (layer 2 of V4.1-Flash); random
//! bf16 weights (`RandomWeights`: `support/batched_layer.rs`, `Weights::random`); E = context / 2
//! compressed entries and index keys per sequence, random (not zeros), written once. Positions: with `--closing half` (default, the
//! steady state: every sequence closes a group every other step) the ceil(B/2) even-numbered
//! sequences sit at position `context − 1` (they close group E − 1 this step, visible E entries)
//! and the odd ones at `context − 2` (open a group, E − 1 visible); `--closing all` puts every
//! sequence at `context − 1` (worst case: B compressor groups closing in one step). Every
//! measured step repeats the same positions (it rewrites the same cache rows; the step's inputs
//! are device tensors, so a graph replays whatever `update` wrote last); the timing is that of a
//! real step.
//!
//! `--cpu` runs only the sanity check through the ops' CPU reference paths (no timings): a logic
//! check of the composition on a machine without a GPU.
//!
//! Timing (CUDA events on candle's stream, after warm-up):
//! * `events`: per step, one event per phase boundary, the device synchronized only after the
//!   step; the median over `--steps` steps. A phase's time includes its host-side launch work
//!   whenever the host is slower than the GPU (small B).
//! * `step`: back-to-back steps without any synchronization inside ([`Timer::calls`]).
//! * `graph`: the whole step captured into a CUDA graph and replayed (GPU time only), and each
//!   phase alone captured and replayed (the GPU-only breakdown).
//!
//! Roofline: the weights read once per step plus, per sequence, the 128 window rows and 512
//! top-k rows of 1 KB and the E index keys scanned (256 B bf16 / 68 B packed), at 4.17 TB/s.
//! Cache formats (`--keys`): `bf16` (all rows bf16), `packed` (index keys in MXFP4 68 B rows, KV
//! rows bf16), `packed-kv` (everything in the V4.1 packed formats: window rows 528 B (A),
//! compressed rows 288 B (B), index keys 68 B (E); inserted with `packed_insert`, read by the
//! attention kernel as `KvRows::Packed`). The bf16 KV pools are only allocated when a format
//! needs them, so `--keys packed-kv` alone shows the packed caches' memory.
//! Not measured here: the MoE / other layers, the host-side scheduling of a serving loop.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::Device;
use clap::{Parser, ValueEnum};
use deepseek_v41::config::{AttentionRole, Config};
use deepseek_v41::cuda::SparseAttentionKernel;

#[path = "support/bench.rs"]
mod bench;
#[path = "support/batched_layer.rs"]
mod batched_layer;
#[path = "support/batched_step.rs"]
mod batched_step;
use batched_layer::Weights;
use batched_step::{CacheFormat, Inputs, SourcePools, Step, StepCaches, WindowPool, PAGE, PHASES};
use bench::{gib, median, PoolPeak, Timer, HBM_READ_GBPS};

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "tests/fixtures/deepseek-v41-flash/config.json")]
    config: PathBuf,
    /// Batch sizes (sequences decoded in one step).
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    batch: Vec<usize>,
    /// Context length of every sequence (even, at least 2·top-k).
    #[arg(long, default_value_t = 131072)]
    context: usize,
    /// Measured steps of the event breakdown, and repetitions of the other timings (median).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Warm-up steps.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Target milliseconds of one repetition of the back-to-back / graph timings.
    #[arg(long, default_value_t = 50.0)]
    rep_ms: f64,
    /// Cache formats to run: `bf16` (bf16 rows everywhere), `packed` (MXFP4 68 B index keys,
    /// bf16 KV rows), `packed-kv` (window / compressed / index-key rows all packed: 528 / 288 / 68 B).
    #[arg(long, value_delimiter = ',', default_value = "bf16,packed")]
    keys: Vec<String>,
    /// `half`: every other sequence closes a compressor group this step; `all`: every sequence.
    #[arg(long, default_value = "half")]
    closing: String,
    /// Also time the step replayed from a CUDA graph (with Candle's host-upload cache on, see
    /// `run_format`). Off by default: a failed replay poisons the CUDA context, so it runs last
    /// in a separate invocation (without the upload cache the replay hit
    /// CUDA_ERROR_ILLEGAL_ADDRESS).
    #[arg(long)]
    graph: bool,
    /// Run only the sanity check of every (B, format) on the CPU (the ops' reference paths; a
    /// logic check of the composition without a GPU, e.g. `--cpu --batch 1,3 --context 1024`).
    #[arg(long)]
    cpu: bool,
    /// The sparse attention kernel.
    #[arg(long, value_enum, default_value_t = AttentionKernel::Auto)]
    attention_kernel: AttentionKernel,
}

/// `--attention-kernel`: which [`SparseAttentionKernel`] the step's attention asks for.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum AttentionKernel {
    /// The launcher's choice.
    Auto,
    /// The head-split kernel's ping-pong loop (`SparseAttentionKernel::HeadSplitPingPong`; bf16
    /// rows).
    PingPong,
    /// The head-split kernel's two-stage loop (`SparseAttentionKernel::HeadSplit`).
    HeadSplit,
    /// The dims-split pair (`SparseAttentionKernel::DimSplitPair`; bf16 rows; Auto's choice up to B ≈ 66).
    DimSplit,
}

impl From<AttentionKernel> for SparseAttentionKernel {
    fn from(k: AttentionKernel) -> Self {
        match k {
            AttentionKernel::Auto => SparseAttentionKernel::Auto,
            AttentionKernel::PingPong => SparseAttentionKernel::HeadSplitPingPong,
            AttentionKernel::HeadSplit => SparseAttentionKernel::HeadSplit,
            AttentionKernel::DimSplit => SparseAttentionKernel::DimSplitPair,
        }
    }
}

/// Timings of one (B, key format) run, milliseconds.
struct Row {
    b: usize,
    fmt: CacheFormat,
    events: [f64; 5],
    step: f64,
    graph: Option<f64>,
    phase_graph: [Option<f64>; 5],
    roofline: f64,
    /// Device memory (candle's pool): held by pools + step inputs, and the high-water mark of
    /// the timed steps (both formats of this B), bytes.
    mem: Option<(u64, u64)>,
}

fn run_format(step: &Step, timer: &Timer, args: &Args, w_bytes: f64) -> Result<Row> {
    let stream = &timer.stream;
    let x = &step.s.x;
    println!("  sanity ({}): {}", step.fmt.name(), step.sanity(x)?.0);
    for _ in 0..args.warmup {
        step.run(x)?;
    }
    // Event breakdown: one event per phase boundary, synchronized after the step.
    let mut per_phase = vec![Vec::new(); PHASES.len()];
    for _ in 0..args.steps.max(1) {
        stream.synchronize()?;
        let ev = || stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let mut evs = vec![ev()?];
        let pr = step.projections(x)?;
        evs.push(ev()?);
        step.inserts(&pr)?;
        evs.push(ev()?);
        let idx = step.selection(&pr)?;
        evs.push(ev()?);
        let o = step.attention(&pr, idx.as_ref())?;
        evs.push(ev()?);
        step.output(&o)?;
        evs.push(ev()?);
        stream.synchronize()?;
        for (i, pair) in evs.windows(2).enumerate() {
            per_phase[i].push(pair[0].elapsed_ms(&pair[1])? as f64);
        }
    }
    let mut events = [0.0; 5];
    for (e, v) in events.iter_mut().zip(per_phase) {
        *e = median(v);
    }
    let step_ms = timer.calls(|| step.run(x).map(|_| ()))?;
    let mut graph = None;
    let mut phase_graph = [None; 5];
    if args.graph {
        // Candle uploads the dims / strides of strided ops from host memory on every call; in a
        // capture such an upload would be recorded as a copy from a host buffer freed right
        // after (replay then reads garbage: CUDA_ERROR_ILLEGAL_ADDRESS). With Candle's upload
        // cache on, the warm-up call before each capture stores those small uploads on the
        // device and the capture reuses them (an uncached upload during capture is an error).
        let _uploads = step.s.x.device().as_cuda_device()?.enable_cuda_graph_htod_cache();
        let report = |what: &str, r: Result<f64>| match r {
            Ok(v) => Some(v),
            Err(e) => {
                println!("  graph of {what} ({}): error: {e:#}", step.fmt.name());
                None
            }
        };
        graph = report("the step", timer.graph(1, || step.run(x).map(|_| ())));
        let pr = step.projections(x)?;
        let idx = step.selection(&pr)?;
        let o = step.attention(&pr, idx.as_ref())?;
        phase_graph = [
            report(PHASES[0], timer.graph(1, || step.projections(x).map(|_| ()))),
            report(PHASES[1], timer.graph(1, || step.inserts(&pr))),
            report(PHASES[2], timer.graph(1, || step.selection(&pr).map(|_| ()))),
            report(PHASES[3], timer.graph(1, || step.attention(&pr, idx.as_ref()).map(|_| ()))),
            report(PHASES[4], timer.graph(1, || step.output(&o).map(|_| ()))),
        ];
    }
    let s = step.s;
    let (win_row, comp_row) = step.fmt.kv_row_bytes(step.w.hd);
    let per_seq = step.w.window as f64 * win_row + step.w.topk as f64 * comp_row + s.e as f64 * step.fmt.row_bytes();
    let roofline = (w_bytes + s.b as f64 * per_seq) / (HBM_READ_GBPS * 1e9) * 1e3;
    Ok(Row { b: s.b, fmt: step.fmt, events, step: step_ms, graph, phase_graph, roofline, mem: None })
}

fn mem_used_gib(dev: &Device) -> f64 {
    if !dev.is_cuda() {
        return f64::NAN;
    }
    match candle_core::cuda_backend::cudarc::driver::result::mem_get_info() {
        Ok((free, total)) => (total - free) as f64 / (1u64 << 30) as f64,
        Err(_) => f64::NAN,
    }
}

#[allow(clippy::too_many_arguments)]
fn run_batch(
    w: &Weights,
    cfg: &Config,
    b: usize,
    args: &Args,
    fmts: &[CacheFormat],
    timer: Option<&Timer>,
    dev: &Device,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let ctx = args.context;
    let e = ctx / w.ratio;
    let pool = timer.map(|t| PoolPeak::new(&t.stream)).transpose()?;
    let t0 = std::time::Instant::now();
    let bf16_kv = fmts.iter().any(|&f| f != CacheFormat::PackedKv);
    let packed_kv = fmts.contains(&CacheFormat::PackedKv);
    let win = WindowPool::new(b, w.window, w.hd, fmts, dev)?;
    let src = SourcePools::new(b, e, w.hd, w.di, fmts, dev)?;
    let s = Inputs::new(w, cfg.hidden_size, b, ctx, args.closing == "all", dev)?;
    dev.synchronize()?;
    let held = pool.as_ref().map(|p| -> Result<u64> {
        let held = p.used()?;
        p.reset()?;
        Ok(held)
    }).transpose()?;
    let first_row = rows.len();
    println!(
        "B = {b}: pools filled in {:.1} s (compressed {:.2} GiB bf16 / {:.2} GiB packed, window {:.1} / {:.1} MiB, {} closing); device memory in use {:.1} GiB",
        t0.elapsed().as_secs_f64(),
        if bf16_kv { (b * e * w.hd * 2) as f64 / (1u64 << 30) as f64 } else { 0.0 },
        if packed_kv { (b * e * 288) as f64 / (1u64 << 30) as f64 } else { 0.0 },
        if bf16_kv { (b * w.window * w.hd * 2) as f64 / (1u64 << 20) as f64 } else { 0.0 },
        if packed_kv { (b * w.window * 528) as f64 / (1u64 << 20) as f64 } else { 0.0 },
        s.closers(),
        mem_used_gib(dev)
    );
    let layer = w.decode_layer()?;
    for &fmt in fmts {
        let caches = StepCaches::new(&layer, &win, Some(&src), None, fmt, &s)?;
        let step = Step::new(w, &layer, &caches, &s, fmt, args.attention_kernel.into(), None)?;
        let Some(timer) = timer else {
            match step.sanity(&s.x) {
                Ok((m, _)) => println!("  sanity ({}): {m}", fmt.name()),
                Err(e) => println!("  B = {b}, keys {}: error: {e:#}", fmt.name()),
            }
            continue;
        };
        match run_format(&step, timer, args, w.bytes()) {
            Ok(r) => {
                println!(
                    "  {}: events {:.3} ms, step {:.3} ms, graph {}",
                    fmt.name(),
                    r.events.iter().sum::<f64>(),
                    r.step,
                    r.graph.map_or("n/a".into(), |g| format!("{g:.3} ms"))
                );
                rows.push(r)
            }
            Err(e) => println!("  B = {b}, keys {}: error: {e:#}", fmt.name()),
        }
    }
    if let (Some(p), Some(held)) = (&pool, held) {
        dev.synchronize()?;
        let peak = p.peak()?;
        println!("  device memory (pool high-water mark): {:.2} GiB held by pools, weights and inputs, {:.2} GiB peak during the steps", gib(held), gib(peak));
        rows[first_row..].iter_mut().for_each(|r| r.mem = Some((held, peak)));
    }
    Ok(())
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.3}"))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (dev, timer) = if args.cpu {
        (Device::Cpu, None)
    } else {
        let dev = Device::new_cuda(0).context("bench_batched_decode needs a CUDA device (or --cpu)")?;
        let cuda = dev.as_cuda_device()?;
        // One stream only: no cross-stream event bookkeeping (it cannot be captured into a graph).
        unsafe { cuda.disable_event_tracking() };
        let stream = cuda.cuda_stream();
        (dev, Some(Timer { stream, warmup: args.warmup, reps: args.steps.max(1), rep_ms: args.rep_ms }))
    };
    let cfg = Config::from_file(&args.config).with_context(|| format!("reading {}", args.config.display()))?;
    let layer = cfg
        .layers
        .iter()
        .position(|r| matches!(r.attention, AttentionRole::Compressed { ratio: 2, kv_source, .. } if kv_source == r.layer))
        .context("no ratio-2 kv source layer")?;
    let fmts: Vec<CacheFormat> = args.keys.iter().map(|k| CacheFormat::parse(k)).collect::<Result<_>>()?;
    if !matches!(args.closing.as_str(), "half" | "all") {
        bail!("--closing must be half or all, got {:?}", args.closing)
    }
    let t = std::time::Instant::now();
    let w = Weights::random(&cfg, layer, &dev)?;
    if args.context % w.ratio != 0 || args.context < 2 * w.topk.max(w.window) || args.context / w.ratio % PAGE != 0 {
        bail!("--context {} must be even, >= {} and a multiple of {}", args.context, 2 * w.topk.max(w.window), w.ratio * PAGE)
    }
    let w_bytes = w.bytes();
    println!(
        "layer {layer} (ratio 2, kv + index source): hidden {}, {} heads x {}, q_lora {}, o_groups {} x o_lora {}, window {}, index {} heads x {}, top-k {}",
        cfg.hidden_size, w.h, w.hd, cfg.q_lora_rank, w.g, cfg.o_lora_rank, w.window, w.hi, w.di, w.topk
    );
    println!(
        "weights (random bf16, compressor f32): {:.1} MB, built in {:.1} s; context {} per sequence ({} entries), closing: {}",
        w_bytes / 1e6,
        t.elapsed().as_secs_f64(),
        args.context,
        args.context / w.ratio,
        args.closing
    );

    let mut rows = Vec::new();
    for &b in &args.batch {
        if b == 0 {
            println!("B = 0: skipped");
            continue;
        }
        if let Err(e) = run_batch(&w, &cfg, b, &args, &fmts, timer.as_ref(), &dev, &mut rows) {
            println!("B = {b}: error: {e:#}");
        }
        // Pools of this B are dropped; let the allocator's frees complete before the next.
        dev.synchronize()?;
    }

    println!("\n## batched decode step, one attention layer, context {} per sequence (ms, median)", args.context);
    println!("\nEvent breakdown (one event per phase boundary, synchronized after each step; host launch time included where the host is the bottleneck), whole step back-to-back and from a CUDA graph:\n");
    println!("| B | caches | projections | inserts | selection | attention | output | sum | step | step (graph) | tokens/s | tokens/s (graph) | roofline | % of roofline (graph) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let best = r.graph.unwrap_or(r.step);
        println!(
            "| {} | {} | {} | {:.3} | {:.3} | {} | {:.0} | {} | {:.3} | {:.0}% |",
            r.b,
            r.fmt.name(),
            r.events.iter().map(|v| format!("{v:.3}")).collect::<Vec<_>>().join(" | "),
            r.events.iter().sum::<f64>(),
            r.step,
            fmt_opt(r.graph),
            r.b as f64 / r.step * 1e3,
            r.graph.map_or("n/a".into(), |g| format!("{:.0}", r.b as f64 / g * 1e3)),
            r.roofline,
            r.roofline / best * 100.0
        );
    }
    if args.graph {
        println!("\nGPU-only breakdown (each phase alone captured into a CUDA graph and replayed):\n");
        println!("| B | caches | projections | inserts | selection | attention | output | sum |");
        println!("|---|---|---|---|---|---|---|---|");
        for r in &rows {
            let sum: Option<f64> = r.phase_graph.iter().copied().sum();
            println!(
                "| {} | {} | {} | {} |",
                r.b,
                r.fmt.name(),
                r.phase_graph.iter().map(|v| fmt_opt(*v)).collect::<Vec<_>>().join(" | "),
                fmt_opt(sum)
            );
        }
    }
    println!(
        "\nroofline = (weights {:.1} MB once per step + B x (({} window + {} top-k) rows x 1 KB (all packed: 528 B / 288 B) + {} index keys x 256 B bf16 / 68 B packed)) / {:.2} TB/s",
        w_bytes / 1e6,
        w.window,
        w.topk,
        args.context / w.ratio,
        HBM_READ_GBPS / 1e3
    );
    println!("tokens/s: B tokens per step of this one layer.");
    println!("\nDevice memory (high-water mark of candle's CUDA memory pool; weights of this one layer included, CUDA context and cuBLAS workspace not):\n");
    println!("| B | held before the steps (weights, pools, inputs) GiB | peak during the steps GiB | step transient MiB |");
    println!("|---|---|---|---|");
    let mut seen = Vec::new();
    for r in &rows {
        if let (Some((held, peak)), false) = (r.mem, seen.contains(&r.b)) {
            seen.push(r.b);
            println!("| {} | {:.2} | {:.2} | {:.1} |", r.b, gib(held), gib(peak), peak.saturating_sub(held) as f64 / (1u64 << 20) as f64);
        }
    }
    Ok(())
}
