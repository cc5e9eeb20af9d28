//! Text generation with DeepSeek V4.1 on Candle.
//!
//! ```text
//! cargo run --release --example generate                       # embedded Shakespeare model
//! cargo run --release --example generate -- --prompt "HAMLET." --temperature 0
//! cargo run --release --example generate -- --model path/to/folder --chat --prompt "Hi"
//! ```
//!
//! `--model` is a name from the model catalog (`weights.toml`, built into the binary; `--weights`
//! or `DEEPSEEK_V41_WEIGHTS` name another file) or a local folder holding `config.json`, the
//! checkpoint and `tokenizer.json`. Every setting, the prompt's length against the model's
//! context and the chat template are checked before the weights load. BOS is prepended; the
//! prompt is printed, then the continuation streams as it is produced; a final line reports the
//! prefill and decode speeds separately. On a terminal, loading (bytes of the checkpoint read)
//! and long prefills (chunks of 512 tokens) show progress bars on stderr; nothing is drawn when
//! stderr is piped.
//!
//! `--ranks N` runs the model expert-parallel as N ranks (threads; `deepseek_v41::parallel`):
//! each holds 1/N of every MoE layer's routed experts, and the same tokens come out.
//!
//! `--dry-run` reads only `config.json` (a folder holding nothing else will do, e.g.
//! `--model tests/fixtures/deepseek-v41-flash`) and prints what loading it with the given
//! `--device`, `--dtype`, `--quantized-weights` and `--engram-placement` would place where
//! (`loader::LoadPlan`: bytes per component, on the device and mapped on the host, and the caches
//! per token), then a total line; it needs no GPU and no CUDA build.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};
use deepseek_v41::attention::CacheStorage;
use deepseek_v41::generation::{generate, Sampler, Sampling, SteppedGeneration};
use deepseek_v41::hub::{fetch, HubCheckpoint, HubOptions, HubWeights};
use deepseek_v41::input::check_context;
use deepseek_v41::loader::{LoadPlan, PlanDevice, PlanOptions, QuantizedWeights, ReleaseCheckpoint};
use deepseek_v41::model::{EngramPlacement, LoadOptions, ModelCache, Pretrained};
use deepseek_v41::parallel::{run_ranks, Collective, LocalGroup};
use deepseek_v41::tokenizer::{ChatPrompt, Tokenizer};
use deepseek_v41::weights::{WeightFiles, WeightsCatalog, WeightsEntry, WeightsSource};
use deepseek_v41::{Config, Numerics};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
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

