//! Expert parallelism on CUDA (issue 25, `deepseek_v41::parallel`): ranks as threads of one
//! process on one GPU ([`LocalGroup`]), the tiny reference model's MoE layers with MXFP4 experts
//! kept packed. With the device routing on, every rank computes the slots it receives with the
//! grouped expert kernels (`cuda::moe_experts_device`, one expert per received row); the outputs
//! must match the per-expert loop of the same ranks (the path `tests/expert_parallel.rs` proves
//! bit for bit on the CPU) and the single-GPU `Moe` on the device, up to the f32 summation order
//! of the kernels (margin-aware: a few bf16 ulps) — at N = 1, 2, 3, with ranks that have no
//! tokens and ranks that receive no slot.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_expert_parallel`.

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use deepseek_v41::config::Config;
use deepseek_v41::cuda::with_device_routing;
use deepseek_v41::loader::{var_builder, ReleaseCheckpoint};
use deepseek_v41::model::Moe;
use deepseek_v41::nn::RowGroups;
use deepseek_v41::parallel::Collective;
use deepseek_v41::Numerics;

#[path = "support/deal.rs"]
mod deal;
use deal::sharded_with;

fn gpu() -> Result<Device> {
    Device::new_cuda(0).context("tests/cuda_expert_parallel.rs needs a CUDA device (none found): these tests must run on a GPU")
}

fn setup(dev: &Device) -> Result<(Config, VarBuilder<'static>, Tensor)> {
    let fixtures = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny"));
    let cfg = Config::from_file(fixtures.join("prefill_full").join("config.json"))?;
    let vb = var_builder(ReleaseCheckpoint::open(&[fixtures.join("model.safetensors")])?, DType::BF16, dev);
    let g = candle_core::safetensors::load(fixtures.join("prefill_full").join("golden.safetensors"), dev)?;
    let x = g.get("L0.ffn_in").context("L0.ffn_in")?.to_dtype(DType::BF16)?;
    Ok((cfg, vb, x))
}

/// The ranks' outputs for `layer` (sequences `lens` dealt as `deal`, concatenated in rank
/// order); `device`: inside `with_device_routing` (the grouped kernels, which every rank must
/// hold) or not (the per-expert loop).
fn sharded(cfg: &Config, vb: &VarBuilder<'static>, layer: usize, x: &Tensor, lens: &[usize], deal: &[usize], device: bool) -> Result<Tensor> {
    Ok(sharded_with(cfg, vb, layer, x, lens, deal, |moe, xr, groups, comm| {
        if moe.grouped_experts().is_none() {
            candle_core::bail!("rank {}: no grouped experts (MXFP4 experts on CUDA expected)", comm.rank())
        }
        if device {
            with_device_routing(|| moe.forward(xr, groups, comm))
        } else {
            moe.forward(xr, groups, comm)
        }
    })?)
}

/// How far `got` is from `want`: (elements more than 2 bf16 ulps apart, relative Frobenius error).
fn distance(got: &Tensor, want: &Tensor) -> Result<(usize, f64)> {
    ensure!(got.dims() == want.dims(), "shapes {:?} vs {:?}", got.dims(), want.dims());
    let a = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let b = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let ord = |v: f32| {
        let h = half::bf16::from_f32(v).to_bits() as i32;
        if h & 0x8000 != 0 { -(h & 0x7fff) } else { h }
    };
    let far = a.iter().zip(&b).filter(|(x, y)| x.is_nan() != y.is_nan() || (ord(**x) - ord(**y)).abs() > 2).count();
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(&b) {
        num += f64::from(x - y).powi(2);
        den += f64::from(*y).powi(2);
    }
    Ok((far, (num / den.max(f64::MIN_POSITIVE)).sqrt()))
}

#[test]
fn grouped_kernels_on_the_ranks_match_the_per_expert_loop_and_one_gpu() -> Result<()> {
    let dev = gpu()?;
    let (cfg, vb, x) = setup(&dev)?;
    let t = x.dim(0)?;
    ensure!(t > 27, "the fixture's prefill has {t} tokens");
    let lens = [7usize, 1, 5, 1, 9, 3, 1, t - 27];
    let groups = RowGroups::from_lens(lens);
    for layer in 0..3 {
        let single = with_device_routing(|| Moe::new(&cfg, Numerics::REFERENCE, vb.pp("layers").pp(layer).pp("ffn"))?.forward_grouped(&x, &groups))?.out;
        // N = 1, 2, 3; [8, 0, 0]: two ranks without tokens that still receive their experts' slots.
        for deal in [vec![8], vec![3, 5], vec![2, 2, 4], vec![8, 0, 0], vec![0, 8]] {
            let device = sharded(&cfg, &vb, layer, &x, &lens, &deal, true)?;
            let host = sharded(&cfg, &vb, layer, &x, &lens, &deal, false)?;
            for (what, want) in [("the per-expert loop of the same ranks", &host), ("one GPU's Moe", &single)] {
                let (far, rel) = distance(&device, want)?;
                ensure!(
                    far * 1000 <= device.elem_count() && rel < 5e-3,
                    "layer {layer}, sequences per rank {deal:?}: the grouped kernels against {what}: {far} of {} outputs more than 2 ulps apart, relative error {rel:.2e}",
                    device.elem_count()
                );
            }
        }
    }
    Ok(())
}
