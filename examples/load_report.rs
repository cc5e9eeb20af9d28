//! Loads a model folder the public way (`Pretrained::load_with`, what `Pretrained::load_dir_with`
//! runs after opening the folder) and reports what loading costs: stored bytes read, wall time
//! and GB/s, peak host memory, and — on CUDA — device memory, against the bytes the loaded
//! model's weights hold.
//!
//! ```text
//! cargo run --release --example load_report                                  # embedded model, CPU
//! cargo run --release --example load_report -- /tmp/v41-flash
//! cargo run --release --features cuda --example load_report -- /tmp/v41-flash --device cuda
//! cargo run --release --features cuda --example load_report -- /tmp/v41-flash --device cuda --quantized-weights dequantized
//! cargo run --release --example load_report -- /tmp/v41-flash --engram-placement host
//! ```
//!
//! Linux only (reads `/proc/self/status`). Reported:
//! * **stored**: the checkpoint's text-model tensors (scales included; MTP / vision tensors are
//!   not loaded, spec §10), and the bytes the loader read (its progress callback);
//! * **time**: config + tokenizer + opening the checkpoint, then the model build (the Engram
//!   token map, every tensor read, dequantized where the model keeps it dense, moved to the
//!   device; on CUDA until the device is synchronized); GB/s = stored bytes read / total time;
//! * **host**: the process's peak RSS (`VmHWM`) before and after, and the peaks of `RssAnon`
//!   (heap: tensors and temporaries) and `RssFile` (pages of the memory-mapped checkpoint)
//!   sampled every millisecond by a second thread during the load, and the peak `RssAnon` rise as
//!   a multiple of the largest stored tensor on CUDA (the staging bar of `docs/perf.md` "Loading");
//! * **held**: the bytes of the model's linears (`Model::linears`, `LinearWeight::bytes`: dense,
//!   or FP8 / MXFP4 codes plus scales where kept as stored), routed experts among them, plus the other
//!   tensors the loader placed (`ReleaseCheckpoint::placed_bytes`: embedding in the activation
//!   dtype, grouped `wo_a` as the linears hold their weights (FP8 as stored under native), resident Engram tables bf16, norms / mHC /
//!   router / sinks f32) and the 128 KiB decode table of each Engram table left in host memory
//!   (`Model::engram_placements`); one line per Engram table says where it went
//!   (`--engram-placement`, `model::EngramPlacement`);
//! * **plan**: the load plan of the config (`loader::LoadPlan`, printed first, with the same Engram
//!   placement) checked against what the loader placed, tensor by tensor and in total, to the
//!   byte: any difference is listed and the report exits with an error;
//! * **device** (CUDA, feature `cuda`): `total − free` (`cuMemGetInfo`) before and after loading
//!   and its sampled peak, and the high-water mark of the memory pool candle allocates from
//!   (`examples/support/bench.rs` `PoolPeak`: tensors only, transients included, no context or
//!   cuBLAS workspace); the ratio of the device bytes added by loading to the stored bytes.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::Parser;
use deepseek_v41::config::Config;
use deepseek_v41::loader::plan::Place;
use deepseek_v41::loader::{LoadPlan, PlanDevice, PlanOptions, QuantizedWeights, ReleaseCheckpoint, NON_TEXT_PREFIXES, NON_TEXT_SUFFIXES};
use deepseek_v41::model::{EngramLocation, EngramPlacement, LoadOptions, Pretrained};
use deepseek_v41::nn::LinearWeight;
use deepseek_v41::tokenizer::Tokenizer;
use deepseek_v41::Numerics;

#[cfg(feature = "cuda")]
#[path = "support/bench.rs"]
mod bench;

#[path = "support/repo_files.rs"]
mod repo_files;

/// The default model (from the repository root).
const DEFAULT_MODEL: &str = "models/v41-shakespeare-tiny";
const GB: f64 = 1e9;
const MIB: f64 = (1 << 20) as f64;

#[derive(Parser)]
#[command(about = "Load a model folder and report time, throughput, host and device memory")]
struct Args {
    /// Model folder (config.json, checkpoint, tokenizer.json or tokenizer.json.gz; default: the
    /// embedded model, models/v41-shakespeare-tiny).
    model: Option<PathBuf>,
    /// Device to load onto.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// How quantized weights are held (takes effect on CUDA only, see `loader::QuantizedWeights`).
    #[arg(long, default_value = "native", value_parser = ["native", "dequantized"])]
    quantized_weights: String,
    /// Where the Engram tables live (see `model::EngramPlacement`): auto keeps tables over 1 GiB
    /// as bf16 in the memory-mapped checkpoint, read by rows.
    #[arg(long, default_value = "auto", value_parser = ["auto", "device", "host"])]
    engram_placement: String,
}