#[derive(Clone, Copy, Debug, ValueEnum)]
enum CacheArg {
    Bf16,
    Packed,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum QuantizedWeightsArg {
    Native,
    Dequantized,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum EngramPlacementArg {
    Auto,
    Device,
    Host,
}

#[derive(Parser, Debug)]
#[command(about = "Generate text with DeepSeek V4.1 (default: the embedded Shakespeare model)")]
struct Args {
    /// A model name from the catalog (listed below), or a local model folder.
    #[arg(long)]
    model: Option<String>,
    /// The model catalog to read instead of the built-in one (also: env DEEPSEEK_V41_WEIGHTS);
    /// its relative `local` folders are relative to the file.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The prompt.
    #[arg(long, default_value = "ROMEO:", allow_hyphen_values = true)]
    prompt: String,
    /// Render the prompt with the V4.1 chat template (needs a tokenizer with role tokens).
    #[arg(long)]
    chat: bool,
    /// Most new tokens; the prompt plus these must fit the model's max_position_embeddings.
    #[arg(long, default_value_t = 120, allow_negative_numbers = true)]
    max_new_tokens: usize,
    /// Finite and >= 0; 0 = greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f64,
    /// Nucleus mass in (0, 1]; 1 = no truncation.
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    top_p: f64,
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
    /// `cuda` needs a binary built with `--features cuda`.
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
    /// FP8 weights on CUDA: kept as stored (FP8 kernels, about half the memory of bf16), or
    /// dequantized to bf16 at load (the baseline). No effect on the CPU.
    #[arg(long, value_enum, default_value = "native")]
    quantized_weights: QuantizedWeightsArg,
    /// Engram tables: auto keeps small ones on the device and leaves ones over 1 GiB (the
    /// released ~100 GB tables) in the memory-mapped checkpoint, read by rows each step; device
    /// and host force one or the other (same tokens).
    #[arg(long, value_enum, default_value = "auto")]
    engram_placement: EngramPlacementArg,
    /// After generating, replay the decode steps of the generated tokens on a fresh cache and
    /// report the mean time per step: the model's forward call (on CUDA: launching the step's
    /// work, plus the MoE routing reads) and the sampling (on CUDA: waiting for the device).
    #[arg(long)]
    profile: bool,
    /// Read only config.json and print the bytes loading would place per component, on the
    /// device and on the host (no weights read, no tokenizer, no device needed).
    #[arg(long)]
    dry_run: bool,
    /// On CUDA, read every MoE layer's routing decision back to the host and loop over the experts
    /// there (the library's default). Without it, `generate --device cuda` keeps the MoE on the
    /// device: the routing kernel and, with MXFP4 experts, the grouped expert kernels
    /// (`cuda::with_device_routing`: weight streaming for decode, the tensor-core GEMM for
    /// prefill; no host read inside a layer's MoE). The two pick different experts only at
    /// near-ties of the router's scores (`docs/numerics.md`).
    #[arg(long)]
    host_routing: bool,
    /// On CUDA, replay every decode step from a CUDA graph: the prompt's cache loaded into the
    /// library's batched decode step for one sequence, captured once (`generation::SteppedGeneration`;
    /// each step follows the last on the device, its token read back while the next one runs).
    /// Its kernels sum in another order than the default path's, so a token may differ at a
    /// near-tie of the logits. Needs MXFP4 routed experts.
    #[arg(long)]
    graph: bool,
    /// Expert parallelism: run the model as this many ranks, threads of this process, each
    /// holding 1/N of every MoE layer's routed experts (only those read from the checkpoint)
    /// and exchanging the routed tokens' rows with the others; rank 0 runs the prompt. With
    /// `--device cuda` rank r runs on GPU r mod (GPUs). The same tokens as one rank.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// With --ranks on CUDA: exchange the routed rows over NCCL, one rank per GPU (needs a build
    /// with `--features nccl`, and as many GPUs as ranks), instead of through host memory.
    #[arg(long)]
    nccl: bool,
}

/// Prompts longer than this are prefilled in chunks of this many tokens (progress on a terminal).
const PREFILL_CHUNK: usize = 512;

const LOAD_BAR: &str = "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}, eta {eta}";
const PREFILL_BAR: &str = "{msg} [{bar:30}] {pos}/{len} tokens, {per_sec}, eta {eta}";

const CUDA_HINT: &str = "this binary was built without CUDA support; rebuild it with `--features cuda` \
     (e.g. `cargo run --release --features cuda --example generate -- --device cuda`, see docs/cuda.md)";

/// The catalog: `--weights`, else `DEEPSEEK_V41_WEIGHTS`, else the built-in one.
fn catalog(path: Option<&Path>) -> Result<WeightsCatalog> {
    let path = path.map(Path::to_path_buf).or_else(|| std::env::var_os("DEEPSEEK_V41_WEIGHTS").map(PathBuf::from));
    Ok(match path {
        Some(p) => WeightsCatalog::load(&p)?,
        None => WeightsCatalog::embedded()?,
    })
}

/// The catalog's names and descriptions, for `--help`.
fn catalog_help() -> String {
    let Ok(cat) = WeightsCatalog::embedded() else { return String::new() };
    let mut s = String::from("Models of the built-in catalog (--model NAME):\n");
    for m in cat.models() {
        let mark = if m.default { " (default)" } else { "" };
        let tok = if m.tokenizer.is_none() { " [no tokenizer: cannot generate]" } else { "" };
        s += &format!("  {}{mark}{tok}\n      {}\n", m.name, m.description);
    }
    s
}

/// Whether `--model` was meant as a path rather than a catalog name.
fn looks_like_path(m: &str) -> bool {
    m.contains('/') || m.contains('\\') || m.starts_with('.') || m.starts_with('~') || Path::new(m).exists()
}

/// The local folder of `--model` (a catalog name or a path), checked to hold a config and a
/// tokenizer.
fn model_dir(args: &Args) -> Result<PathBuf> {
    match model_source(args)? {
        ModelSource::Local(dir) => Ok(dir),
        ModelSource::Hub { entry, repo, revision } => download(&entry, &repo, &revision),
    }
}

/// Where `--model` is: a local folder, or a catalog entry to download.
enum ModelSource {
    Local(PathBuf),
    Hub { entry: Box<WeightsEntry>, repo: String, revision: String },
}

/// The local folder of `--model`, or the catalog entry and its hub repository and revision
/// when it must be downloaded.
fn model_source(args: &Args) -> Result<ModelSource> {
    if let Some(m) = args.model.as_deref() {
        let p = PathBuf::from(m);
        if p.is_dir() {
            return Ok(ModelSource::Local(p));
        }
        if p.exists() {
            bail!("--model {m}: this is a file; give a model folder (config.json, the checkpoint, tokenizer.json) or a catalog name")
        }
        if looks_like_path(m) {
            bail!("--model {m}: model folder not found; give an existing folder (config.json, the checkpoint, tokenizer.json) or a catalog name (see --help)")
        }
    }
    let cat = catalog(args.weights.as_deref())?;
    let entry = match args.model.as_deref() {
        Some(name) => cat.get_for_generation(name).context("--model: give a catalog name, or a local folder")?,
        None => cat.default_model()?,
    };
    match entry.source()? {
        WeightsSource::Local(local) => {
            let dir = cat.local_dir(entry).context("local entry without a folder")?;
            local_entry_dir(&entry.name, local, dir).map(ModelSource::Local)
        }
        WeightsSource::Hub { repo, revision } => Ok(ModelSource::Hub { entry: Box::new(entry.clone()), repo: repo.to_string(), revision: revision.to_string() }),
    }
}

/// A local catalog entry's folder: relative folders of the built-in catalog are looked up from
/// the current directory, then from the repository the binary was built in (if it still exists).
fn local_entry_dir(name: &str, local: &Path, dir: PathBuf) -> Result<PathBuf> {
    if dir.is_dir() {
        return Ok(dir);
    }
    let built_in_repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(local);
    if local.is_relative() && built_in_repo.is_dir() {
        return Ok(built_in_repo);
    }
    bail!(
        "model `{name}` is the folder {} (relative to the repository root), which is not found from {}: \
         run from the repository root, pass --model <folder>, or --weights <weights.toml>",
        dir.display(),
        std::env::current_dir().map_or_else(|_| "here".into(), |d| d.display().to_string())
    )
}

fn download(entry: &WeightsEntry, repo: &str, revision: &str) -> Result<PathBuf> {
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

fn tokenizer_file(dir: &Path) -> Result<PathBuf> {
    ["tokenizer.json", "tokenizer.json.gz"].iter().map(|n| dir.join(n)).find(|p| p.is_file()).with_context(|| {
        format!("{} has no tokenizer.json: generation needs a tokenizer to encode the prompt", dir.display())
    })
}

/// A progress bar on stderr over `len` units (terminal), or nothing (piped).
fn bar(len: u64, msg: String, template: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len).with_message(msg);
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Errors print as one line of causes (`error: what: why`), exit status 1.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let matches = Args::command().after_help(catalog_help()).get_matches();
    let args = match Args::from_arg_matches(&matches) {
        Ok(args) => args,
        Err(e) => e.exit(),
    };
    #[cfg(feature = "cuda")]
    if args.device == DeviceArg::Cuda && !args.host_routing {
        return deepseek_v41::cuda::with_device_routing(|| run_args(args));
    }
    run_args(args)
}

/// [`run`] after parsing the arguments.
fn run_args(args: Args) -> Result<()> {
    // Everything that does not need the weights is checked first.
    let sampling = Sampling { temperature: args.temperature, top_p: args.top_p, seed: args.seed };
    sampling.validate().context("check --temperature and --top-p")?;
    if args.dry_run {
        return dry_run(&args);
    }
    let device = match args.device {
        DeviceArg::Cpu => Device::Cpu,
        // The library's decode setup (no per-buffer CUDA events, a pool that keeps its memory).
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda => deepseek_v41::cuda::decode_device(0)?,
        #[cfg(not(feature = "cuda"))]
        DeviceArg::Cuda => bail!("--device cuda: {CUDA_HINT}"),
    };
    if args.graph && args.device != DeviceArg::Cuda {
        bail!("--graph replays CUDA graphs: add --device cuda")
    }
    let storage = match args.cache {
        CacheArg::Bf16 => CacheStorage::Bf16,
        CacheArg::Packed if cfg!(feature = "cuda") => CacheStorage::Packed,
        CacheArg::Packed => bail!("--cache packed: {CUDA_HINT}"),
    };
    let dtype = dtype_of(args.dtype);
    let numerics = match args.numerics {
        NumericsArg::Reference => Numerics::REFERENCE,
        NumericsArg::Plain => Numerics::PLAIN,
    };
    let dir = model_dir(&args)?;
    let config = Config::from_file(dir.join("config.json")).with_context(|| format!("loading {}", dir.display()))?;
    let tokenizer = Tokenizer::from_file(tokenizer_file(&dir)?)?;
    let prompt_ids = if args.chat {
        ChatPrompt::new(args.prompt.clone())
            .encode(&tokenizer)
            .with_context(|| format!("--chat: the tokenizer of {} has no V4.1 chat template tokens", dir.display()))?
    } else {
        tokenizer.encode(&args.prompt, true)?
    };
    check_context(prompt_ids.len(), args.max_new_tokens, config.max_position_embeddings)
        .context("check --prompt and --max-new-tokens")?;

    let options = LoadOptions { quantized: quantized_of(args.quantized_weights), engram: engram_of(args.engram_placement) };
    let run = Run { args: &args, dir: &dir, device: &device, numerics, dtype, storage, sampling, prompt_ids: &prompt_ids };
    if args.ranks != 1 || args.nccl {
        return run.ranks(config, tokenizer, options);
    }
    let t0 = Instant::now();
    let ckpt = ReleaseCheckpoint::open_dir(&dir).with_context(|| format!("loading {}", dir.display()))?;
    let loading = bar(ckpt.stored_bytes(), format!("loading {}", dir.display()), LOAD_BAR);
    let counter = loading.clone();
    ckpt.set_progress(move |bytes| counter.inc(bytes));
    let p = Pretrained::load_with(config, tokenizer, ckpt, numerics, dtype, &device, options)
        .with_context(|| format!("loading {}", dir.display()))?;
    loading.finish_and_clear();
    eprintln!("loaded {} in {:.2}s", dir.display(), t0.elapsed().as_secs_f64());
    run.text(&p)
}

/// What [`run_args`] settled before loading the weights.
struct Run<'a> {
    args: &'a Args,
    dir: &'a Path,
    device: &'a Device,
    numerics: Numerics,
    dtype: DType,
    storage: CacheStorage,
    sampling: Sampling,
    prompt_ids: &'a [u32],
}

impl Run<'_> {
    /// The prompt's continuation streamed to stdout, then the speed line on stderr.
    fn text(&self, p: &Pretrained) -> Result<()> {
        let (args, prompt_ids) = (self.args, self.prompt_ids);
        let mut sampler = Sampler::new(self.sampling)?;
        let mut cache = p.new_cache_with(self.storage)?;
        let mut stream = p.tokenizer.stream(true);
        let mut out = std::io::stdout();
        write!(out, "{}", args.prompt)?;
        out.flush()?;
        let eos = p.tokenizer.eos_id();
        let t1 = Instant::now();
        let tail = prefill_head(p, &mut cache, prompt_ids)?;
        let mut first_token = None;
        let mut emit = |id| {
            first_token.get_or_insert_with(Instant::now);
            if let Some(text) = stream.push(id)? {
                write!(out, "{text}").map_err(candle_core::Error::wrap)?;
                out.flush().map_err(candle_core::Error::wrap)?;
            }
            Ok(())
        };
        let new = if args.graph {
            SteppedGeneration { model: &p.model, config: &p.config, graph: true }
                .generate(&mut cache, tail, args.max_new_tokens, &mut sampler, Some(eos), &mut emit)
                .context("--graph: the decode step could not run as a CUDA graph (run without --graph)")?
        } else {
            generate(&p.model, &mut cache, tail, args.max_new_tokens, &mut sampler, Some(eos), &mut emit)?
        };
        let done = Instant::now();
        if let Some(text) = stream.finish()? {
            write!(out, "{text}")?;
        }
        println!();
        // Prefill: the prompt's forward calls and the first token; decode: every later token.
        let prefill = first_token.map_or(done - t1, |t| t - t1).as_secs_f64();
        let steps = new.len().saturating_sub(1);
        let decode = first_token.map_or(0.0, |t| (done - t).as_secs_f64());
        eprintln!(
            "prefill: {} prompt tokens in {prefill:.2}s ({:.1} tokens/s); decode: {steps} tokens in {decode:.2}s \
             ({:.1} tokens/s, {:.2} ms/token); {} new tokens{}",
            prompt_ids.len(),
            prompt_ids.len() as f64 / prefill.max(f64::MIN_POSITIVE),
            steps as f64 / decode.max(f64::MIN_POSITIVE),
            1e3 * decode / steps.max(1) as f64,
            new.len(),
            if new.last() == Some(&eos) { " (stopped at EOS)" } else { "" },
        );
        if args.profile {
            profile_steps(p, self.storage, prompt_ids, &new, &mut sampler)?;
        }
        Ok(())
    }

