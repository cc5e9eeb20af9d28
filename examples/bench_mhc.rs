//! The mHC hyper-connection ops of one V4.1-Flash sublayer (spec §3.2; hc = 4 copies of
//! hidden 5120, `model::mhc`) on CUDA, per part, for B decode tokens: where the ~100 µs of mHC
//! and norms per layer at B = 1 go (`docs/perf.md` "One real-size decoder layer").
//!
//! ```text
//! cargo build --release --features cuda --example bench_mhc
//! bench_mhc [--batch 1,64,256] [--calls 20] [--reps 9]
//! ```
//!
//! Each part is captured `--calls` times back to back into one CUDA graph and replayed; the
//! figure is the median µs per call (the graph's own launch cost spread over the calls, so the
//! small kernels' times are not hidden under it). Random weights and inputs at the released
//! widths (config `tests/fixtures/deepseek-v41-flash/config.json`).
//!
//! | part | what |
//! |---|---|
//! | mixes | `HcMix::mixes`: the rms scale, the `[B, hc·D] x [hc·D, (2+hc)·hc]` f32 product, the scale by the rsqrt, the split and Sinkhorn |
//! | rms scale | `cuda::rms_scale_device` of the `[B, hc·D]` stream |
//! | mixes product | the f32 product alone (cuBLAS through Candle) |
//! | rsqrt mul | the broadcast multiply by the rsqrt alone |
//! | sinkhorn | `cuda::split_sinkhorn_device` alone |
//! | collapse + norm | `collapse` and the sublayer's RMSNorm |
//! | post | `model::post`: the comb transpose, the stream to f32, the batched comb product (cuBLAS), the post kernel |
//! | comb product | the batched `[hc, hc] x [hc, D]` f32 product alone |

use anyhow::{Context, Result};
use candle_core::{DType, Module, Tensor};
use candle_nn::VarBuilder;
use clap::Parser;
use deepseek_v41::config::Config;
use deepseek_v41::cuda::{rms_scale_device, split_sinkhorn_device};
use deepseek_v41::model::{collapse, post, HcMix, HcSublayer};
use deepseek_v41::nn::RmsNorm;

#[path = "support/bench.rs"]
mod bench;
#[path = "support/repo_files.rs"]
mod repo_files;

#[derive(Parser)]
#[command(about = "mHC ops of one V4.1-Flash sublayer on CUDA, per part")]
struct Args {
    /// Decode tokens per call.
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    batch: Vec<usize>,
    /// Calls captured back to back in one graph.
    #[arg(long, default_value_t = 20)]
    calls: usize,
    #[command(flatten)]
    bench: bench::BenchArgs,
}

fn main() -> Result<()> {
    let args: Args = bench::parse_args(&[("rep_ms", "2")]);
    let (dev, stream) = bench::cuda_device("bench_mhc")?;
    let timer = args.bench.timer(stream);
    // Candle uploads the dims and strides of strided ops per call; with its upload cache on, the
    // warm-up call before each capture keeps them on the device for the replays.
    let _uploads = dev.as_cuda_device()?.enable_cuda_graph_htod_cache();
    let cfg = Config::from_file(repo_files::repo_file("tests/fixtures/deepseek-v41-flash/config.json"))?;
    let (hc, d) = (cfg.hc_mult, cfg.hidden_size);
    let mix = (2 + hc) * hc;
    let mut vars = std::collections::HashMap::new();
    vars.insert("hc_attn_fn".to_string(), (Tensor::randn(0f32, 1.0, (mix, hc * d), &dev)? * 0.01)?);
    vars.insert("hc_attn_base".to_string(), (Tensor::randn(0f32, 1.0, mix, &dev)? * 0.1)?);
    vars.insert("hc_attn_scale".to_string(), Tensor::new(&[0.5f32, 0.7, 0.9], &dev)?);
    vars.insert("attn_norm.weight".to_string(), Tensor::randn(1f32, 0.1, d, &dev)?.to_dtype(DType::BF16)?);
    let vb = VarBuilder::from_tensors(vars.clone(), DType::BF16, &dev);
    let hm = HcMix::new(&cfg, vb.clone(), HcSublayer::Attn)?;
    let norm = RmsNorm::new(d, cfg.rms_norm_eps, vb.pp("attn_norm"))?;
    let func = vars["hc_attn_fn"].clone();
    let (scale, base) = (vars["hc_attn_scale"].clone(), vars["hc_attn_base"].clone());
    println!("bench_mhc: hc {hc}, hidden {d}, {mix} mixes, Sinkhorn {} iterations; µs per call ({} calls per graph)\n", cfg.hc_sinkhorn_iters, args.calls);
    println!("| B | mixes | rms scale | mixes product | rsqrt mul | sinkhorn | collapse + norm | post | comb product |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for &b in &args.batch {
        let x = Tensor::randn(0f32, 1.0, (b, hc, d), &dev)?.to_dtype(DType::BF16)?;
        let y = Tensor::randn(0f32, 1.0, (b, d), &dev)?.to_dtype(DType::BF16)?;
        let p_in = Tensor::rand(0.1f32, 1.0, (b, hc), &dev)?;
        let x2 = x.reshape((b, hc * d))?;
        let (xf, rsqrt) = rms_scale_device(&x2, cfg.rms_norm_eps)?;
        let raw = xf.matmul(&func.t()?)?;
        let mixes = raw.broadcast_mul(&rsqrt)?;
        let a = hm.mixes(&x)?;
        let comb_t = a.comb.transpose(1, 2)?.contiguous()?;
        let x32 = x.to_dtype(DType::F32)?;
        let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<String> { Ok(format!("{:.1}", timer.graph(args.calls, f)? * 1e3)) };
        let row = [
            time(&mut || hm.mixes(&x).map(|_| ()).context("mixes"))?,
            time(&mut || rms_scale_device(&x2, cfg.rms_norm_eps).map(|_| ()).context("rms scale"))?,
            time(&mut || xf.matmul(&func.t()?).map(|_| ()).context("product"))?,
            time(&mut || raw.broadcast_mul(&rsqrt).map(|_| ()).context("rsqrt mul"))?,
            time(&mut || split_sinkhorn_device(&mixes, &scale, &base, hc, cfg.hc_sinkhorn_iters, cfg.hc_eps).map(|_| ()).context("sinkhorn"))?,
            time(&mut || norm.forward(&collapse(&x, &p_in)?).map(|_| ()).context("collapse"))?,
            time(&mut || post(&y, &x, &a.post, &a.comb).map(|_| ()).context("post"))?,
            time(&mut || comb_t.matmul(&x32).map(|_| ()).context("comb product"))?,
        ];
        println!("| {b} | {} |", row.join(" | "));
    }
    Ok(())
}
