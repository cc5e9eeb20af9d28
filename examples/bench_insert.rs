//! Benchmark of the fused CUDA cache inserts and query RoPE (`deepseek_v41::cuda`) with
//! DeepSeek-V4.1-Flash shapes (64 heads x 512, rope 64, window 128, index head 128), against
//! the same computation written with plain Candle ops on the same GPU.
//!
//! Timing (examples/support/bench.rs): CUDA events, warm-up, the median over repetitions, per
//! call, two ways: `loop` = back-to-back calls of the Rust op (host work included: for small
//! decode batches this is the launch overhead an application pays), `graph` = the same calls
//! replayed from a CUDA graph (GPU time only). Every op cycles through enough independent
//! input/cache sets that its working set exceeds 4x the L2 cache, so each call reads and
//! writes HBM (the candle baseline uses one set).
//!
//! Bandwidth: the bytes a call must move (reads of the rows, cos/sin and slots, writes of the
//! cache rows: read + write counted) over the graph time, against the H200's measured 4.17 TB/s
//! read ceiling and against a device-to-device copy (`cuMemcpyAsync`, graph-timed, also
//! L2-defeating) of the same number of bytes measured in the same run ("% copy").
//!
//! The Candle baseline computes RoPE with `nn::rope::apply_rope_tail` and the fake quant with
//! elementwise ops (log/exp/round; timing only, its numerics are approximate), then writes the
//! rows with `scatter_set`.
//!
//! Run: `cargo run --release --features cuda --example bench_insert` (needs a CUDA GPU).

use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use clap::Parser;
use deepseek_v41::cuda::{
    compressed_insert, index_key_insert, packed_insert, q_rope, q_rope_inplace, window_insert, PackedLayout,
};
use deepseek_v41::nn::rms_norm::RmsNorm;
use deepseek_v41::nn::rope::{apply_rope_tail, RopeKind, RopeTable};
use deepseek_v41::quant::QatFormat;

#[path = "support/bench.rs"]
mod bench;
use bench::{gbps, l2_bytes, parse_args, rotation_sets, CopyRef, Timer, BenchArgs, HBM_READ_GBPS};

const HEADS: usize = 64;
const HEAD_DIM: usize = 512;
const ROPE_DIM: usize = 64;
const WINDOW: usize = 128;
const INDEX_DIM: usize = 128;
/// Compressed entries per sequence in the decode cases (each sequence's slots wrap inside).
const ENTRIES_PER_SEQ: usize = 256;
/// Largest number of rotated input/cache sets per op.
const MAX_SETS: usize = 8;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    common: BenchArgs,
    /// Largest prefill length.
    #[arg(long, default_value_t = 65536)]
    max_prefill: usize,
    /// Only the rows whose "op case" contains one of these comma-separated strings (e.g.
    /// `--only "index_key,packed B"`); all rows when absent.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

struct Bench {
    timer: Timer,
    args: Args,
    l2: usize,
}

/// One op's timings.
struct Times {
    loop_ms: f64,
    graph_ms: Option<f64>,
}

impl Bench {
    /// Times `fused` (called with a running call counter; it picks its buffer set from it) in a
    /// loop and from a graph of `sets` calls.
    fn fused(&self, sets: usize, mut fused: impl FnMut(usize) -> Result<()>) -> Result<Times> {
        let mut i = 0usize;
        let loop_ms = self.timer.calls(|| {
            i += 1;
            fused(i)
        })?;
        let graph_ms = match self.timer.graph(sets, || {
            i += 1;
            fused(i)
        }) {
            Ok(ms) => Some(ms),
            Err(e) => {
                eprintln!("graph timing unavailable: {e:#}");
                None
            }
        };
        Ok(Times { loop_ms, graph_ms })
    }

