//! Text generation with DeepSeek V4.1 on Candle.
//!
//! ```text
//! cargo run --release --example generate                       # embedded Shakespeare model
//! cargo run --release --example generate -- --prompt "HAMLET." --temperature 0
//! cargo run --release --example generate -- --model path/to/folder --chat --prompt "Hi"
//! ```
//!
//! `--model` is a name from `weights.toml` or a local folder holding `config.json`, the
//! checkpoint and `tokenizer.json`. BOS is prepended; the prompt is printed, then the
//! continuation streams as it is produced; a final line reports tokens/s (prefill included) and
//! the decode steps' own rate.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use clap::{Parser, ValueEnum};
use deepseek_v41::attention::CacheStorage;
use deepseek_v41::generation::{generate, Sampler, Sampling};
use deepseek_v41::model::Pretrained;
use deepseek_v41::tokenizer::ChatPrompt;
use deepseek_v41::hub::{fetch, HubCheckpoint, HubOptions, HubWeights};
use deepseek_v41::weights::{WeightFiles, WeightsCatalog, WeightsSource};
use deepseek_v41::Numerics;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DTypeArg {
    Bf16,
    F32,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum NumericsArg {
    /// The reference's trained numerics (QAT fake quant + FP8 activation quantization).
    Reference,
    /// No fake quant, no activation quantization.
    Plain,
}

#[derive(Parser, Debug)]
#[command(about = "Generate text with DeepSeek V4.1 (default: the embedded Shakespeare model)")]
struct Args {
    /// A model name from weights.toml, or a local model folder.
    #[arg(long)]
    model: Option<String>,
    /// The prompt.
    #[arg(long, default_value = "ROMEO:")]
    prompt: String,
    /// Render the prompt with the V4.1 chat template (needs a tokenizer with role tokens).
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 120)]
    max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    #[arg(long, default_value_t = 0.95)]
    top_p: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// Activation dtype.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DTypeArg,
    #[arg(long, value_enum, default_value = "reference")]
    numerics: NumericsArg,
    /// Cache rows: bf16, or the packed V4.1 formats (same tokens, ~3.6x smaller long-range
    /// caches; needs the `cuda` feature and `--numerics reference`).
    #[arg(long, value_enum, default_value = "bf16")]
    cache: CacheArg,
    /// After generating, replay the decode steps of the generated tokens on a fresh cache and
    /// report the mean time per step: the model's forward call (on CUDA: launching the step's
    /// work, plus the MoE routing reads) and the sampling (on CUDA: waiting for the device).
    #[arg(long)]
    profile: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum CacheArg {
    Bf16,
    Packed,
}

fn catalog() -> Result<WeightsCatalog> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../weights.toml");
    WeightsCatalog::load(&path).with_context(|| format!("reading {}", path.display()))
}

