//! Decode steps of a whole model for B sequences at once (issue 23, deliverable 6): the
//! embedded model (or any model folder) loaded as `generate` loads it, B sequences prefilled with
//! ragged prompts, then greedy decode steps of [`Model::forward_batch`] with one token per
//! sequence — the eager batched step as the library runs it today — next to the
//! single-sequence `Model::forward` step that `generate` runs.
//!
//! ```text
//! cargo build --release --features cuda --example bench_model_decode
//! bench_model_decode [--model models/v41-shakespeare-tiny] [--batch 1,8,64,256] [--steps 24]
//!     [--prompt-len 16] [--device cuda|cpu] [--moe-on-device] [--cache bf16|packed] [--graph
//!     [--census] [--profile-replay]] [--random-step-model]
//! ```
//!
//! Per B: the median wall time of a decode step (host work, launches and the device, ended by
//! reading the B chosen ids — the step's one device → host read of the sampling; on the
//! device: argmax of the logits), aggregate tokens/s (B / step), and the prefill time of the
//! ragged prompts (lengths `prompt-len / 2 ..= prompt-len`, one batched call). `B = 1 single`:
//! the same decode steps through `Model::forward` on one cache. Tokens are random ids from a
//! fixed seed (not text): the step's work does not depend on them.
//!
//! `--graph` (CUDA): per B also the whole-model step `model::ModelDecodeStep` over the same
//! prefilled sequences, eager (`update` + `forward` + the greedy ids read back) and captured
//! once into a CUDA graph and replayed after each `update` (`update` + replay + the ids read
//! back; of that the host's part; the followed step, `GraphedDecodeStep::step_next_ids`: tokens and
//! Engram ids written on the device, each step enqueued before the ids of the one it follows are
//! read back, so the host's part overlaps the GPU; and one replay alone back to back; `--census` lists the graph's
//! nodes by kernel), when the model's layers are ones the step composes and it reads nothing back
//! (`ModelDecodeStep::host_reads`); otherwise it prints why and skips
//! (`docs/architecture.md`, "The whole-model decode step"). `--random-step-model` replaces the
//! loaded model with random weights on the tiny config as released (every layer kind) at head_dim
//! 512 with MXFP4 routed experts (random token ids): the step at the widths of the fused attention.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use clap::{Parser, ValueEnum};
use deepseek_v41::attention::CacheStorage;
use deepseek_v41::config::Config;
use deepseek_v41::model::{BatchItem, Model, ModelCache, Pretrained, TokenMap};
use deepseek_v41::numerics::Numerics;

#[path = "support/repo_files.rs"]
mod repo_files;
use repo_files::repo_file;

#[path = "../tests/support/mxfp4_experts.rs"]
#[allow(dead_code)]
mod mxfp4_experts;

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
    /// Also time `ModelDecodeStep`, eager and replayed from a CUDA graph (CUDA only).
    #[arg(long)]
    graph: bool,
    /// With `--graph`: print the captured graph's nodes by kernel (most frequent first) for each B.
    #[arg(long)]
    census: bool,
    /// With `--graph`: one more replay of each B's graph between `cuProfilerStart` and
    /// `cuProfilerStop`, for a profiler started with its collection off (`ncu --profile-from-start
    /// off --graph-profiling node`: each kernel of the step timed alone).
    #[arg(long)]
    profile_replay: bool,
    /// Time a random model (the tiny config, head_dim 512, MXFP4 experts) instead of a loaded one.
    #[arg(long)]
    random_step_model: bool,
}

/// The model the bench runs: a loaded folder or the random step model.
struct Loaded {
    config: Config,
    model: Model,
    device: Device,
    dtype: DType,
}

impl Loaded {
    fn new_cache_with(&self, storage: CacheStorage) -> candle_core::Result<ModelCache> {
        ModelCache::with_storage(&self.config, storage, self.dtype, &self.device)
    }
}

