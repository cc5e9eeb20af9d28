//! `loader::LoadPlan`: the bytes a load places, planned from the config alone, against what the
//! loader places (`ReleaseCheckpoint::placed_bytes`, the linears' `bytes()`) to the byte on the
//! CPU, against the stored bytes of a release checkpoint, and against the figures measured on an
//! H100 for the 4-layer Flash-width checkpoint (`docs/perf.md` "Loading").

use std::collections::BTreeMap;

use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use deepseek_v41::config::Config;
use deepseek_v41::loader::plan::{Component, Held, Place};
use deepseek_v41::loader::{LoadPlan, PlanDevice, PlanOptions, QuantizedWeights, ReleaseCheckpoint};
use deepseek_v41::model::{EngramLocation, EngramPlacement, LoadOptions, Pretrained};
use deepseek_v41::tokenizer::Tokenizer;
use deepseek_v41::Numerics;

#[path = "../examples/support/repo_files.rs"]
mod repo_files;

#[path = "../examples/support/flash_config.rs"]
mod flash_config;

#[path = "support/release_writer.rs"]
mod release_writer;

#[path = "support/plan_check.rs"]
mod plan_check;
use plan_check::{differences, linear_bytes};

/// The embedded model: a release-format checkpoint (FP8 linears, MXFP4 experts, an FP8 Engram
/// table) with its tokenizer.
const EMBEDDED: &str = "models/v41-shakespeare-tiny";

/// A load of the embedded model on the CPU and its plan.
struct Loaded {
    plan: LoadPlan,
    /// The bytes the loader placed per tensor.
    placed: BTreeMap<String, u64>,
    /// The linears' bytes per weight name.
    linears: BTreeMap<String, u64>,
    ckpt: ReleaseCheckpoint,
    /// Where each Engram table went.
    location: Vec<EngramLocation>,
}

/// Loads the embedded model with `dtype` / `quantized` on the CPU, its Engram tables placed as
/// `engram`.
fn load(dtype: DType, quantized: QuantizedWeights, engram: EngramPlacement) -> Result<Loaded> {
    let dir = repo_files::repo_file(EMBEDDED);
    let cfg = Config::from_file(dir.join("config.json"))?;
    let plan = LoadPlan::new(&cfg, PlanOptions { dtype, device: PlanDevice::Cpu, quantized, engram });
    let ckpt = ReleaseCheckpoint::open_dir(&dir)?;
    let tok = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let p = Pretrained::load_with(cfg, tok, ckpt.clone(), Numerics::REFERENCE, dtype, &Device::Cpu, LoadOptions { quantized, engram })?;
    let location = p.model.engram_placements().iter().map(|t| t.location).collect();
    Ok(Loaded { plan, placed: ckpt.placed_bytes(), linears: linear_bytes(&p), ckpt, location })
}

/// On the CPU the plan is the loader's placement to the byte under both policies and both
/// activation dtypes, says every linear is dense f32, and its stored bytes are the checkpoint's.
#[test]
fn the_plan_is_the_cpu_placement_to_the_byte() -> Result<()> {
    for dtype in [DType::BF16, DType::F32] {
        for quantized in [QuantizedWeights::Native, QuantizedWeights::Dequantized] {
            let Loaded { plan, placed, linears, ckpt, .. } = load(dtype, quantized, EngramPlacement::Auto)?;
            let diff = differences(&plan, &placed, &linears);
            ensure!(diff.is_empty(), "{dtype:?} {quantized}: {} differences:\n{}", diff.len(), diff.join("\n"));
            ensure!(plan.host_bytes() == 0 && plan.device_bytes() > 0);
            for t in plan.tensors.iter().filter(|t| linears.contains_key(&t.name)) {
                ensure!(t.held == Held::Dense(DType::F32), "{}: planned {} on the CPU", t.name, t.held);
            }
            let embed = plan.tensors.iter().find(|t| t.name == "embed.weight").map(|t| t.held);
            ensure!(embed == Some(Held::Dense(dtype)), "embedding held as {embed:?}");
            // Stored bytes: the release's storage, as the checkpoint holds it.
            for t in &plan.tensors {
                let info = ckpt.info(&t.name)?;
                let stored = info.stored.byte_range.len() + info.scale.map_or(0, |s| s.byte_range.len());
                ensure!(stored as u64 == t.stored_bytes, "{}: planned {} stored bytes, the checkpoint has {stored}", t.name, t.stored_bytes);
            }
        }
    }
    // The check can fail: one byte off is reported.
    let Loaded { mut plan, placed, linears, .. } = load(DType::BF16, QuantizedWeights::Native, EngramPlacement::Auto)?;
    let norm = plan.tensors.iter().position(|t| t.name == "norm.weight").expect("final norm");
    plan.tensors[norm].held_bytes += 1;
    ensure!(differences(&plan, &placed, &linears).len() == 2, "a one-byte error must show in the tensor and the totals");
    Ok(())
}