/// The local folder of `--model` (a catalog name or a path).
fn model_dir(model: Option<&str>) -> Result<PathBuf> {
    if let Some(m) = model {
        let p = PathBuf::from(m);
        if p.is_dir() {
            return Ok(p);
        }
    }
    let cat = catalog()?;
    let entry = match model {
        Some(name) => cat.get(name)?,
        None => cat.default_model()?,
    };
    match entry.source()? {
        WeightsSource::Local { .. } => cat.local_dir(entry).context("local entry without a folder"),
        WeightsSource::Hub { repo, revision } => {
            let weights = match entry.weight_files() {
                WeightFiles::Index(i) => HubWeights::Index(i.to_string()),
                WeightFiles::Files(f) => HubWeights::Files(f.to_vec()),
            };
            let extra: Vec<String> = std::iter::once(entry.config.clone()).chain(entry.tokenizer.clone()).collect();
            let spec = HubCheckpoint::new(repo, revision, weights).with_extra_files(extra);
            let fetched = fetch(&spec, &HubOptions::from_env()).with_context(|| format!("downloading {repo}@{revision}"))?;
            // Every file of a revision lands in the same snapshot folder of the hub cache.
            let config = fetched.extra_files.first().context("hub fetch returned no config")?;
            Ok(config.parent().context("config path has no folder")?.to_path_buf())
        }
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = match args.device {
        DeviceArg::Cpu => Device::Cpu,
        // The library's decode setup (no per-buffer CUDA events, a pool that keeps its memory).
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda => deepseek_v41::cuda::decode_device(0)?,
        #[cfg(not(feature = "cuda"))]
        DeviceArg::Cuda => Device::new_cuda(0)?,
    };
    let dtype = match args.dtype {
        DTypeArg::Bf16 => DType::BF16,
        DTypeArg::F32 => DType::F32,
    };
    let numerics = match args.numerics {
        NumericsArg::Reference => Numerics::REFERENCE,
        NumericsArg::Plain => Numerics::PLAIN,
    };
    let dir = model_dir(args.model.as_deref())?;
    let t0 = Instant::now();
    let p = Pretrained::load_dir(&dir, numerics, dtype, &device).with_context(|| format!("loading {}", dir.display()))?;
    eprintln!("loaded {} in {:.2}s", dir.display(), t0.elapsed().as_secs_f64());

    let prompt_ids = if args.chat {
        ChatPrompt::new(args.prompt.clone()).encode(&p.tokenizer)?
    } else {
        p.tokenizer.encode(&args.prompt, true)?
    };
    let mut sampler = Sampler::new(Sampling { temperature: args.temperature, top_p: args.top_p, seed: args.seed })?;
    let storage = match args.cache {
        CacheArg::Bf16 => CacheStorage::Bf16,
        CacheArg::Packed => CacheStorage::Packed,
    };
    let mut cache = p.new_cache_with(storage)?;
    let mut stream = p.tokenizer.stream(true);
    let mut out = std::io::stdout();
    write!(out, "{}", args.prompt)?;
    out.flush()?;
    let eos = p.tokenizer.eos_id();
    let t1 = Instant::now();
    let mut first_token = None;
    let new = generate(&p.model, &mut cache, &prompt_ids, args.max_new_tokens, &mut sampler, Some(eos), |id| {
        first_token.get_or_insert_with(Instant::now);
        if let Some(text) = stream.push(id)? {
            write!(out, "{text}").map_err(candle_core::Error::wrap)?;
            out.flush().map_err(candle_core::Error::wrap)?;
        }
        Ok(())
    })?;
    let done = Instant::now();
    if let Some(text) = stream.finish()? {
        write!(out, "{text}")?;
    }
    let secs = t1.elapsed().as_secs_f64();
    // The decode steps alone: from the first new token (after the prefill) to the last.
    let steps = new.len().saturating_sub(1);
    let decode = first_token.map_or(0.0, |t| (done - t).as_secs_f64());
    println!();
    eprintln!(
        "{} prompt + {} new tokens in {:.2}s: {:.1} tokens/s{}; decode {steps} steps: {:.2} ms/step, {:.1} tokens/s",
        prompt_ids.len(),
        new.len(),
        secs,
        new.len() as f64 / secs,
        if new.last() == Some(&eos) { " (stopped at EOS)" } else { "" },
        1e3 * decode / steps.max(1) as f64,
        steps as f64 / decode.max(f64::MIN_POSITIVE)
    );
    if args.profile {
        profile_steps(&p, storage, &prompt_ids, &new, &mut sampler)?;
    }
    Ok(())
}

/// Replays the decode steps of `new` (after a prefill of `prompt`) on a fresh cache and prints
/// the mean time per step of the forward call and of the sampling (`--profile`).
fn profile_steps(p: &Pretrained, storage: CacheStorage, prompt: &[u32], new: &[u32], sampler: &mut Sampler) -> Result<()> {
    let mut cache = p.new_cache_with(storage)?;
    let logits = p.model.forward(prompt, &mut cache)?;
    sampler.sample(&logits.narrow(0, logits.dim(0)? - 1, 1)?.squeeze(0)?)?;
    let steps = new.len().saturating_sub(1);
    let (mut forward, mut sample) = (0f64, 0f64);
    for &id in &new[..steps] {
        let t0 = Instant::now();
        let logits = p.model.forward(&[id], &mut cache)?;
        let t1 = Instant::now();
        sampler.sample(&logits.squeeze(0)?)?;
        forward += (t1 - t0).as_secs_f64();
        sample += t1.elapsed().as_secs_f64();
    }
    let ms = |s: f64| 1e3 * s / steps.max(1) as f64;
    eprintln!(
        "profile: {steps} decode steps, per step {:.3} ms = forward call {:.3} ms + sample (device wait, argmax/top-p) {:.3} ms",
        ms(forward + sample),
        ms(forward),
        ms(sample)
    );
    Ok(())
}