/// The tiny config as released (every layer kind: window-only, ratio-2 and ratio-1 sources, reuse,
/// candidate blocks) with head_dim 512 (what the fused attention takes), random weights with
/// MXFP4 routed experts (`tests/support/mxfp4_experts.rs`).
fn random_step_model(device: &Device) -> Result<Loaded> {
    let mut cfg = Config::from_file(repo_file("tests/fixtures/v41-tiny/config.json"))?;
    cfg.head_dim = 512;
    let config = cfg.resolve()?;
    let vb = mxfp4_experts::Mxfp4Experts::new(23).var_builder(DType::BF16, device);
    let model = Model::new(&config, Numerics::REFERENCE, Some(TokenMap::div2(config.vocab_size)), vb)?;
    Ok(Loaded { config, model, device: device.clone(), dtype: DType::BF16 })
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
    let (p, name) = if args.random_step_model {
        (random_step_model(&device)?, "random step model (tiny config, head_dim 512, MXFP4 experts)".to_string())
    } else {
        let p = Pretrained::load_dir(&dir, Numerics::REFERENCE, dtype, &device).with_context(|| format!("loading {}", dir.display()))?;
        (Loaded { config: p.config, model: p.model, device: p.device, dtype: p.dtype }, dir.display().to_string())
    };
    let dtype = p.dtype;
    println!(
        "model {name} on {:?} ({dtype:?}, cache {:?}, moe on device: {}), loaded in {:.2}s",
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
    let mut graph_rows = Vec::new();
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
        if args.graph {
            match graph::time(&p, &caches, &next, storage, args.steps, args.census, args.profile_replay) {
                Ok(r) => graph_rows.push(format!("| {b} | {ms:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {} |", r.eager, r.step, r.host, r.followed, r.replay, r.nodes)),
                Err(e) => {
                    println!("\n--graph skipped: {e:#}\n");
                    break;
                }
            }
        }
    }
    if !graph_rows.is_empty() {
        println!(
            "\n| B | forward_batch step ms | ModelDecodeStep eager ms | graph step ms (update + replay + ids) | of which host (update + launch) | followed step ms (step_next_ids) | replay alone ms | graph nodes |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        graph_rows.iter().for_each(|r| println!("{r}"));
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

/// The `--graph` timings.
mod graph {
    use anyhow::{bail, Result};
    use deepseek_v41::attention::CacheStorage;
    use deepseek_v41::model::ModelCache;

    use super::Loaded;

    /// The `--graph` figures of one B (median ms).
    pub struct Row {
        /// The eager step: `update` + `forward` + the greedy ids read back.
        pub eager: f64,
        /// The graph step: `update` + replay + the ids read back.
        pub step: f64,
        /// Of which the host's part: `update` and the launch, before the read waits.
        pub host: f64,
        /// One replay alone, back to back at unchanged inputs (device time per step).
        pub replay: f64,
        /// A followed step (`step_next_ids`: enqueued before the ids of the step it follows are
        /// read, which arrive while it runs): the time between two such calls.
        pub followed: f64,
        /// Nodes of the graph.
        pub nodes: usize,
    }

    /// The eager `ModelDecodeStep` and its graph replay over the sequences of `caches` (their
    /// next tokens `next`), `steps` steps after 3 warm-ups; `census` prints the graph's nodes by
    /// kernel.
    #[cfg(feature = "cuda")]
    pub fn time(p: &Loaded, caches: &[ModelCache], next: &[u32], storage: CacheStorage, steps: usize, census: bool, profile: bool) -> Result<Row> {
        use std::time::Instant;

        use candle_core::{DType, Tensor, D};
        use deepseek_v41::model::GraphedDecodeStep;
        use deepseek_v41::sampling::{SamplingBatch, SamplingParams};

        if !p.device.is_cuda() {
            bail!("--graph needs --device cuda")
        }
        let b = caches.len();
        let start: Vec<usize> = caches.iter().map(ModelCache::seq_len).collect();
        let capacity = start.iter().max().copied().unwrap_or(0) + 3 * (steps + 3) + 2;
        let mut eager = model_step(p, caches, capacity, storage)?;
        let reads = eager.host_reads();
        if !reads.is_empty() {
            bail!("the step would read the device from the host: {}", reads.join("; "))
        }
        let greedy = |logits: &Tensor| -> Result<Vec<u32>> { Ok(logits.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1::<u32>()?) };
        let mut toks = next.to_vec();
        let mut pos = start.clone();
        let mut times = Vec::with_capacity(steps);
        for step in 0..steps + 3 {
            let t = Instant::now();
            eager.update(&toks, &pos)?;
            toks = greedy(&eager.forward()?)?;
            if step >= 3 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            pos.iter_mut().for_each(|q| *q += 1);
        }
        let eager_ms = super::median(times);

        let sampling = SamplingBatch::new(vec![SamplingParams::GREEDY; b], vec![0; b], &p.device)?;
        let (mut toks, mut pos) = (next.to_vec(), start);
        let mut graphed = GraphedDecodeStep::capture(model_step(p, caches, capacity, storage)?, sampling, &toks, &pos)?;
        let graph = &graphed.graphs()[0].1;
        let nodes = graph.nodes();
        if census {
            let list = graph.census()?;
            let count = |f: &dyn Fn(&str) -> bool| list.iter().filter(|(name, _)| f(name)).map(|(_, n)| n).sum::<usize>();
            let (alloc, free, copy) = (count(&|k| k == "mem_alloc"), count(&|k| k == "mem_free"), count(&|k| k == "memcpy" || k == "memset"));
            println!("\nB = {b}: {nodes} graph nodes = {} kernels and other nodes + {alloc} allocations + {free} frees + {copy} copies / sets; by kernel:", nodes - alloc - free - copy);
            for (name, n) in list {
                println!("  {n:5}  {name}");
            }
        }
        // One replay alone: back to back at the last inputs (a repeated step changes nothing).
        let reps = 20;
        graph.replay()?;
        p.device.synchronize()?;
        let t = Instant::now();
        for _ in 0..reps {
            graph.replay()?;
        }
        p.device.synchronize()?;
        let replay = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
        if profile {
            use candle_core::cuda_backend::cudarc::driver::sys;
            // SAFETY: plain driver calls on the current context; no pointers are passed.
            unsafe { sys::cuProfilerStart() }.result()?;
            graph.replay()?;
            p.device.synchronize()?;
            unsafe { sys::cuProfilerStop() }.result()?;
        }
        let (mut times, mut host) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
        toks = graphed.ids()?.to_vec1::<u32>()?;
        pos.iter_mut().for_each(|q| *q += 1);
        for step in 0..steps + 3 {
            let t = Instant::now();
            graphed.step(&toks, &pos, &vec![0; b])?;
            let launched = t.elapsed().as_secs_f64() * 1e3;
            toks = graphed.ids()?.to_vec1::<u32>()?;
            if step >= 3 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
                host.push(launched);
            }
            pos.iter_mut().for_each(|q| *q += 1);
        }
        // Followed steps: each enqueued before the ids of the one it follows are read back.
        let mut followed = Vec::with_capacity(steps);
        let mut t = Instant::now();
        for step in 0..steps + 3 {
            let ids = graphed.step_next_ids(&vec![0; b])?;
            if ids.len() != b {
                bail!("step_next_ids returned {} ids for {b} sequences", ids.len())
            }
            if step >= 3 {
                followed.push(t.elapsed().as_secs_f64() * 1e3);
            }
            t = Instant::now();
        }
        p.device.synchronize()?;
        Ok(Row { eager: eager_ms, step: super::median(times), host: super::median(host), replay, followed: super::median(followed), nodes })
    }

    /// A step over the sequences of `caches`, `capacity` tokens each.
    #[cfg(feature = "cuda")]
    fn model_step<'p>(p: &'p Loaded, caches: &[ModelCache], capacity: usize, storage: CacheStorage) -> Result<deepseek_v41::model::ModelDecodeStep<'p>> {
        let storage = deepseek_v41::attention::BatchStorage::uniform(storage);
        let mut s = deepseek_v41::model::ModelDecodeStep::new(&p.config, &p.model, caches.len(), capacity, storage, &p.device)?;
        for (i, c) in caches.iter().enumerate() {
            s.load(i, c)?;
        }
        Ok(s)
    }

    /// Without the `cuda` feature there is no graph to time.
    #[cfg(not(feature = "cuda"))]
    pub fn time(_: &Loaded, _: &[ModelCache], _: &[u32], _: CacheStorage, _: usize, _: bool, _: bool) -> Result<Row> {
        bail!("--graph needs a build with --features cuda")
    }
}