    /// Times the fused op (and the baseline, unless disabled) and prints one table row.
    fn row(
        &self,
        op: &str,
        case: &str,
        bytes: f64,
        sets: usize,
        fused: impl FnMut(usize) -> Result<()>,
        base: Option<&mut dyn FnMut() -> Result<()>>,
    ) -> Result<()> {
        let name = format!("{op} {case}");
        if !self.args.only.is_empty() && !self.args.only.iter().any(|f| name.contains(f.as_str())) {
            return Ok(());
        }
        let t = self.fused(sets, fused)?;
        let kernel_ms = t.graph_ms.unwrap_or(t.loop_ms);
        let bw = gbps(bytes, kernel_ms);
        let mut copy = CopyRef::new(&self.timer.stream, (bytes / 2.0) as usize)?;
        let copy_bw = gbps(copy.moved_bytes(), copy.time(&self.timer)?);
        let base = match base {
            Some(b) if !self.args.common.no_baseline => match self.timer.calls(b) {
                Ok(tb) => format!("{:>11.2} {:>8.1}x", tb * 1e3, tb / t.loop_ms),
                Err(e) => format!("  baseline failed: {e}"),
            },
            _ => String::new(),
        };
        let graph = t.graph_ms.map_or("-".to_string(), |g| format!("{:.2}", g * 1e3));
        println!(
            "{op:<24} {case:<16} {:>9.2} {graph:>9} {bw:>8.0} {:>6.1}% {copy_bw:>8.0} {:>6.1}% {base}",
            t.loop_ms * 1e3,
            100.0 * bw / HBM_READ_GBPS,
            100.0 * bw / copy_bw,
        );
        Ok(())
    }

    /// Whether a section whose op names contain `key` is to run (with `--only`: some filter
    /// string names it).
    fn section(&self, key: &str) -> bool {
        self.args.only.is_empty() || self.args.only.iter().any(|f| f.contains(key))
    }

    fn sets(&self, bytes_per_set: f64) -> usize {
        rotation_sets(bytes_per_set as usize, self.l2, MAX_SETS)
    }
}

fn random_bf16(shape: &[usize], dev: &Device) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(DType::BF16)?)
}

/// `(cos, sin)` on the GPU for the positions.
fn cos_sin(table: &RopeTable, positions: &[usize], dev: &Device) -> Result<(Tensor, Tensor)> {
    let (c, s) = table.cos_sin(positions)?;
    Ok((c.to_device(dev)?, s.to_device(dev)?))
}

/// 2^ceil(log2(v)) with elementwise ops.
fn pow2_ceil(v: &Tensor) -> Result<Tensor> {
    let ln2 = std::f64::consts::LN_2;
    Ok(((v.log()? / ln2)?.ceil()? * ln2)?.exp()?)
}

/// Nearest value on a floating grid with `mant` mantissa bits and min exponent `emin`
/// (approximate: candle's round is half away from zero).
fn round_grid(y: &Tensor, mant: i32, emin: f64) -> Result<Tensor> {
    let ln2 = std::f64::consts::LN_2;
    let e = (y.abs()?.log()? / ln2)?.floor()?.maximum(emin)?;
    let quantum = ((e - mant as f64)? * ln2)?.exp()?;
    Ok((y / &quantum)?.round()?.mul(&quantum)?)
}

/// The fake quant of `fmt` with plain Candle ops on `[T, D]` (timing baseline).
fn candle_fake_quant(x: &Tensor, fmt: QatFormat) -> Result<Tensor> {
    let (t, d) = x.dims2()?;
    let b = fmt.block();
    let x = x.to_dtype(DType::F32)?.reshape((t, d / b, b))?;
    let amax = x.abs()?.max_keepdim(2)?;
    let (s, max) = match fmt {
        QatFormat::Fp8Ue8m0B32 => (pow2_ceil(&(amax.maximum(1e-4)? / 448.0)?)?, 448.0),
        QatFormat::Fp4Ue8m0B32 => (pow2_ceil(&(amax.maximum(6.0 * 2f64.powi(-126))? / 6.0)?)?, 6.0),
        QatFormat::Fp4E4m3B16 => {
            (round_grid(&(amax.maximum(6.0 * 2f64.powi(-9))? / 6.0)?, 3, -6.0)?.minimum(448.0)?, 6.0)
        }
    };
    let y = x.broadcast_div(&s)?.clamp(-max, max)?;
    let q = if fmt.is_fp4() { round_grid(&y, 1, 0.0)? } else { round_grid(&y, 3, -6.0)? };
    Ok(q.broadcast_mul(&s)?.reshape((t, d))?.to_dtype(DType::BF16)?)
}

/// Baseline insert: [norm] -> RoPE -> fake quant -> scatter_set into the cache.
fn candle_insert(
    cache: &Tensor,
    rows: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    index: &Tensor,
    fmt: QatFormat,
    norm: Option<&RmsNorm>,
) -> Result<()> {
    let x = match norm {
        Some(n) => n.forward(rows)?,
        None => rows.clone(),
    };
    let x = apply_rope_tail(&x, cos, sin)?;
    let x = candle_fake_quant(&x, fmt)?;
    cache.scatter_set(index, &x, 0)?;
    Ok(())
}