    /// `--ranks N`: the ranks as threads (`parallel::run_local_ranks`), each loading its share of
    /// the experts; rank 0 generates, every rank then serves the others until all are done.
    fn ranks(&self, config: Config, tokenizer: Tokenizer, options: LoadOptions) -> Result<()> {
        let (args, n) = (self.args, self.args.ranks);
        if n == 0 {
            bail!("--ranks 0: give 1 or more ranks")
        }
        if n > config.n_routed_experts {
            bail!("--ranks {n}: the model has {} routed experts per layer; give at most that many ranks", config.n_routed_experts)
        }
        if args.graph || args.profile {
            bail!("--ranks {n}: --graph and --profile run one rank's decode step; run them without --ranks")
        }
        let devices = rank_devices(self.device, n)?;
        let comms: Vec<Arc<dyn Collective>> = if args.nccl {
            nccl_group(&devices)?
        } else {
            LocalGroup::ranks(n).into_iter().map(|c| Arc::new(c) as Arc<dyn Collective>).collect()
        };
        let t0 = Instant::now();
        run_ranks(comms, |comm| -> candle_core::Result<()> {
            let r = comm.rank();
            let on_rank = || -> Result<()> {
                let ckpt = ReleaseCheckpoint::open_dir(self.dir).with_context(|| format!("rank {r}: loading {}", self.dir.display()))?;
                let (config, tokenizer) = (config.clone(), tokenizer.clone());
                let p = Pretrained::load_rank(config, tokenizer, ckpt, self.numerics, self.dtype, &devices[r], options, comm)
                    .with_context(|| format!("rank {r}: loading {}", self.dir.display()))?;
                if r == 0 {
                    eprintln!("loaded {} as {n} expert-parallel ranks in {:.2}s", self.dir.display(), t0.elapsed().as_secs_f64());
                    self.text(&p)?;
                }
                Ok(p.model.serve_until_done()?)
            };
            #[cfg(feature = "cuda")]
            if args.device == DeviceArg::Cuda && !args.host_routing {
                return deepseek_v41::cuda::with_device_routing(on_rank).map_err(|e| candle_core::Error::Msg(format!("{e:#}")));
            }
            on_rank().map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
        })?;
        Ok(())
    }
}

