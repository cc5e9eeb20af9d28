//! Benchmark of one V4.1-Flash attention layer on CUDA (issue 6): decode step latency at a long
//! context with a per-phase breakdown, prefill throughput, peak GPU memory, and plain-Candle
//! baselines of the steps that have fused kernels.
//!
//! ```text
//! cargo build --release --features cuda --example bench_attention_layer
//! bench_attention_layer [--config tests/fixtures/deepseek-v41-flash/config.json] [--context 131072]
//!     [--steps 20] [--prefill 4096,8192,16384,32768] [--prefill-compressed 4096]
//!     [--plain-steps 5] [--plain-prefill 4096]
//! ```
//!
//! Weights are random ([`RandomWeights`], bf16). The decode layer is layer 2 of V4.1-Flash (ratio
//! 2, kv source and index source, top-k 512); its cache is filled with a synthetic context of
//! `--context` tokens (random compressed entries and index keys) through
//! `SequenceCache::restore_layer`. Phases are timed by synchronizing the device after each
//! (host clock, median over the steps); the un-instrumented step is timed separately. The
//! plain-Candle baseline is the same layer with the fused kernels switched off
//! ([`with_plain_candle`]: the reference path's Candle ops on the GPU). Peak memory is the
//! high-water mark of candle's CUDA memory pool ([`PoolPeak`]). Only
//! B = 1: the layer API takes one sequence's cache (see docs/perf.md for the batched design).

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use deepseek_v41::attention::sparse_attention::sparse_attention_candle;
use deepseek_v41::attention::{Attention, LayerPhase, SequenceCache};
use deepseek_v41::config::{AttentionRole, Config};
use deepseek_v41::cuda::{sparse_attention_two_source, with_plain_candle};
use deepseek_v41::nn::RandomWeights;
use deepseek_v41::quant::fp8_activation_quant;
use deepseek_v41::Numerics;

#[path = "support/bench.rs"]
mod bench;
use bench::{gib, median, PoolPeak};

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "tests/fixtures/deepseek-v41-flash/config.json")]
    config: std::path::PathBuf,
    /// Context length of the decode steps.
    #[arg(long, default_value_t = 131072)]
    context: usize,
    /// Measured decode steps (after 3 warm-up steps).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Prefill lengths of the window-only layer.
    #[arg(long, value_delimiter = ',', default_value = "4096,8192,16384,32768")]
    prefill: Vec<usize>,
    /// Prefill lengths of the compressed (ratio-2) layer, selection on the device.
    #[arg(long, value_delimiter = ',', default_value = "4096")]
    prefill_compressed: Vec<usize>,
    /// Prefill lengths at which the whole layer is also run in plain Candle ops.
    #[arg(long, value_delimiter = ',', default_value = "4096")]
    plain_prefill: Vec<usize>,
    /// Decode steps of the whole layer in plain Candle ops (0 = skip).
    #[arg(long, default_value_t = 5)]
    plain_steps: usize,
}

const PHASES: [LayerPhase; 5] =
    [LayerPhase::Projections, LayerPhase::Inserts, LayerPhase::Selection, LayerPhase::Attention, LayerPhase::Output];

fn randn(shape: (usize, usize), dev: &Device) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(DType::BF16)?)
}