/// `[T, D]` u32 row indices for scatter_set into a cache of `rows` rows (every slot must be a
/// row of the cache: candle's scatter asserts on the device otherwise).
fn scatter_index(slots: &[i64], rows: usize, d: usize, dev: &Device) -> Result<Tensor> {
    if let Some(bad) = slots.iter().find(|&&s| s < 0 || s as usize >= rows) {
        anyhow::bail!("bench: slot {bad} outside the cache's {rows} rows")
    }
    let s: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
    Ok(Tensor::from_vec(s, (slots.len(), 1), dev)?.broadcast_as((slots.len(), d))?.contiguous()?)
}

/// The slot layout of a window case: decode = one token per sequence into per-sequence rings;
/// prefill = one sequence into a full-length (paged-style) cache, every token written.
fn window_case(n: usize, is_decode: bool) -> (Vec<usize>, Vec<i64>, usize) {
    if is_decode {
        let pos: Vec<usize> = (0..n).map(|s| 4096 + 37 * s).collect();
        let slots = pos.iter().enumerate().map(|(s, &p)| (s * WINDOW + p % WINDOW) as i64).collect();
        (pos, slots, n * WINDOW)
    } else {
        ((0..n).collect(), (0..n as i64).collect(), n)
    }
}

/// Compressed / index-key cases (ratio 2): decode = B closing groups of B sequences, sequence s
/// owning entries [s * 256, (s + 1) * 256) (its entry index wraps inside); prefill = T/2
/// entries of one sequence.
fn compressed_case(n: usize, is_decode: bool) -> (Vec<usize>, Vec<i64>, usize) {
    if is_decode {
        let pos: Vec<usize> = (0..n).map(|s| 2 * (2048 + 11 * s)).collect();
        let slots =
            pos.iter().enumerate().map(|(s, &p)| (s * ENTRIES_PER_SEQ + (p / 2) % ENTRIES_PER_SEQ) as i64).collect();
        (pos, slots, n * ENTRIES_PER_SEQ)
    } else {
        let g = n / 2;
        ((0..g).map(|j| 2 * j).collect(), (0..g as i64).collect(), g)
    }
}

