//! Benchmark of the fused CUDA cache inserts and query RoPE (`deepseek_v41::cuda`) with
//! DeepSeek-V4.1-Flash shapes (64 heads x 512, rope 64, window 128, index head 128), against
//! the same computation written with plain Candle ops on the same GPU.
//!
//! Timing: CUDA events recorded on candle's stream around `iters` back-to-back calls, after a
//! warm-up; the median over `reps` repetitions, per call. A call's time includes its host-side
//! work whenever the host is the bottleneck (small decode batches), as an application sees it.
//! Bandwidth: the minimum bytes the fused kernel must move (reads of the inputs, cos/sin and
//! slots, writes of the cache rows) divided by the time, against the H200's 4.17 TB/s.
//!
//! The Candle baseline computes RoPE with `nn::rope::apply_rope_tail` and the fake quant with
//! elementwise ops (log/exp/round; timing only, its numerics are approximate), then writes the
//! rows with `scatter_set`.
//!
//! Run: `cargo run --release --features cuda --example bench_insert` (needs a CUDA GPU).

use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::cuda_backend::cudarc::driver::{sys::CUevent_flags, CudaStream};
use candle_core::{DType, Device, Module, Tensor};
use clap::Parser;
use deepseek_v41::cuda::{
    compressed_insert, index_key_insert, packed_insert, q_rope, q_rope_inplace, window_insert, PackedLayout,
};
use deepseek_v41::nn::rms_norm::RmsNorm;
use deepseek_v41::nn::rope::{apply_rope_tail, RopeKind, RopeTable};
use deepseek_v41::quant::QatFormat;

const HBM_GBPS: f64 = 4170.0;
const HEADS: usize = 64;
const HEAD_DIM: usize = 512;
const ROPE_DIM: usize = 64;
const WINDOW: usize = 128;
const INDEX_DIM: usize = 128;

#[derive(Parser, Debug)]
struct Args {
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 11)]
    reps: usize,
    /// Warm-up calls before timing.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Target time of one repetition in milliseconds (sets the calls per repetition).
    #[arg(long, default_value_t = 4.0)]
    rep_ms: f64,
    /// Largest prefill length.
    #[arg(long, default_value_t = 65536)]
    max_prefill: usize,
    /// Skip the plain-Candle baseline.
    #[arg(long)]
    no_baseline: bool,
}

struct Bench {
    stream: Arc<CudaStream>,
    args: Args,
}

impl Bench {
    /// Median milliseconds per call of `f`.
    fn time(&self, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        for _ in 0..self.args.warmup.max(1) {
            f()?;
        }
        self.stream.synchronize()?;
        // Calibrate the number of calls per repetition.
        let probe = self.span(3, &mut f)?;
        let iters = ((self.args.rep_ms / probe.max(1e-4)) as usize).clamp(3, 5000);
        let mut samples: Vec<f64> =
            (0..self.args.reps.max(1)).map(|_| self.span(iters, &mut f)).collect::<Result<_>>()?;
        samples.sort_by(|a, b| a.total_cmp(b));
        Ok(samples[samples.len() / 2])
    }

    fn span(&self, iters: usize, f: &mut impl FnMut() -> Result<()>) -> Result<f64> {
        let start = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for _ in 0..iters {
            f()?;
        }
        let end = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        Ok(start.elapsed_ms(&end)? as f64 / iters as f64)
    }