/// Under each Engram placement the plan puts the embedded model's table where the load does
/// (`EngramPlacement::with_checkpoint`): `host` leaves it mapped, placing nothing for it, and the
/// plan is still the placement to the byte; `auto` and `device` keep it resident.
#[test]
fn the_plan_follows_the_engram_placement() -> Result<()> {
    for engram in [EngramPlacement::Auto, EngramPlacement::Device, EngramPlacement::Host] {
        let Loaded { plan, placed, linears, location, .. } = load(DType::BF16, QuantizedWeights::Native, engram)?;
        let diff = differences(&plan, &placed, &linears);
        ensure!(diff.is_empty(), "{engram}: {} differences:\n{}", diff.len(), diff.join("\n"));
        let tables: Vec<_> = plan.tensors.iter().filter(|t| t.component == Component::EngramTables).collect();
        ensure!(!tables.is_empty() && tables.len() == location.len(), "{engram}: {} planned tables, {} loaded", tables.len(), location.len());
        let host = engram == EngramPlacement::Host;
        for (t, &at) in tables.iter().zip(&location) {
            ensure!(at == if host { EngramLocation::Host } else { EngramLocation::Device }, "{engram}: {} loaded {at}", t.name);
            let want = if host { (Place::HostMapped, Held::Mapped) } else { (Place::Device, Held::Dense(DType::BF16)) };
            ensure!((t.place, t.held) == want, "{engram}: {} planned {:?} {}", t.name, t.place, t.held);
            ensure!(placed.contains_key(&t.name) != host, "{engram}: {} placed {:?}", t.name, placed.get(&t.name));
        }
        ensure!(host == (plan.host_bytes() > 0), "{engram}: {} B planned on the host", plan.host_bytes());
    }
    Ok(())
}

/// The same config planned for CUDA: quantized linears FP8 and routed experts MXFP4 as stored
/// under `native` with bf16, dense bf16 under `dequantized`, dense f32 with f32 activations; the
/// f32 linears, norms, mHC and router stay f32; the grouped `wo_a` FP8 as stored under `native`
/// (its groups are whole 32-row blocks) and the Engram table dense.
#[test]
fn the_cuda_plan_holds_each_weight_in_its_form() -> Result<()> {
    let cfg = Config::from_file(repo_files::repo_file(EMBEDDED).join("config.json"))?;
    let plan = |dtype, quantized| LoadPlan::new(&cfg, PlanOptions { dtype, device: PlanDevice::Cuda, quantized, engram: EngramPlacement::Auto });
    let held = |p: &LoadPlan, name: &str| p.tensors.iter().find(|t| t.name == name).map(|t| t.held);
    let native = plan(DType::BF16, QuantizedWeights::Native);
    for (name, want) in [
        ("layers.0.attn.wq_a.weight", Held::Fp8),
        ("layers.0.attn.wo_a.weight", Held::Fp8),
        ("layers.0.ffn.experts.0.w2.weight", Held::Mxfp4),
        ("layers.0.ffn.shared_experts.w1.weight", Held::Fp8),
        ("layers.0.ffn.gate.weight", Held::Dense(DType::F32)),
        ("head.weight", Held::Dense(DType::F32)),
        ("embed.weight", Held::Dense(DType::BF16)),
        ("norm.weight", Held::Dense(DType::F32)),
    ] {
        ensure!(held(&native, name) == Some(want), "{name}: {:?}, want {want}", held(&native, name));
    }
    let engram = cfg.engram.as_ref().map(|e| e.layer_ids[0]).expect("the embedded model has Engram");
    ensure!(held(&native, &format!("layers.{engram}.engram.wkv.weight")) == Some(Held::Fp8));
    ensure!(held(&native, &format!("layers.{engram}.engram.embed.weight")) == Some(Held::Dense(DType::BF16)));
    for (p, dense) in [(plan(DType::BF16, QuantizedWeights::Dequantized), DType::BF16), (plan(DType::F32, QuantizedWeights::Native), DType::F32)] {
        ensure!(p.tensors.iter().all(|t| !matches!(t.held, Held::Fp8 | Held::Mxfp4)), "{:?}: packed weights", p.options);
        ensure!(held(&p, "layers.0.attn.wq_a.weight") == Some(Held::Dense(dense)));
        ensure!(p.device_bytes() > native.device_bytes());
    }
    // The routed experts' MXFP4 bytes: codes (half a byte per weight) plus one scale per 32.
    let e = native.components().into_iter().find(|c| c.component == Component::RoutedExperts).expect("experts");
    let (d, mi) = (cfg.hidden_size as u64, cfg.moe_intermediate_size as u64);
    let per_expert = 3 * (d * mi / 2 + d * mi / 32);
    ensure!(e.device_bytes == (cfg.num_hidden_layers * cfg.n_routed_experts) as u64 * per_expert, "{e:?}");
    Ok(())
}

