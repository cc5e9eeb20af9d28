//! Loading onto CUDA (`loader::staging`, `loader::LoadPlan`):
//! * the plan is the CUDA placement to the byte (`ReleaseCheckpoint::placed_bytes` and the
//!   linears' `bytes()`) for the embedded model under native bf16, dequantized bf16 and f32, and
//!   with its Engram table left in host memory (`EngramPlacement::Host`);
//! * every tensor placed on the GPU (cast there, or dequantized there for FP8 32x32 and MXFP4,
//!   or in host chunks for the FP8-rows Engram table) is the CPU's placement bit for bit;
//! * placing a tensor on the GPU allocates no host copy of it: under 1 MiB of Rust heap for a
//!   plain bf16 tensor (as bf16 and f32), an FP8 32x32 and an MXFP4 weight, at most one staging
//!   chunk and a half for an FP8-rows table (counting global allocator).
//!
//! The whole Flash-width check is `load_report` (`docs/perf.md` "Loading"). These tests need a
//! CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_load_plan`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::config::Config;
use deepseek_v41::loader::staging::STAGING_CHUNK_BYTES;
use deepseek_v41::loader::{LoadPlan, PlanDevice, PlanOptions, QuantizedWeights, ReleaseCheckpoint};
use deepseek_v41::model::{EngramPlacement, LoadOptions, Pretrained};
use deepseek_v41::tokenizer::Tokenizer;
use deepseek_v41::Numerics;

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

#[path = "../examples/support/repo_files.rs"]
mod repo_files;

#[path = "support/release_writer.rs"]
mod release_writer;

#[path = "support/plan_check.rs"]
mod plan_check;
use plan_check::{differences, linear_bytes, staging_checkpoint};

#[global_allocator]
static ALLOC: counting_alloc::Counting = counting_alloc::Counting;

const EMBEDDED: &str = "models/v41-shakespeare-tiny";
const MIB: f64 = (1 << 20) as f64;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_load_plan.rs needs a CUDA device (none found): these tests must run on a GPU")
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// The plan of the embedded model for CUDA is what `Pretrained::load_with` places there, tensor
/// by tensor and in total, under native bf16 (FP8 and MXFP4 as stored), dequantized bf16 and f32,
/// and with the Engram table in host memory (nothing placed for it).
#[test]
fn the_plan_is_the_cuda_placement_to_the_byte() -> Result<()> {
    let dev = gpu();
    let dir = repo_files::repo_file(EMBEDDED);
    let (auto, host) = (EngramPlacement::Auto, EngramPlacement::Host);
    let cases = [
        (DType::BF16, QuantizedWeights::Native, auto),
        (DType::BF16, QuantizedWeights::Dequantized, auto),
        (DType::F32, QuantizedWeights::Native, auto),
        (DType::BF16, QuantizedWeights::Native, host),
    ];
    for (dtype, quantized, engram) in cases {
        let cfg = Config::from_file(dir.join("config.json"))?;
        let plan = LoadPlan::new(&cfg, PlanOptions { dtype, device: PlanDevice::of(&dev), quantized, engram });
        let ckpt = ReleaseCheckpoint::open_dir(&dir)?;
        let tok = Tokenizer::from_file(dir.join("tokenizer.json"))?;
        let p = Pretrained::load_with(cfg, tok, ckpt.clone(), Numerics::REFERENCE, dtype, &dev, LoadOptions { quantized, engram })?;
        let diff = differences(&plan, &ckpt.placed_bytes(), &linear_bytes(&p));
        ensure!(diff.is_empty(), "{dtype:?} {quantized} Engram {engram}: {} differences:\n{}", diff.len(), diff.join("\n"));
        ensure!((plan.host_bytes() > 0) == (engram == host), "Engram {engram}: {} B planned on the host", plan.host_bytes());
        println!("{dtype:?} {quantized} Engram {engram}: {} B planned = placed on the GPU", plan.device_bytes());
    }
    Ok(())
}

/// Every logical tensor of the embedded checkpoint placed on the GPU as bf16 and as f32 equals
/// its CPU placement bit for bit (device casts, device FP8 / MXFP4 dequantization, host chunks
/// for the Engram table).
#[test]
fn gpu_placement_is_the_cpu_placement() -> Result<()> {
    let dev = gpu();
    let ckpt = ReleaseCheckpoint::open_dir(repo_files::repo_file(EMBEDDED))?;
    let mut n = 0;
    for name in ckpt.names() {
        for dtype in [DType::BF16, DType::F32] {
            let (g, c) = (ckpt.get(&name, dtype, &dev)?, ckpt.get(&name, dtype, &Device::Cpu)?);
            ensure!(g.dtype() == dtype && g.dims() == c.dims(), "{name} {dtype:?}: {:?} vs {:?}", g.shape(), c.shape());
            ensure!(bits(&g)? == bits(&c)?, "{name} as {dtype:?}: the GPU placement differs from the CPU's");
            n += 1;
        }
    }
    ensure!(n > 100, "only {n} tensors checked");
    Ok(())
}

/// Placing on the GPU allocates no host copy: < 1 MiB of Rust heap for a plain bf16 tensor (as
/// bf16 and f32), an FP8 32x32 weight and an MXFP4 weight; at most 1.5 staging chunks + 1 MiB
/// for an FP8-rows table (dequantized on the host chunk by chunk).
#[test]
fn gpu_placement_allocates_no_host_copy() -> Result<()> {
    let dev = gpu();
    let dir = release_writer::TempDir::new("cuda-host-peak")?;
    let ckpt = staging_checkpoint(&dir.0)?;
    // The first placement initialises the device's kernels and pools: not measured.
    ckpt.get("lin.weight", DType::BF16, &dev)?;
    ckpt.get("big.weight", DType::F32, &dev)?;
    for (name, dtype, bar) in [
        ("big.weight", DType::BF16, 1 << 20),
        ("big.weight", DType::F32, 1 << 20),
        ("lin.weight", DType::BF16, 1 << 20),
        ("experts.weight", DType::BF16, 1 << 20),
        ("table.weight", DType::BF16, STAGING_CHUNK_BYTES * 3 / 2 + (1 << 20)),
    ] {
        let (t, peak, _) = counting_alloc::measure(|| -> Result<Tensor> {
            let t = ckpt.get(name, dtype, &dev)?;
            dev.synchronize()?;
            Ok(t)
        });
        let t = t?;
        let held = t.elem_count() * dtype.size_in_bytes();
        println!("{name} as {dtype:?} on the GPU: held {:.1} MiB on the device, host peak {:.3} MiB", held as f64 / MIB, peak as f64 / MIB);
        ensure!(peak <= bar, "{name} {dtype:?}: host peak {peak} B over {bar} B");
        ensure!(bits(&t)? == bits(&ckpt.get(name, dtype, &Device::Cpu)?)?, "{name} {dtype:?}: GPU vs CPU values");
    }
    Ok(())
}