fn main() -> Result<()> {
    let args: Args = parse_args(&[("rep_ms", "2.0")]);
    let dev = Device::new_cuda(0).context("bench_insert needs a CUDA device")?;
    let cuda = dev.as_cuda_device()?;
    // One stream only: no cross-stream event bookkeeping (it cannot be captured into a graph).
    unsafe { cuda.disable_event_tracking() };
    let stream = cuda.cuda_stream();
    let l2 = l2_bytes(&stream)?;
    let timer = args.common.timer(stream);
    let bench = Bench { timer, args, l2 };
    let plain = RopeTable::new(ROPE_DIM, &RopeKind::Plain { theta: 10000.0 }, &Device::Cpu)?;
    let yarn = RopeTable::new(
        ROPE_DIM,
        &RopeKind::Yarn {
            theta: 160000.0,
            scaling: deepseek_v41::config::YarnScaling {
                factor: 16.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position_embeddings: 65536,
            },
        },
        &Device::Cpu,
    )?;

    println!(
        "V4.1-Flash shapes: H={HEADS} D={HEAD_DIM} R={ROPE_DIM} W={WINDOW} D_I={INDEX_DIM}; L2 {} MiB; \
         GB/s = (bytes read + bytes written) / graph time; ceiling {HBM_READ_GBPS} GB/s (HBM read)",
        bench.l2 >> 20
    );
    println!(
        "{:<24} {:<16} {:>9} {:>9} {:>8} {:>7} {:>8} {:>7} {:>11} {:>9}",
        "op", "case", "loop us", "graph us", "GB/s", "of HBM", "copyGB/s", "of copy", "candle us", "speed-up"
    );

    let decode: Vec<usize> = vec![1, 2, 4, 8, 16, 32, 64, 128, 256];
    let prefill: Vec<usize> = [1024, 4096, 16384, 65536].into_iter().filter(|&t| t <= bench.args.max_prefill).collect();
    let cases: Vec<(String, usize, bool)> = decode
        .iter()
        .map(|&b| (format!("decode B={b}"), b, true))
        .chain(prefill.iter().map(|&t| (format!("prefill T={t}"), t, false)))
        .collect();
    let d = HEAD_DIM;

    // ---- window_insert (Q1) and the packed format A.
    for (case, n, is_decode) in cases.iter().filter(|_| bench.section("window")) {
        let n = *n;
        let (positions, slots, rows) = window_case(n, *is_decode);
        let bytes = (n * (4 * d + 4 * ROPE_DIM + 8)) as f64;
        let sets = bench.sets(bytes + (rows * 2 * d) as f64);
        let (cos, sin) = cos_sin(&plain, &positions, &dev)?;
        let slots_t = Tensor::from_vec(slots.clone(), n, &dev)?;
        let caches: Vec<Tensor> = (0..sets).map(|_| Tensor::zeros((rows, d), DType::BF16, &dev)).collect::<Result<_, _>>()?;
        let kvs: Vec<Tensor> = (0..sets).map(|_| random_bf16(&[n, d], &dev)).collect::<Result<_>>()?;
        let index = scatter_index(&slots, rows, d, &dev)?;
        let mut base = || candle_insert(&caches[0], &kvs[0], &cos, &sin, &index, QatFormat::Fp8Ue8m0B32, None);
        let fused = |i: usize| Ok(window_insert(&caches[i % sets], &kvs[i % sets], &cos, &sin, &slots_t, true)?);
        bench.row("window_insert Q1", case, bytes, sets, fused, Some(&mut base))?;
        // The same rows into the packed format A (528 B per row, 64-token pages).
        let layout = PackedLayout::new(QatFormat::Fp8Ue8m0B32, d, 64)?;
        let packed: Vec<Tensor> = (0..sets).map(|_| layout.zeros(rows.div_ceil(64), &dev)).collect::<Result<_, _>>()?;
        let bytes = (n * (2 * d + layout.row_bytes() + 4 * ROPE_DIM + 8)) as f64;
        let fused = |i: usize| Ok(packed_insert(&packed[i % sets], &layout, &kvs[i % sets], &cos, &sin, &slots_t, None)?);
        bench.row("window_insert packed A", case, bytes, sets, fused, None)?;
    }

    // ---- q RoPE (64 heads x 512): decode B tokens / prefill T tokens.
    for (case, n, _) in cases.iter().filter(|_| bench.section("q_rope")) {
        let n = *n;
        let bytes_in_place = (n * (HEADS * ROPE_DIM * 4 + ROPE_DIM * 4)) as f64;
        let sets = bench.sets(bytes_in_place.max((n * HEADS * HEAD_DIM * 2) as f64));
        let qs: Vec<Tensor> = (0..sets).map(|_| random_bf16(&[n, HEADS, HEAD_DIM], &dev)).collect::<Result<_>>()?;
        let positions: Vec<usize> = (0..n).map(|i| 4096 + i).collect();
        let (cos, sin) = cos_sin(&plain, &positions, &dev)?;
        let mut base = || -> Result<()> {
            apply_rope_tail(&qs[0], &cos, &sin)?;
            Ok(())
        };
        let fused = |i: usize| Ok(q_rope_inplace(&qs[i % sets], &cos, &sin, None)?);
        bench.row("q_rope in place", case, bytes_in_place, sets, fused, Some(&mut base))?;
        let bytes_oop = (n * (HEADS * HEAD_DIM * 4 + ROPE_DIM * 4)) as f64;
        let fused = |i: usize| -> Result<()> {
            q_rope(&qs[i % sets], &cos, &sin, None)?;
            Ok(())
        };
        bench.row("q_rope out of place", case, bytes_oop, sets, fused, None)?;
    }

    // ---- compressed_insert (Q2) and index_key_insert (Q3).
    let k_norm = RmsNorm::from_weight(Tensor::ones(INDEX_DIM, DType::F32, &dev)?, 1e-20)?;
    let k_weight = Tensor::ones(INDEX_DIM, DType::F32, &dev)?;
    for (case, n, is_decode) in &cases {
        let (pos, slots, rows) = compressed_case(*n, *is_decode);
        let g = slots.len();
        let (cos, sin) = cos_sin(&yarn, &pos, &dev)?;
        let slots_t = Tensor::from_vec(slots.clone(), g, &dev)?;

        let bytes = (g * (4 * HEAD_DIM + 4 * ROPE_DIM + 8)) as f64;
        let sets = bench.sets(bytes + (rows * 2 * HEAD_DIM) as f64);
        let caches: Vec<Tensor> =
            (0..sets).map(|_| Tensor::zeros((rows, HEAD_DIM), DType::BF16, &dev)).collect::<Result<_, _>>()?;
        let latents: Vec<Tensor> = (0..sets).map(|_| random_bf16(&[g, HEAD_DIM], &dev)).collect::<Result<_>>()?;
        let index = scatter_index(&slots, rows, HEAD_DIM, &dev)?;
        let mut base = || candle_insert(&caches[0], &latents[0], &cos, &sin, &index, QatFormat::Fp4E4m3B16, None);
        let fused = |i: usize| Ok(compressed_insert(&caches[i % sets], &latents[i % sets], &cos, &sin, &slots_t, true)?);
        bench.row("compressed_insert Q2", case, bytes, sets, fused, Some(&mut base))?;
        // The same entries into the packed format B (288 B per row, 64-entry pages).
        let layout = PackedLayout::new(QatFormat::Fp4E4m3B16, HEAD_DIM, 64)?;
        let packed: Vec<Tensor> = (0..sets).map(|_| layout.zeros(rows.div_ceil(64), &dev)).collect::<Result<_, _>>()?;
        let pbytes = (g * (2 * HEAD_DIM + layout.row_bytes() + 4 * ROPE_DIM + 8)) as f64;
        let fused = |i: usize| Ok(packed_insert(&packed[i % sets], &layout, &latents[i % sets], &cos, &sin, &slots_t, None)?);
        bench.row("compressed packed B", case, pbytes, sets, fused, None)?;
        drop((caches, packed));

        index_key_rows(&bench, case, &cos, &sin, &slots, rows, &k_norm, &k_weight, &dev)?;
    }
    // A ratio-1 source's keys: a 64K-token prefill writes G = 65536 keys.
    if bench.args.max_prefill >= 65536 {
        let g = 65536;
        let (cos, sin) = cos_sin(&yarn, &(0..g).collect::<Vec<_>>(), &dev)?;
        let slots: Vec<i64> = (0..g as i64).collect();
        index_key_rows(&bench, "ratio 1 G=65536", &cos, &sin, &slots, g, &k_norm, &k_weight, &dev)?;
    }
    Ok(())
}

