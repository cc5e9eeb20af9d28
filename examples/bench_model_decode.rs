//! Decode steps of a whole model for B sequences at once (issue 23, deliverable 6): the
//! embedded model (or any model folder) loaded as `generate` loads it, B sequences prefilled with
//! ragged prompts, then greedy decode steps of [`Model::forward_batch`] with one token per
//! sequence — the eager batched step as the library runs it today — next to the
//! single-sequence `Model::forward` step that `generate` runs.
//!
//! ```text
//! cargo build --release --features cuda --example bench_model_decode
//! bench_model_decode [--model models/v41-shakespeare-tiny] [--batch 1,8,64,256] [--steps 24]
//!     [--prompt-len 16] [--device cuda|cpu] [--moe-on-device] [--cache bf16|packed]
//! ```
//!
//! Per B: the median wall time of a decode step (host work, launches and the device, ended by
//! reading the B chosen ids — the step's one device → host read of the sampling; on the
//! device: argmax of the logits), aggregate tokens/s (B / step), and the prefill time of the
//! ragged prompts (lengths `prompt-len / 2 ..= prompt-len`, one batched call). `B = 1 single`:
//! the same decode steps through `Model::forward` on one cache. Tokens are random ids from a
//! fixed seed (not text): the step's work does not depend on them.
//!
//! Not measured here: a graph-captured step (the decode step still runs host-driven Candle ops
//! with host-side positions, `docs/architecture.md`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use clap::{Parser, ValueEnum};
use deepseek_v41::attention::CacheStorage;
use deepseek_v41::model::{BatchItem, ModelCache, Pretrained};
use deepseek_v41::numerics::Numerics;

#[path = "support/repo_files.rs"]
mod repo_files;
use repo_files::repo_file;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum CacheArg {
    Bf16,
    Packed,
}

#[derive(Parser)]
#[command(about = "Batched decode steps of a whole model (eager), next to the single-sequence step")]
struct Args {
    /// Model folder (release format); default: the embedded model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,256")]
    batch: Vec<usize>,
    /// Decode steps measured per batch size (after 3 warm-up steps).
    #[arg(long, default_value_t = 24)]
    steps: usize,
    /// Longest prompt; prompts are `prompt-len / 2 ..= prompt-len` tokens.
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cuda)]
    device: DeviceArg,
    /// The whole MoE on the device (`cuda::with_device_routing`).
    #[arg(long)]
    moe_on_device: bool,
    #[arg(long, value_enum, default_value_t = CacheArg::Bf16)]
    cache: CacheArg,
}

/// xorshift64*: deterministic token ids.
struct Ids(u64);
impl Ids {
    fn next(&mut self, below: usize) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as u32 % below as u32
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Greedy ids of `logits` `[B, vocab]`, read to the host (the step's one read).
fn greedy(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1::<u32>()?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.moe_on_device {
        #[cfg(feature = "cuda")]
        return deepseek_v41::cuda::with_device_routing(|| run(&args));
        #[cfg(not(feature = "cuda"))]
        bail!("--moe-on-device needs a build with --features cuda");
    }
    run(&args)
}

fn run(args: &Args) -> Result<()> {
    if args.steps == 0 || args.prompt_len < 2 || args.batch.contains(&0) {
        bail!("--steps and every --batch must be > 0 and --prompt-len >= 2")
    }
    let device = match args.device {
        DeviceArg::Cpu => Device::Cpu,
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda => deepseek_v41::cuda::decode_device(0)?,
        #[cfg(not(feature = "cuda"))]
        DeviceArg::Cuda => bail!("--device cuda needs a build with --features cuda"),
    };
    let storage = match args.cache {
        CacheArg::Bf16 => CacheStorage::Bf16,
        CacheArg::Packed => CacheStorage::Packed,
    };
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => repo_file("models/v41-shakespeare-tiny"),
    };
    let dtype = if device.is_cuda() { DType::BF16 } else { DType::F32 };
    let t0 = Instant::now();
    let p = Pretrained::load_dir(&dir, Numerics::REFERENCE, dtype, &device).with_context(|| format!("loading {}", dir.display()))?;
    println!(
        "model {} on {:?} ({dtype:?}, cache {:?}, moe on device: {}), loaded in {:.2}s",
        dir.display(),
        args.device,
        args.cache,
        args.moe_on_device,
        t0.elapsed().as_secs_f64()
    );
    let max_b = args.batch.iter().copied().max().unwrap_or(1);
    if args.prompt_len + args.steps + 3 > p.model.max_positions() {
        bail!("--prompt-len + --steps + 3 exceeds the model's {} positions", p.model.max_positions())
    }
    let vocab = p.model.vocab_size();
    let mut ids = Ids(0x9e37_79b9_7f4a_7c15);
    let prompts: Vec<Vec<u32>> = (0..max_b)
        .map(|i| {
            let len = args.prompt_len / 2 + i % (args.prompt_len - args.prompt_len / 2 + 1);
            (0..len).map(|_| ids.next(vocab)).collect()
        })
        .collect();

    println!("| B | prefill (one call) ms | decode step ms (median of {}) | tokens/s |", args.steps);
    println!("|---|---|---|---|");
    for &b in &args.batch {
        let mut caches: Vec<ModelCache> = (0..b).map(|_| p.new_cache_with(storage)).collect::<candle_core::Result<_>>()?;
        let t = Instant::now();
        let mut items: Vec<BatchItem> = caches.iter_mut().zip(&prompts).map(|(c, pr)| BatchItem::new(pr, c)).collect();
        let mut next = greedy(&p.model.forward_batch(&mut items)?.logits)?;
        let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut times = Vec::with_capacity(args.steps);
        for step in 0..args.steps + 3 {
            let t = Instant::now();
            let toks: Vec<[u32; 1]> = next.iter().map(|&id| [id]).collect();
            let mut items: Vec<BatchItem> = caches.iter_mut().zip(&toks).map(|(c, tk)| BatchItem::new(tk, c)).collect();
            next = greedy(&p.model.forward_batch(&mut items)?.logits)?;
            if step >= 3 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let ms = median(times);
        println!("| {b} | {prefill_ms:.1} | {ms:.3} | {:.0} |", b as f64 / ms * 1e3);
    }

    // The single-sequence step of `generate`.
    let mut cache = p.new_cache_with(storage)?;
    let logits = p.model.forward(&prompts[0], &mut cache)?;
    let mut next = greedy(&logits.narrow(0, logits.dim(0)? - 1, 1)?)?[0];
    let mut times = Vec::with_capacity(args.steps);
    for step in 0..args.steps + 3 {
        let t = Instant::now();
        next = greedy(&p.model.forward(&[next], &mut cache)?)?[0];
        if step >= 3 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let ms = median(times);
    println!("| 1 single (`Model::forward`) | | {ms:.3} | {:.0} |", 1e3 / ms);
    Ok(())
}
