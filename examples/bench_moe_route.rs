//! The MoE router on CUDA (`cuda::moe_route_device`, `kernels/moe_route.cu`): router logits
//! `[T, E]` → top-k ids and weights → the slots sorted by expert, at the V4.1-Flash router shape
//! (384 experts, top-6) for T tokens.
//!
//! ```text
//! cargo build --release --features cuda --example bench_moe_route
//! bench_moe_route [--t 1,2,8,9,64,256,1024,1025,4096] [--experts 384] [--k 6] [--reps 15]
//! ```
//!
//! Rows per T (the defaults straddle the kernel's path bounds: one launch up to 8, one-token route
//! CTAs up to 1024, the one-CTA sort up to 256): the launches (1 for T <= 8, else route + sort), `graph` = median microseconds per
//! call with the calls captured into a CUDA graph and replayed ([`Timer::graph`]: GPU time plus
//! the gaps between graph nodes, no host launch overhead), `loop` = back-to-back calls of the Rust
//! op ([`Timer::calls`]: host work included, as an application without graphs pays it). Each call
//! allocates its five outputs (as `Gate::route` does). The calls rotate over 8 random sets of
//! logits (σ = 2) and one random bias (±0.1). `--no-baseline` has no effect (no baseline here).

#[path = "support/bench.rs"]
mod bench;

use anyhow::Result;
use bench::{cuda_device, parse_args, BenchArgs};
use candle_core::Tensor;
use clap::Parser;
use deepseek_v41::cuda::moe_route_device;

#[derive(Parser, Debug)]
#[command(about = "MoE routing kernel (scores, top-k, weights, sort by expert)")]
struct Args {
    #[command(flatten)]
    common: BenchArgs,
    /// Tokens per call.
    #[arg(long, value_delimiter = ',', default_value = "1,2,8,9,64,256,1024,1025,4096")]
    t: Vec<usize>,
    /// Experts (router outputs).
    #[arg(long, default_value_t = 384)]
    experts: usize,
    /// Experts chosen per token.
    #[arg(long, default_value_t = 6)]
    k: usize,
}

/// Random logit sets the calls rotate over.
const SETS: usize = 8;

fn main() -> Result<()> {
    let args: Args = parse_args(&[("reps", "15"), ("warmup", "5"), ("rep_ms", "5.0")]);
    let (dev, stream) = cuda_device("bench_moe_route")?;
    let timer = args.common.timer(stream);
    let (e, k) = (args.experts, args.k);
    println!("MoE route: E = {e} experts, top-{k}, gate_temp 1, route_scale 1.5");
    println!("\n| T | launches | us (graph) | us (loop) |");
    println!("|---|---|---|---|");
    let bias = ((Tensor::rand(0f32, 1.0, e, &dev)? - 0.5)? * 0.2)?;
    for &t in &args.t {
        let logits: Vec<Tensor> = (0..SETS).map(|_| Tensor::randn(0f32, 2.0, (t, e), &dev)).collect::<candle_core::Result<_>>()?;
        let mut i = 0usize;
        let mut call = || -> Result<()> {
            let s = i % SETS;
            i += 1;
            moe_route_device(&logits[s], &bias, k, 1.0, 1.5)?;
            Ok(())
        };
        let graph = timer.graph(SETS, &mut call)?;
        let looped = timer.calls(&mut call)?;
        let launches = if t <= 8 { 1 } else { 2 };
        println!("| {t} | {launches} | {:.2} | {:.2} |", graph * 1e3, looped * 1e3);
    }
    Ok(())
}