/// `--nccl`: an NCCL group over the ranks' GPUs.
#[cfg(feature = "nccl")]
fn nccl_group(devices: &[Device]) -> Result<Vec<Arc<dyn Collective>>> {
    if !devices.iter().all(Device::is_cuda) {
        bail!("--nccl exchanges device buffers: add --device cuda")
    }
    let group = deepseek_v41::parallel::NcclRank::group(devices).context("--nccl: one rank per GPU (give at most as many --ranks as GPUs)")?;
    Ok(group.into_iter().map(|c| Arc::new(c) as Arc<dyn Collective>).collect())
}

#[cfg(not(feature = "nccl"))]
fn nccl_group(_: &[Device]) -> Result<Vec<Arc<dyn Collective>>> {
    bail!("--nccl: this binary was built without NCCL; rebuild it with `--features nccl` (DSV41_NCCL=1 source scripts/cuda-env.sh installs libnccl)")
}

/// The device of each of `n` ranks: `first` (the CPU, or GPU 0) for rank 0; on CUDA GPU r mod
/// (GPUs) for rank r.
fn rank_devices(first: &Device, n: usize) -> Result<Vec<Device>> {
    let mut devices = vec![first.clone()];
    #[cfg(feature = "cuda")]
    if first.is_cuda() {
        let gpus = candle_core::cuda_backend::cudarc::driver::result::device::get_count()? as usize;
        for r in 1..n {
            devices.push(match r % gpus.max(1) {
                0 => first.clone(),
                g => deepseek_v41::cuda::decode_device(g)?,
            });
        }
        return Ok(devices);
    }
    devices.resize(n, first.clone());
    Ok(devices)
}