    /// Times the fused op and (unless disabled) the baseline, prints one table row.
    fn row(
        &self,
        op: &str,
        case: &str,
        bytes: f64,
        fused: impl FnMut() -> Result<()>,
        base: Option<&mut dyn FnMut() -> Result<()>>,
    ) -> Result<()> {
        let t = self.time(fused)?;
        let gbps = bytes / (t * 1e-3) / 1e9;
        let base = match base {
            Some(b) if !self.args.no_baseline => match self.time(b) {
                Ok(tb) => format!("{:>11.2} {:>8.1}x", tb * 1e3, tb / t),
                Err(e) => format!("  baseline failed: {e}"),
            },
            _ => String::new(),
        };
        println!("{op:<22} {case:<16} {:>10.2} {:>9.1} {:>7.1}% {base}", t * 1e3, gbps, 100.0 * gbps / HBM_GBPS);
        Ok(())
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

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::new_cuda(0).context("bench_insert needs a CUDA device")?;
    let stream = dev.as_cuda_device()?.cuda_stream();
    let bench = Bench { stream, args };
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

    println!("V4.1-Flash shapes: H={HEADS} D={HEAD_DIM} R={ROPE_DIM} W={WINDOW} D_I={INDEX_DIM}; HBM ceiling {HBM_GBPS} GB/s");
    println!(
        "{:<22} {:<16} {:>10} {:>9} {:>8} {:>11} {:>9}",
        "op", "case", "fused us", "GB/s", "of HBM", "candle us", "speed-up"
    );

    let decode: Vec<usize> = vec![1, 2, 4, 8, 16, 32, 64, 128, 256];
    let prefill: Vec<usize> = [1024, 4096, 16384, 65536].into_iter().filter(|&t| t <= bench.args.max_prefill).collect();
    let cases: Vec<(String, usize, bool)> = decode
        .iter()
        .map(|&b| (format!("decode B={b}"), b, true))
        .chain(prefill.iter().map(|&t| (format!("prefill T={t}"), t, false)))
        .collect();

    // ---- window_insert (Q1): decode = one token per sequence into per-sequence rings;
    //      prefill = one sequence into a full-length (paged-style) cache, every token written.
    for (case, n, is_decode) in &cases {
        let (n, d) = (*n, HEAD_DIM);
        let (positions, slots, rows): (Vec<usize>, Vec<i64>, usize) = if *is_decode {
            let pos: Vec<usize> = (0..n).map(|s| 4096 + 37 * s).collect();
            let slots = pos.iter().enumerate().map(|(s, &p)| (s * WINDOW + p % WINDOW) as i64).collect();
            (pos, slots, n * WINDOW)
        } else {
            ((0..n).collect(), (0..n as i64).collect(), n)
        };
        let cache = Tensor::zeros((rows, d), DType::BF16, &dev)?;
        let kv = random_bf16(&[n, d], &dev)?;
        let (cos, sin) = cos_sin(&plain, &positions, &dev)?;
        let slots_t = Tensor::from_vec(slots.clone(), n, &dev)?;
        let index = scatter_index(&slots, rows, d, &dev)?;
        let bytes = (n * (4 * d + 4 * ROPE_DIM + 8)) as f64;
        let mut base = || candle_insert(&cache, &kv, &cos, &sin, &index, QatFormat::Fp8Ue8m0B32, None);
        bench.row(
            "window_insert Q1",
            case,
            bytes,
            || Ok(window_insert(&cache, &kv, &cos, &sin, &slots_t, true)?),
            Some(&mut base),
        )?;
        // The same rows into the packed format A (528 B per row, 64-token pages).
        let layout = PackedLayout::new(QatFormat::Fp8Ue8m0B32, d, 64)?;
        let packed = layout.zeros(rows.div_ceil(64), &dev)?;
        let bytes = (n * (2 * d + layout.row_bytes() + 4 * ROPE_DIM + 8)) as f64;
        bench.row(
            "window_insert packed A",
            case,
            bytes,
            || Ok(packed_insert(&packed, &layout, &kv, &cos, &sin, &slots_t, None)?),
            None,
        )?;
    }

    // ---- q RoPE in place (64 heads x 512): decode B tokens / prefill T tokens.
    for (case, n, _) in &cases {
        let n = *n;
        let q = random_bf16(&[n, HEADS, HEAD_DIM], &dev)?;
        let positions: Vec<usize> = (0..n).map(|i| 4096 + i).collect();
        let (cos, sin) = cos_sin(&plain, &positions, &dev)?;
        let bytes = (n * (HEADS * ROPE_DIM * 4 + ROPE_DIM * 4)) as f64;
        let mut base = || -> Result<()> {
            apply_rope_tail(&q, &cos, &sin)?;
            Ok(())
        };
        bench.row("q_rope in place", case, bytes, || Ok(q_rope_inplace(&q, &cos, &sin, None)?), Some(&mut base))?;
        let bytes_oop = (n * (HEADS * HEAD_DIM * 4 + ROPE_DIM * 4)) as f64;
        bench.row(
            "q_rope out of place",
            case,
            bytes_oop,
            || {
                q_rope(&q, &cos, &sin, None)?;
                Ok(())
            },
            None,
        )?;
    }

    // ---- compressed_insert (Q2) and index_key_insert (Q3): decode = B closing groups of B
    //      sequences (ratio 2); prefill = T/2 entries of one ratio-2 sequence.
    let k_norm = RmsNorm::from_weight(Tensor::ones(INDEX_DIM, DType::F32, &dev)?, 1e-20)?;
    let k_weight = Tensor::ones(INDEX_DIM, DType::F32, &dev)?;
    for (case, n, is_decode) in &cases {
        let g = if *is_decode { *n } else { n / 2 };
        let (pos, slots, rows): (Vec<usize>, Vec<i64>, usize) = if *is_decode {
            // Sequence s owns entries [s * 4096, (s + 1) * 4096); its entry index p / 2 can pass
            // 4096 for large B, so it wraps inside the sequence's region (every slot in range).
            let pos: Vec<usize> = (0..g).map(|s| 2 * (2048 + 11 * s)).collect();
            let slots = pos.iter().enumerate().map(|(s, &p)| (s * 4096 + (p / 2) % 4096) as i64).collect();
            (pos, slots, g * 4096)
        } else {
            ((0..g).map(|j| 2 * j).collect(), (0..g as i64).collect(), g)
        };
        let (cos, sin) = cos_sin(&yarn, &pos, &dev)?;
        let slots_t = Tensor::from_vec(slots.clone(), g, &dev)?;

        let cache = Tensor::zeros((rows, HEAD_DIM), DType::BF16, &dev)?;
        let latent = random_bf16(&[g, HEAD_DIM], &dev)?;
        let index = scatter_index(&slots, rows, HEAD_DIM, &dev)?;
        let bytes = (g * (4 * HEAD_DIM + 4 * ROPE_DIM + 8)) as f64;
        let mut base = || candle_insert(&cache, &latent, &cos, &sin, &index, QatFormat::Fp4E4m3B16, None);
        bench.row(
            "compressed_insert Q2",
            case,
            bytes,
            || Ok(compressed_insert(&cache, &latent, &cos, &sin, &slots_t, true)?),
            Some(&mut base),
        )?;

        let kcache = Tensor::zeros((rows, INDEX_DIM), DType::BF16, &dev)?;
        let k_pre = random_bf16(&[g, INDEX_DIM], &dev)?;
        let kindex = scatter_index(&slots, rows, INDEX_DIM, &dev)?;
        let bytes = (g * (4 * INDEX_DIM + 4 * ROPE_DIM + 8)) as f64;
        let mut base = || candle_insert(&kcache, &k_pre, &cos, &sin, &kindex, QatFormat::Fp4Ue8m0B32, Some(&k_norm));
        bench.row(
            "index_key_insert Q3",
            case,
            bytes,
            || Ok(index_key_insert(&kcache, &k_pre, &k_weight, 1e-20, &cos, &sin, &slots_t, true)?),
            Some(&mut base),
        )?;
    }
    Ok(())
}