/// The `kB` fields of `/proc/self/status`, in bytes.
fn status() -> Result<HashMap<String, u64>> {
    let text = std::fs::read_to_string("/proc/self/status").context("/proc/self/status (Linux only)")?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            let kb: u64 = v.trim().strip_suffix(" kB")?.trim().parse().ok()?;
            Some((k.to_string(), kb * 1024))
        })
        .collect())
}

fn field(s: &HashMap<String, u64>, k: &str) -> u64 {
    s.get(k).copied().unwrap_or(0)
}

fn show(when: &str, s: &HashMap<String, u64>) {
    println!(
        "host   {when:<7} VmHWM {:9.1} MiB  VmRSS {:9.1} MiB  (RssAnon {:9.1} MiB, RssFile {:9.1} MiB)",
        field(s, "VmHWM") as f64 / MIB,
        field(s, "VmRSS") as f64 / MIB,
        field(s, "RssAnon") as f64 / MIB,
        field(s, "RssFile") as f64 / MIB,
    );
}

/// Device memory in use: `total − free` of the device (`cuMemGetInfo`), and the memory pool
/// candle allocates from (`None` on devices without pools).
#[cfg(feature = "cuda")]
struct Gpu {
    ctx: Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>,
    pool: Option<bench::PoolPeak>,
}

#[cfg(feature = "cuda")]
impl Gpu {
    fn new(device: &Device) -> Result<Self> {
        let stream = device.as_cuda_device()?.cuda_stream();
        let pool = bench::PoolPeak::new(&stream).ok();
        Ok(Self { ctx: stream.context().clone(), pool })
    }

    /// `(total − free, total)` bytes.
    fn used(&self) -> Result<(u64, u64)> {
        used(&self.ctx)
    }
}

/// `(total − free, total)` bytes of `ctx`'s device (binds `ctx` to the calling thread).
#[cfg(feature = "cuda")]
fn used(ctx: &candle_core::cuda_backend::cudarc::driver::CudaContext) -> Result<(u64, u64)> {
    let (free, total) = ctx.mem_get_info()?;
    Ok(((total - free) as u64, total as u64))
}

/// What the sampler thread saw: peaks of RssAnon, RssFile, their sum, and device `total − free`.
#[derive(Default)]
struct Peaks {
    anon: u64,
    file: u64,
    sum: u64,
    device: u64,
}