fn dtype_of(arg: DTypeArg) -> DType {
    match arg {
        DTypeArg::Bf16 => DType::BF16,
        DTypeArg::F32 => DType::F32,
    }
}

fn quantized_of(arg: QuantizedWeightsArg) -> QuantizedWeights {
    match arg {
        QuantizedWeightsArg::Native => QuantizedWeights::Native,
        QuantizedWeightsArg::Dequantized => QuantizedWeights::Dequantized,
    }
}

fn engram_of(arg: EngramPlacementArg) -> EngramPlacement {
    match arg {
        EngramPlacementArg::Auto => EngramPlacement::Auto,
        EngramPlacementArg::Device => EngramPlacement::Device,
        EngramPlacementArg::Host => EngramPlacement::Host,
    }
}

/// `--dry-run`: the load plan of the model's `config.json` for the chosen device, dtype,
/// quantized-weights policy and Engram placement, and a total line. Reads nothing else.
fn dry_run(args: &Args) -> Result<()> {
    let dir = match model_source(args)? {
        ModelSource::Local(dir) => dir,
        ModelSource::Hub { entry, repo, .. } => bail!(
            "--dry-run: `{}` is downloaded from the hub ({repo}); pass --model <folder> holding its config.json (no weights needed)",
            entry.name
        ),
    };
    let path = dir.join("config.json");
    let config = Config::from_file(&path).with_context(|| format!("--dry-run reads {}", path.display()))?;
    let device = match args.device {
        DeviceArg::Cpu => PlanDevice::Cpu,
        DeviceArg::Cuda => PlanDevice::Cuda,
    };
    let options = PlanOptions {
        dtype: dtype_of(args.dtype),
        device,
        quantized: quantized_of(args.quantized_weights),
        engram: engram_of(args.engram_placement),
    };
    let plan = LoadPlan::new(&config, options);
    print!("{plan}");
    let (per_token, storage) = match args.cache {
        CacheArg::Bf16 => (plan.cache.per_token_rows, "bf16 rows"),
        CacheArg::Packed => (plan.cache.per_token_packed, "packed"),
    };
    println!(
        "dry run of {}: {:.3} GB ({} B) on {}, {:.3} GB mapped on the host, {:.3} GB stored; cache ({storage}) {per_token:.1} B/token; no weights read",
        dir.display(),
        plan.device_bytes() as f64 / 1e9,
        plan.device_bytes(),
        device.name(),
        plan.host_bytes() as f64 / 1e9,
        plan.stored_bytes() as f64 / 1e9
    );
    Ok(())
}

/// Prefills all but the last chunk of a long prompt in [`PREFILL_CHUNK`]-token calls, with a
/// progress bar on a terminal; returns the rest of the prompt (never empty).
fn prefill_head<'a>(p: &Pretrained, cache: &mut ModelCache, prompt: &'a [u32]) -> Result<&'a [u32]> {
    let head = prompt.len().saturating_sub(1) / PREFILL_CHUNK * PREFILL_CHUNK;
    if head == 0 {
        return Ok(prompt);
    }
    let progress = bar(prompt.len() as u64, "prefill".into(), PREFILL_BAR);
    for chunk in prompt[..head].chunks(PREFILL_CHUNK) {
        p.model.forward(chunk, cache)?;
        progress.inc(chunk.len() as u64);
    }
    progress.finish_and_clear();
    Ok(&prompt[head..])
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