/// The 4-layer Flash-width checkpoint (`synthetic_checkpoint --flash-shapes`) planned for CUDA
/// (native, bf16) is what loading it places (`load_report`'s plan check on an H100, `docs/perf.md`
/// "Loading", 0.01 GB figures): 32.66 GB stored; held MXFP4 experts 28.88 + FP8 weights 0.81
/// (the quantized linears and the grouped `wo_a`) + dense linears 2.70 + other weights 1.88 GB;
/// under 34.43 GB of device memory added (the weights plus the context's and cuBLAS's own). The full
/// released config keeps its Engram tables mapped, and its caches take the spec's 890 B per
/// token packed (spec §7.4).
#[test]
fn the_flash_plans_match_the_measured_load_and_the_spec() -> Result<()> {
    let fc = flash_config::flash_config(&[0, 1, 2, 3], None, Some(1 << 20))?;
    let native = PlanOptions { dtype: DType::BF16, device: PlanDevice::Cuda, quantized: QuantizedWeights::Native, engram: EngramPlacement::Auto };
    let plan = LoadPlan::new(&fc.config, native);
    let gb = |b: u64| (b as f64 / 1e9 * 100.0).round() / 100.0;
    let by = |h: Held| plan.tensors.iter().filter(|t| t.held == h).map(|t| t.held_bytes).sum::<u64>();
    ensure!(gb(plan.stored_bytes()) == 32.66, "stored {}", plan.stored_bytes());
    let dense = |linear: bool| plan.tensors.iter().filter(|t| t.linear == linear && matches!(t.held, Held::Dense(_))).map(|t| t.held_bytes).sum::<u64>();
    let measured = [(by(Held::Mxfp4), 28.88), (by(Held::Fp8), 0.81), (dense(true), 2.70), (dense(false), 1.88)];
    ensure!(measured.iter().all(|&(b, want)| gb(b) == want), "planned {measured:?}");
    ensure!(plan.device_bytes() == measured.iter().map(|m| m.0).sum::<u64>() && plan.device_bytes() < 34_430_000_000);
    ensure!(plan.host_bytes() == 0);
    let text = plan.to_string();
    for want in ["routed experts", "attention, window only", "attention, ratio 2", "Engram tables", "MXFP4", "total", "B/token"] {
        ensure!(text.contains(want), "the table lacks {want:?}:\n{text}");
    }

    let released = Config::from_file(repo_files::repo_file(flash_config::FLASH_CONFIG))?;
    let plan = LoadPlan::new(&released, native);
    let tables: Vec<_> = plan.tensors.iter().filter(|t| t.component == Component::EngramTables).collect();
    ensure!(tables.len() == 2 && tables.iter().all(|t| t.place == Place::HostMapped && t.held == Held::Mapped));
    ensure!(plan.host_bytes() == tables.iter().map(|t| t.stored_bytes).sum::<u64>());
    // `device` would hold them as bf16 (the load then stops at the checkpoint's dense limit).
    let device = LoadPlan::new(&released, PlanOptions { engram: EngramPlacement::Device, ..native });
    ensure!(device.host_bytes() == 0 && device.device_bytes() > plan.device_bytes() + 2 * 190_000_000_000);
    ensure!(plan.cache.per_token_packed == 890.0, "packed {} B/token", plan.cache.per_token_packed);
    // Rows: 3 ratio-2 sources x (512 + 128) x 2 B / 2 + 1 ratio-1 source x (512 + 128) x 2 B.
    ensure!(plan.cache.per_token_rows == 3200.0, "rows {} B/token", plan.cache.per_token_rows);
    ensure!(plan.cache.window_bytes_packed == 40 * 2 * 64 * 528, "{}", plan.cache.window_bytes_packed);
    ensure!(plan.cache.window_bytes_rows == 40 * 128 * 512 * 2);
    Ok(())
}
