//! Checks a golden set produced by the official DeepSeek V4.1 reference.
//!
//! ```text
//! cargo run --release --example golden -- <golden-dir> [--device cpu|cuda] [--cache bf16|packed]
//!     [--weights native|dequantized] [--routing host|device]
//! ```
//!
//! `--cache packed` stores the attention caches in the packed V4.1 formats (A / B / E, needs the
//! `cuda` feature; it runs on the CPU too); cases with QAT off run bf16 caches.
//!
//! `--weights` chooses how the FP8 weights are held on CUDA (`deepseek_v41::loader::QuantizedWeights`):
//! `native` (default) keeps the quantized linears' FP8 weights as stored and runs the FP8 kernels,
//! `dequantized` holds every weight dense in bf16 (the baseline). On the CPU both are the dense
//! f32 reference.
//!
//! `--routing device` makes the MoE routing decision on the GPU (`cuda::with_device_routing`:
//! the `moe_route` kernel, only the ids and weights read back); needs `--device cuda`. The
//! default, `host`, routes on the host from the router logits.
//!
//! Prints one line per compared tensor (`PASS|FAIL name max_abs max_rel rel_fro ...`), `SKIP`
//! lines for tensors that need parts not built yet, then `N passed, M failed`. Exits non-zero
//! on any failure.
//!
//! End-to-end discrete decisions are checked margin-aware (`deepseek_v41::golden::decisions`):
//! per case a `DECISIONS` line names the first differing decision, `EXPLAINED` / `UNEXPLAINED`
//! lines classify each root divergence (recorded margin below the noise floor, or the
//! teacher-forced decision agrees), and `DOWNSTREAM` lines report the rows in their causal cones,
//! compared but counted apart. An unexplained divergence fails.

use clap::{Parser, ValueEnum};
use deepseek_v41::attention::CacheStorage;
use deepseek_v41::golden::{self, RunOptions};
use deepseek_v41::loader::QuantizedWeights;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum CacheArg {
    Bf16,
    Packed,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum WeightsArg {
    Native,
    Dequantized,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RoutingArg {
    Host,
    Device,
}

#[derive(Parser, Debug)]
#[command(about = "Check a DeepSeek V4.1 golden set")]
struct Args {
    /// Folder of the golden set (config.json, model.safetensors, modules/, one folder per case).
    golden_dir: std::path::PathBuf,
    /// Device to run on.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// Storage of the attention caches: bf16 rows, or the packed formats A / B / E.
    #[arg(long, value_enum, default_value = "bf16")]
    cache: CacheArg,
    /// FP8 weights on CUDA: kept as stored (FP8 kernels), or dequantized to bf16 at load.
    #[arg(long, value_enum, default_value = "native", alias = "quantized-weights")]
    weights: WeightsArg,
    /// Where the MoE routing decision is made (`device`: the moe_route kernel, with `--device cuda`).
    #[arg(long, value_enum, default_value = "host")]
    routing: RoutingArg,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let device = match args.device {
        DeviceArg::Cpu => candle_core::Device::Cpu,
        DeviceArg::Cuda => candle_core::Device::new_cuda(0)?,
    };
    let storage = match args.cache {
        CacheArg::Bf16 => CacheStorage::Bf16,
        CacheArg::Packed => CacheStorage::Packed,
    };
    let weights = match args.weights {
        WeightsArg::Native => QuantizedWeights::Native,
        WeightsArg::Dequantized => QuantizedWeights::Dequantized,
    };
    let check = || golden::check_set_opts(&args.golden_dir, &device, RunOptions { storage, weights });
    let report = match args.routing {
        RoutingArg::Host => check()?,
        #[cfg(feature = "cuda")]
        RoutingArg::Device if device.is_cuda() => deepseek_v41::cuda::with_device_routing(check)?,
        RoutingArg::Device => anyhow::bail!("--routing device needs --device cuda (and the `cuda` feature)"),
    };
    println!(
        "{} explained divergences, {} downstream decisions, {} downstream comparisons (see DECISIONS lines)",
        report.explained,
        report.downstream_decisions,
        report.downstream.len()
    );
    println!("{} skipped", report.skipped.len());
    println!("{} passed, {} failed", report.passed(), report.failed());
    if report.failed() > 0 {
        std::process::exit(1);
    }
    Ok(())
}
