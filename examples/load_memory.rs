//! Peak memory of loading a model folder with `Pretrained::load_dir` (CPU, bf16 activations),
//! compared with the bytes of the dequantized parameters the loaded model holds.
//!
//! ```text
//! cargo run --release --example load_memory                     # embedded Shakespeare model
//! cargo run --release --example load_memory -- /tmp/v41-synthetic
//! ```
//!
//! Linux only (reads `/proc/self/status`). Prints the process's peak RSS (`VmHWM`) before and
//! after loading, and — sampled every millisecond during the load by a second thread — the peaks
//! of `RssAnon` (heap: the model's tensors and temporaries) and `RssFile` (pages of the
//! memory-mapped checkpoint, counted in RSS while mapped).
//!
//! The held bytes are computed from the checkpoint: every text-model tensor's logical element
//! count times the size of the dtype the model keeps it in on CPU — f32 for linears
//! (`nn::linear::compute_dtype`), norms, mHC, router and sink tensors; the activation dtype for
//! the token embedding; bf16 for resident Engram tables. MTP / vision tensors are not loaded and
//! not counted.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use clap::Parser;
use deepseek_v41::loader::{ReleaseCheckpoint, NON_TEXT_PREFIXES};
use deepseek_v41::model::Pretrained;
use deepseek_v41::nn::linear::compute_dtype;
use deepseek_v41::Numerics;

const DEFAULT_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/v41-shakespeare-tiny");
const MIB: f64 = (1 << 20) as f64;

#[derive(Parser)]
#[command(about = "Peak memory of Pretrained::load_dir versus the model's dequantized bytes")]
struct Args {
    /// Model folder (config.json, checkpoint, tokenizer.json).
    #[arg(default_value = DEFAULT_MODEL)]
    model: PathBuf,
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
        "{when:<7} VmHWM {:8.1} MiB  VmRSS {:8.1} MiB  (RssAnon {:8.1} MiB, RssFile {:8.1} MiB)",
        field(s, "VmHWM") as f64 / MIB,
        field(s, "VmRSS") as f64 / MIB,
        field(s, "RssAnon") as f64 / MIB,
        field(s, "RssFile") as f64 / MIB,
    );
}

/// Peaks of RssAnon, RssFile and their sum, sampled until `stop` is set.
fn sample(stop: Arc<AtomicBool>) -> [u64; 3] {
    let mut peak = [0u64; 3];
    while !stop.load(Ordering::Relaxed) {
        if let Ok(s) = status() {
            let (a, f) = (field(&s, "RssAnon"), field(&s, "RssFile"));
            peak = [peak[0].max(a), peak[1].max(f), peak[2].max(a + f)];
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    peak
}

/// Bytes of the parameters as the loaded model holds them on CPU, and the parameter count.
fn held_bytes(ckpt: &ReleaseCheckpoint, activations: DType) -> Result<(u64, u64)> {
    let linear = compute_dtype(&Device::Cpu, activations).size_in_bytes();
    let (mut bytes, mut params) = (0u64, 0u64);
    for name in ckpt.names() {
        if NON_TEXT_PREFIXES.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let n: usize = ckpt.info(&name)?.shape.iter().product();
        let size = if name == "embed.weight" {
            activations.size_in_bytes()
        } else if name.ends_with(".engram.embed.weight") {
            DType::BF16.size_in_bytes()
        } else if name.ends_with(".weight") && !name.ends_with("norm.weight") {
            linear
        } else {
            DType::F32.size_in_bytes()
        };
        bytes += (n * size) as u64;
        params += n as u64;
    }
    Ok((bytes, params))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dtype = DType::BF16;
    let (held, params, on_disk) = {
        let ckpt = ReleaseCheckpoint::open_dir(&args.model)?;
        let on_disk: u64 = ckpt.files().iter().map(|f| std::fs::metadata(f).map(|m| m.len())).sum::<std::io::Result<u64>>()?;
        let (held, params) = held_bytes(&ckpt, dtype)?;
        (held, params, on_disk)
    };
    println!("model   {}", args.model.display());
    println!("checkpoint on disk {:.1} MiB; {params} text parameters", on_disk as f64 / MIB);
    println!("held (dequantized, CPU, bf16 activations): {:.1} MiB", held as f64 / MIB);

    let before = status()?;
    show("before", &before);
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || sample(stop))
    };
    let t0 = Instant::now();
    let model = Pretrained::load_dir(&args.model, Numerics::REFERENCE, dtype, &Device::Cpu)?;
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let [anon, file, sum] = sampler.join().map_err(|_| anyhow::anyhow!("sampler thread panicked"))?;
    let after = status()?;
    show("after", &after);
    println!("loaded in {secs:.2} s");
    println!(
        "sampled peaks during load: RssAnon {:.1} MiB, RssFile {:.1} MiB, sum {:.1} MiB",
        anon as f64 / MIB,
        file as f64 / MIB,
        sum as f64 / MIB
    );
    let base = field(&before, "VmRSS");
    let rise = field(&after, "VmHWM").saturating_sub(base);
    let anon_rise = anon.saturating_sub(field(&before, "RssAnon"));
    let kept = field(&after, "RssAnon").saturating_sub(field(&before, "RssAnon"));
    let r = |x: u64| x as f64 / held as f64;
    println!("peak RSS rise (VmHWM after - VmRSS before): {:.1} MiB = {:.2} x held", rise as f64 / MIB, r(rise));
    println!("peak RssAnon rise:                          {:.1} MiB = {:.2} x held", anon_rise as f64 / MIB, r(anon_rise));
    println!("RssAnon kept after loading:                 {:.1} MiB = {:.2} x held", kept as f64 / MIB, r(kept));
    drop(model);
    Ok(())
}