/// Samples every millisecond until `stop` is set; `device_used` reads device memory in use.
fn sample(stop: Arc<AtomicBool>, device_used: Option<Box<dyn Fn() -> u64 + Send>>) -> Peaks {
    let mut p = Peaks::default();
    while !stop.load(Ordering::Relaxed) {
        if let Ok(s) = status() {
            let (a, f) = (field(&s, "RssAnon"), field(&s, "RssFile"));
            (p.anon, p.file, p.sum) = (p.anon.max(a), p.file.max(f), p.sum.max(a + f));
        }
        if let Some(used) = &device_used {
            p.device = p.device.max(used());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    p
}

/// Stored bytes (weight plus scale) of every text-model tensor the model loads.
fn stored_text_bytes(ckpt: &ReleaseCheckpoint) -> Result<u64> {
    let mut bytes = 0u64;
    for name in text_names(ckpt) {
        let info = ckpt.info(&name)?;
        bytes += (info.stored.byte_range.len() + info.scale.map_or(0, |s| s.byte_range.len())) as u64;
    }
    Ok(bytes)
}

/// Logical tensors of the text model (not MTP / vision, not the unused `bias_vl`).
fn text_names(ckpt: &ReleaseCheckpoint) -> Vec<String> {
    ckpt.names()
        .into_iter()
        .filter(|n| !NON_TEXT_PREFIXES.iter().any(|p| n.starts_with(p)) && !NON_TEXT_SUFFIXES.iter().any(|s| n.ends_with(s)))
        .collect()
}

/// The differences between the plan's device tensors and what the loader placed (by name, to
/// the byte), and between the totals; empty when they agree.
fn plan_differences(plan: &LoadPlan, placed: &BTreeMap<String, u64>) -> Vec<String> {
    let planned: BTreeMap<&str, u64> = plan.tensors.iter().filter(|t| t.place == Place::Device).map(|t| (t.name.as_str(), t.held_bytes)).collect();
    let mut out: Vec<String> = planned
        .iter()
        .filter(|(n, &b)| placed.get(**n) != Some(&b))
        .map(|(n, b)| format!("{n}: planned {b} B, placed {:?}", placed.get(*n)))
        .collect();
    out.extend(placed.keys().filter(|n| !planned.contains_key(n.as_str())).map(|n| format!("{n}: placed, not planned on the device")));
    let total: u64 = placed.values().sum();
    if total != plan.device_bytes() {
        out.push(format!("total: planned {} B, placed {total} B", plan.device_bytes()));
    }
    out
}

fn gb(b: u64) -> f64 {
    b as f64 / GB
}

fn main() -> Result<()> {
    let args = Args::parse();
    let model_dir = args.model.clone().unwrap_or_else(|| repo_files::repo_file(DEFAULT_MODEL));
    let dtype = DType::BF16;
    let quantized = match args.quantized_weights.as_str() {
        "native" => QuantizedWeights::Native,
        _ => QuantizedWeights::Dequantized,
    };
    let engram: EngramPlacement = args.engram_placement.parse().map_err(anyhow::Error::msg)?;
    let device = match args.device.as_str() {
        "cpu" => Device::Cpu,
        _ if cfg!(feature = "cuda") => Device::new_cuda(0).context("--device cuda needs a CUDA device")?,
        _ => bail!("--device cuda: build with --features cuda"),
    };
    #[cfg(feature = "cuda")]
    let gpu = if device.is_cuda() { Some(Gpu::new(&device)?) } else { None };

    println!("model  {}", model_dir.display());
    let on_disk: u64 = {
        let ckpt = ReleaseCheckpoint::open_dir(&model_dir)?;
        ckpt.files().iter().map(|f| std::fs::metadata(f).map(|m| m.len())).sum::<std::io::Result<u64>>()?
    };
    println!(
        "device {}, quantized weights {quantized}, Engram placement {engram}, activations {dtype:?}; checkpoint on disk {:.3} GB",
        args.device,
        gb(on_disk)
    );

    let before = status()?;
    show("before", &before);
    #[cfg(feature = "cuda")]
    let dev_before = gpu.as_ref().map(|g| g.used()).transpose()?;
    #[cfg(feature = "cuda")]
    if let Some(pool) = gpu.as_ref().and_then(|g| g.pool.as_ref()) {
        pool.reset()?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    #[allow(unused_mut)]
    let mut device_used: Option<Box<dyn Fn() -> u64 + Send>> = None;
    #[cfg(feature = "cuda")]
    if let Some(g) = &gpu {
        let ctx = g.ctx.clone();
        device_used = Some(Box::new(move || used(&ctx).map_or(0, |u| u.0)));
    }
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || sample(stop, device_used))
    };

    let t0 = Instant::now();
    let config = Config::from_file(model_dir.join("config.json"))?;
    let tokenizer = Tokenizer::from_file(repo_files::find_tokenizer(&model_dir)?)?;
    let ckpt = ReleaseCheckpoint::open_dir(&model_dir)?;
    let read = Arc::new(AtomicU64::new(0));
    {
        let read = read.clone();
        ckpt.set_progress(move |b| {
            read.fetch_add(b, Ordering::Relaxed);
        });
    }
    let stored = stored_text_bytes(&ckpt)?;
    let plan = LoadPlan::new(&config, PlanOptions { dtype, device: PlanDevice::of(&device), quantized, engram });
    let setup = t0.elapsed().as_secs_f64();
    let model = Pretrained::load_with(config, tokenizer, ckpt.clone(), Numerics::REFERENCE, dtype, &device, LoadOptions { quantized, engram })?;
    device.synchronize()?;
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let peaks = sampler.join().map_err(|_| anyhow::anyhow!("sampler thread panicked"))?;
    let after = status()?;
    show("after", &after);

    let c = &model.config;
    println!(
        "config hidden {}, {} layers, {} routed experts of width {}, vocab {}",
        c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.moe_intermediate_size, c.vocab_size
    );
    let read = read.load(Ordering::Relaxed);
    println!("stored text tensors {:.3} GB; read by the loader {:.3} GB", gb(stored), gb(read));
    println!(
        "time   {secs:.2} s (config, tokenizer, open {setup:.2} s; model {:.2} s): {:.3} GB/s of stored bytes read",
        secs - setup,
        gb(read) / secs
    );

    let (mut dense, mut fp8, mut mxfp4, mut experts) = (0u64, 0u64, 0u64, 0u64);
    let mut linear_names = std::collections::HashSet::new();
    for (name, linear) in model.model.linears() {
        let b = linear.weight().bytes() as u64;
        match linear.weight() {
            LinearWeight::Fp8(_) => fp8 += b,
            LinearWeight::Mxfp4(_) => mxfp4 += b,
            LinearWeight::Dense(_) => dense += b,
        }
        if name.contains(".ffn.experts.") {
            experts += b;
        }
        linear_names.insert(format!("{name}.weight"));
    }
    let placed = ckpt.placed_bytes();
    let mut other: u64 = placed.iter().filter(|(n, _)| !linear_names.contains(*n)).map(|(_, b)| b).sum();
    // Host tables hold a decode table on the device that the loader does not place.
    let mut engram_extra = 0u64;
    for t in model.engram_placements() {
        println!(
            "engram layer {} [{} x {}]: {} ({:.3} GB there{})",
            t.layer,
            t.rows,
            t.width,
            t.location,
            gb(t.bytes),
            if t.location == EngramLocation::Host { ", read by rows" } else { "" }
        );
        engram_extra += t.device_extra_bytes;
    }
    other += engram_extra;
    let held = dense + fp8 + mxfp4 + other;
    println!(
        "held   {:.3} GB = linears {:.3} GB (dense {:.3}, FP8 as stored {:.3}, MXFP4 as stored {:.3}; routed experts {:.3}) + \
         other weights {:.3} GB; {:.2} x stored",
        gb(held),
        gb(dense + fp8 + mxfp4),
        gb(dense),
        gb(fp8),
        gb(mxfp4),
        gb(experts),
        gb(other),
        held as f64 / stored as f64
    );

    print!("{plan}");
    let diff = plan_differences(&plan, &placed);
    let placed_total: u64 = placed.values().sum();
    if !diff.is_empty() || placed_total + engram_extra != held {
        bail!(
            "plan check FAILED: planned {} B on the device, placed {placed_total} B (+ {engram_extra} B of Engram decode tables), \
             linears + other tensors {held} B; {} differences:\n{}",
            plan.device_bytes(),
            diff.len(),
            diff.join("\n")
        );
    }
    println!(
        "plan   check OK: planned {} B on {} = placed {placed_total} B = linears + other tensors{}, tensor by tensor ({} tensors)",
        plan.device_bytes(),
        PlanDevice::of(&device).name(),
        if engram_extra > 0 { format!(" - {engram_extra} B of Engram decode tables (not planned)") } else { String::new() },
        placed.len()
    );

    let base = field(&before, "VmRSS");
    let rise = field(&after, "VmHWM").saturating_sub(base);
    let anon_rise = peaks.anon.saturating_sub(field(&before, "RssAnon"));
    let kept = field(&after, "RssAnon").saturating_sub(field(&before, "RssAnon"));
    let r = |x: u64| (x as f64 / held as f64, x as f64 / stored as f64);
    println!(
        "host   sampled peaks during load: RssAnon {:.1} MiB, RssFile {:.1} MiB, sum {:.1} MiB",
        peaks.anon as f64 / MIB,
        peaks.file as f64 / MIB,
        peaks.sum as f64 / MIB
    );
    for (what, x) in [("peak RSS rise (VmHWM after - VmRSS before)", rise), ("peak RssAnon rise", anon_rise), ("RssAnon kept after loading", kept)] {
        let (h, s) = r(x);
        println!("host   {what:<43} {:9.1} MiB = {h:.2} x held = {s:.2} x stored", x as f64 / MIB);
    }
    if let Some(big) = plan.tensors.iter().max_by_key(|t| t.stored_bytes).filter(|_| !device.is_cpu()) {
        println!(
            "host   peak RssAnon rise = {:.2} x the largest stored tensor ({}, {:.1} MiB stored, {:.1} MiB held)",
            anon_rise as f64 / big.stored_bytes as f64,
            big.name,
            big.stored_bytes as f64 / MIB,
            big.held_bytes as f64 / MIB
        );
    }

    #[cfg(feature = "cuda")]
    if let (Some(g), Some((used0, total))) = (&gpu, dev_before) {
        let (used1, _) = g.used()?;
        let added = used1.saturating_sub(used0);
        println!(
            "device total - free: before {:.3} GB, after {:.3} GB (of {:.3} GB), sampled peak {:.3} GB",
            gb(used0),
            gb(used1),
            gb(total),
            gb(peaks.device)
        );
        println!(
            "device added by loading {:.3} GB = {:.2} x stored = {:.2} x held",
            gb(added),
            added as f64 / stored as f64,
            added as f64 / held as f64
        );
        if let Some(pool) = &g.pool {
            println!("device candle pool: in use {:.3} GB, peak during load {:.3} GB", gb(pool.used()?), gb(pool.peak()?));
        }
    }
    drop(model);
    Ok(())
}