/// One layer call with per-phase timings (ms) when `phases` is set.
fn timed_call(a: &Attention, x: &Tensor, pos: usize, cache: &mut SequenceCache, dev: &Device, phases: Option<&mut Vec<Vec<f64>>>) -> Result<f64> {
    dev.synchronize()?;
    let t0 = Instant::now();
    match phases {
        Some(ph) => {
            let mut last = Instant::now();
            let mut i = 0;
            a.forward_fused(x, pos, cache, &mut |_| {
                dev.synchronize().expect("synchronize");
                let now = Instant::now();
                ph[i].push((now - last).as_secs_f64() * 1e3);
                last = now;
                i += 1;
            })?;
        }
        None => {
            a.forward(x, pos, cache)?;
        }
    }
    dev.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() * 1e3)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::new_cuda(0)?;
    let cfg = Config::from_file(&args.config).with_context(|| format!("reading {}", args.config.display()))?;
    let (hd, d) = (cfg.head_dim, cfg.hidden_size);
    let decode_layer = cfg
        .layers
        .iter()
        .position(|r| matches!(r.attention, AttentionRole::Compressed { ratio: 2, kv_source, .. } if kv_source == r.layer))
        .context("no ratio-2 kv source layer")?;
    let window_layer = cfg.layers.iter().position(|r| r.attention == AttentionRole::WindowOnly).context("no window-only layer")?;
    let AttentionRole::Compressed { ratio, .. } = cfg.layers[decode_layer].attention else { unreachable!() };
    println!(
        "config: hidden {d}, {} heads x {hd}, q_lora {}, o_groups {} x o_lora {}, window {}, index {} heads x {}, top-k {}",
        cfg.num_attention_heads, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.sliding_window, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    );
    let pool = PoolPeak::new(&dev.as_cuda_device()?.cuda_stream())?;
    let base_mem = pool.used()?;
    let vb = RandomWeights::new(1).var_builder(DType::BF16, &dev);
    let t = Instant::now();
    let layer = Attention::new(&cfg, decode_layer, Numerics::REFERENCE, vb.pp("layers").pp(decode_layer).pp("attn"))?;
    let wlayer = Attention::new(&cfg, window_layer, Numerics::REFERENCE, vb.pp("layers").pp(window_layer).pp("attn"))?;
    dev.synchronize()?;
    let weights_mem = pool.used()?;
    println!("weights: layers {decode_layer} (ratio {ratio}) and {window_layer} (window only) built in {:.1} s, {:.2} GiB on the device", t.elapsed().as_secs_f64(), gib(weights_mem - base_mem));

    // ---- decode at --context
    let ctx = args.context - args.context % ratio;
    let n = ctx / ratio;
    let mut cache = SequenceCache::new(&cfg, DType::BF16, &dev)?;
    let compressed = (randn((n, hd), &dev)? * 0.5)?;
    let keys = (randn((n, cfg.index_head_dim), &dev)? * 0.5)?;
    cache.restore_layer(decode_layer, ctx, &randn((cfg.sliding_window, hd), &dev)?, Some((&compressed, &keys)))?;
    drop((compressed, keys));
    let x = randn((1, d), &dev)?;
    dev.synchronize()?;
    let cache_mem = pool.used()?;
    pool.reset()?;
    let mut pos = ctx;
    for _ in 0..3 {
        timed_call(&layer, &x, pos, &mut cache, &dev, None)?;
        pos += 1;
    }
    let mut phases = vec![Vec::new(); PHASES.len()];
    let mut totals = Vec::new();
    for _ in 0..args.steps {
        timed_call(&layer, &x, pos, &mut cache, &dev, Some(&mut phases))?;
        pos += 1;
        let plain = timed_call(&layer, &x, pos, &mut cache, &dev, None)?;
        pos += 1;
        totals.push(plain);
    }
    dev.synchronize()?;
    let step_peak = pool.peak()?;
    println!("\n## decode, B = 1, context {ctx} (layer {decode_layer}), median of {} steps", args.steps);
    println!("| phase | ms |\n|---|---|");
    let mut sum = 0.0;
    for (p, v) in PHASES.iter().zip(phases.iter_mut()) {
        let m = median(std::mem::take(v));
        sum += m;
        println!("| {p:?} | {m:.3} |");
    }
    println!("| sum of phases (synchronized) | {sum:.3} |");
    println!("| whole step, no sync inside | {:.3} |", median(totals));
    if args.plain_steps > 0 {
        // The same layer, cache and GPU with the fused kernels switched off: the reference path's
        // plain Candle ops (host round trips where Candle has no op: fake quant, top-k).
        let mut plain = Vec::new();
        for i in 0..args.plain_steps + 1 {
            let ms = with_plain_candle(|| timed_call(&layer, &x, pos, &mut cache, &dev, None))?;
            pos += 1;
            if i > 0 {
                plain.push(ms);
            }
        }
        println!("| whole step, plain Candle ops (`cuda::with_plain_candle`, median of {}) | {:.3} |", args.plain_steps, median(plain));
    }
    println!(
        "\ndevice memory (candle's pool, high-water mark): weights {:.2} GiB, cache of {ctx} tokens {:.3} GiB, peak during the steps {:.3} GiB (transient {:.1} MiB per step)",
        gib(weights_mem - base_mem),
        gib(cache_mem - weights_mem),
        gib(step_peak - base_mem),
        (step_peak - cache_mem) as f64 / (1u64 << 20) as f64
    );
    let w_bytes = 2.0
        * (d * cfg.q_lora_rank + cfg.q_lora_rank * cfg.num_attention_heads * hd + d * hd
            + cfg.o_groups * cfg.o_lora_rank * (cfg.num_attention_heads / cfg.o_groups * hd)
            + cfg.o_groups * cfg.o_lora_rank * d + cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_n_heads) as f64
        + 4.0 * 2.0 * (d * hd) as f64;
    let kv_bytes = 2.0 * ((cfg.sliding_window + cfg.index_topk) * hd + n * cfg.index_head_dim) as f64;
    println!(
        "roofline (4.17 TB/s): weights {:.1} MB + window/top-k rows and index keys {:.1} MB = {:.3} ms",
        w_bytes / 1e6,
        kv_bytes / 1e6,
        (w_bytes + kv_bytes) / 4.17e12 * 1e3
    );

    // ---- plain-Candle baselines of the fused steps (decode shapes)
    println!("\n## fused op vs plain Candle (same GPU, decode shapes)");
    println!("| op | fused ms | plain ms |\n|---|---|---|");
    let h = cfg.num_attention_heads;
    let q = Tensor::randn(0f32, 1.0, (1, h, hd), &dev)?.to_dtype(DType::BF16)?;
    let kvw = randn((cfg.sliding_window, hd), &dev)?;
    let kvc = randn((n, hd), &dev)?;
    let iw = Tensor::arange(0i64, cfg.sliding_window as i64, &dev)?.reshape((1, ()))?;
    let ic = Tensor::arange(0i64, cfg.index_topk as i64, &dev)?.affine(((n / cfg.index_topk).max(1)) as f64, 0.0)?.reshape((1, ()))?;
    let sink = Tensor::zeros(h, DType::F32, &dev)?;
    let scale = (hd as f32).powf(-0.5);
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        for _ in 0..3 {
            f()?;
        }
        let mut v = Vec::new();
        for _ in 0..20 {
            dev.synchronize()?;
            let t0 = Instant::now();
            f()?;
            dev.synchronize()?;
            v.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        Ok(median(v))
    };
    let fused = time(&mut || Ok(sparse_attention_two_source(&q, &kvw, &iw, &kvc, &ic, &sink, scale).map(|_| ())?))?;
    let plain = time(&mut || Ok(sparse_attention_candle(&q, &[(&kvw, &iw), (&kvc, &ic)], &sink, scale).map(|_| ())?))?;
    println!("| sparse attention (64 heads, 128 + 512 rows) | {fused:.3} | {plain:.3} |");
    let xa = randn((1, cfg.o_groups * cfg.o_lora_rank), &dev)?;
    let fused = time(&mut || Ok(fp8_activation_quant(&xa).map(|_| ())?))?;
    let plain = time(&mut || Ok(fp8_activation_quant(&xa.to_device(&Device::Cpu)?)?.to_device(&dev).map(|_| ())?))?;
    println!("| fp8 activation quant [1, {}] (plain = host round trip, the previous path) | {fused:.3} | {plain:.3} |", cfg.o_groups * cfg.o_lora_rank);
    drop((kvc, ic));

    // ---- prefill
    println!("\n## prefill, one call from position 0");
    println!("| layer | tokens | ms | tokens/s | breakdown (ms): proj / inserts / selection / attention / output | peak GiB of the call (its cache + transients; pool high-water mark minus what was held before) | plain Candle ms |\n|---|---|---|---|---|---|---|");
    for (a, lens, name) in [(&wlayer, &args.prefill, "window-only"), (&layer, &args.prefill_compressed, "ratio-2 (device selection)")] {
        for &tl in lens.iter() {
            let x = randn((tl, d), &dev)?;
            dev.synchronize()?;
            let held = pool.used()?;
            pool.reset()?;
            let mut best = f64::INFINITY;
            let mut ph_best = vec![];
            for _ in 0..2 {
                let mut c = SequenceCache::new(&cfg, DType::BF16, &dev)?;
                let mut ph = vec![Vec::new(); PHASES.len()];
                let ms = timed_call(a, &x, 0, &mut c, &dev, Some(&mut ph))?;
                if ms < best {
                    best = ms;
                    ph_best = ph.iter().map(|v| v[0]).collect();
                }
            }
            let b: Vec<String> = ph_best.iter().map(|v| format!("{v:.1}")).collect();
            dev.synchronize()?;
            let peak = gib(pool.peak()?.saturating_sub(held));
            let plain = if args.plain_prefill.contains(&tl) {
                let mut c = SequenceCache::new(&cfg, DType::BF16, &dev)?;
                match with_plain_candle(|| timed_call(a, &x, 0, &mut c, &dev, None)) {
                    Ok(ms) => format!("{ms:.1}"),
                    Err(e) => format!("error: {e}"),
                }
            } else {
                "—".into()
            };
            println!("| {name} | {tl} | {best:.1} | {:.0} | {} | {peak:.2} | {plain} |", tl as f64 / best * 1e3, b.join(" / "));
        }
    }
    Ok(())
}