/// index_key_insert (Q3 bf16 rows) and the packed format E for keys `slots` of a cache of `rows`.
#[allow(clippy::too_many_arguments)]
fn index_key_rows(
    bench: &Bench,
    case: &str,
    cos: &Tensor,
    sin: &Tensor,
    slots: &[i64],
    rows: usize,
    k_norm: &RmsNorm,
    k_weight: &Tensor,
    dev: &Device,
) -> Result<()> {
    let g = slots.len();
    let slots_t = Tensor::from_vec(slots.to_vec(), g, dev)?;
    let bytes = (g * (4 * INDEX_DIM + 4 * ROPE_DIM + 8)) as f64;
    let sets = bench.sets(bytes + (rows * 2 * INDEX_DIM) as f64);
    let kcaches: Vec<Tensor> =
        (0..sets).map(|_| Tensor::zeros((rows, INDEX_DIM), DType::BF16, dev)).collect::<Result<_, _>>()?;
    let k_pres: Vec<Tensor> = (0..sets).map(|_| random_bf16(&[g, INDEX_DIM], dev)).collect::<Result<_>>()?;
    let kindex = scatter_index(slots, rows, INDEX_DIM, dev)?;
    let mut base =
        || candle_insert(&kcaches[0], &k_pres[0], cos, sin, &kindex, QatFormat::Fp4Ue8m0B32, Some(k_norm));
    let fused = |i: usize| {
        Ok(index_key_insert(&kcaches[i % sets], &k_pres[i % sets], k_weight, 1e-20, cos, sin, &slots_t, true)?)
    };
    bench.row("index_key_insert Q3", case, bytes, sets, fused, Some(&mut base))?;
    // The same keys into the packed format E (68 B per row, 64-key pages).
    let layout = PackedLayout::new(QatFormat::Fp4Ue8m0B32, INDEX_DIM, 64)?;
    let packed: Vec<Tensor> = (0..sets).map(|_| layout.zeros(rows.div_ceil(64), dev)).collect::<Result<_, _>>()?;
    let pbytes = (g * (2 * INDEX_DIM + layout.row_bytes() + 4 * ROPE_DIM + 8)) as f64;
    let fused = |i: usize| {
        Ok(packed_insert(&packed[i % sets], &layout, &k_pres[i % sets], cos, sin, &slots_t, Some((k_weight, 1e-20)))?)
    };
    bench.row("index_key packed E", case, pbytes, sets, fused, None)?;
    Ok(())
}
