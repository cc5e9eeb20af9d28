//! GPU tests of the batched decode step of one attention layer (`attention::decode_batch`), on
//! the tiny config with V4.1's head_dim 512 (the fused sparse-attention kernel's head dim): the
//! scenario of `tests/decode_batch.rs` (B = 5 sequences at different positions, several steps,
//! every layer of the config: window-only, ratio-2 kv + index sources, reuse layers, the ratio-1
//! candidate source and the ratio-1 `Reindex` candidate consumer) on CUDA against the same step
//! on the CPU within `tests/cuda_layer.rs`'s tolerance, for bf16, packed-key and all-packed pools;
//! and the steps of all layers captured once into a CUDA graph and replayed after each
//! `DecodeStepInputs::update`, bit for bit the eager steps. Each also runs on sequences past one
//! page of the kv sources' paged pools, the GPU pools' pages taken in turn (not adjacent) and the
//! sequences crossing into new pages during the steps (the replays read the page table the
//! updates write).
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_decode_batch`.

use anyhow::{ensure, Context, Result};
use candle_core::cuda_backend::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::BatchStorage;
use deepseek_v41::config::Config;
use deepseek_v41::golden::{compare, Tolerance};

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

#[path = "support/decode_batch_run.rs"]
#[allow(dead_code)]
mod run;
use run::{bits, entry_ids, forward, layer_inputs, positions, prefill, random_layers, Batch};

fn gpu() -> Device {
    deepseek_v41::cuda::decode_device(0).expect("tests/cuda_decode_batch.rs needs a CUDA device (none found): these tests must run on a GPU")
}

fn fixtures() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny"));
    // Packed binaries run on the GPU machine from the repository root.
    if built.is_dir() {
        built
    } else {
        std::path::PathBuf::from("tests/fixtures/v41-tiny")
    }
}

/// The tiny config with V4.1's head_dim 512.
fn config_512() -> Result<Config> {
    let mut cfg = Config::from_file(fixtures().join("config.json"))?;
    cfg.head_dim = 512;
    Ok(cfg)
}

const STARTS: [usize; 5] = [0, 1, 4, 9, 20];
const STEPS: usize = 5;
/// Entries per sequence: the ratio-1 sources hold one per position (up to 25 here).
const ENTRIES: usize = 32;
/// Sequences past one page of 64 entries at the ratio-1 sources, crossing into new pages at
/// different steps (see `tests/decode_batch.rs`).
const PAGED_STARTS: [usize; 5] = [125, 2, 62, 60, 127];
const PAGED_ENTRIES: usize = 192;
const TOL: Tolerance = Tolerance::RelFro { rel_fro: 3e-2, max_abs: None };

/// The same sequences, prefilled on the CPU, stepped in batches on the CPU and on the GPU: every
/// layer's outputs agree within the golden tolerance (bf16 activations, products summed in
/// another order), the top-k sets almost everywhere (near-ties may resolve differently).
#[test]
fn cuda_step_matches_the_cpu_step() -> Result<()> {
    cuda_step_matches_the_cpu_step_on(&STARTS, ENTRIES, false)
}

/// The same over interleaved pages (the GPU's taken in turn, the CPU's in load order).
#[test]
fn cuda_step_matches_the_cpu_step_over_interleaved_pages() -> Result<()> {
    cuda_step_matches_the_cpu_step_on(&PAGED_STARTS, PAGED_ENTRIES, true)
}

fn cuda_step_matches_the_cpu_step_on(starts: &[usize], entries: usize, interleaved: bool) -> Result<()> {
    let (dev, cpu) = (gpu(), Device::Cpu);
    let cfg = config_512()?;
    let (on_cpu, on_gpu) = (random_layers(&cfg, &cpu, 41)?, random_layers(&cfg, &dev, 41)?);
    for storage in [BatchStorage::BF16, BatchStorage::PACKED_KEYS, BatchStorage::PACKED] {
        let mut rng = Rng(0xc0da);
        let seqs = prefill(&cfg, &on_cpu, starts, &mut rng, &cpu)?;
        let b = starts.len();
        let want = Batch::new(&cfg, &on_cpu, b, entries, BatchStorage::BF16, &cpu)?;
        let got = Batch::new(&cfg, &on_gpu, b, entries, storage, &dev)?;
        want.load(&seqs)?;
        if interleaved {
            got.load_interleaved(&seqs)?;
            ensure!(got.pages_interleaved(), "the GPU pools' pages are adjacent");
        } else {
            got.load(&seqs)?;
        }
        ensure!(got.caches[1].window_rows().tensor().device().is_cuda());
        let (want_steps, got_steps) = (want.steps()?, got.steps()?);
        let (mut same, mut total) = (0usize, 0usize);
        for t in 0..STEPS {
            let pos = positions(starts, t, cfg.sliding_window)?;
            want.update(&pos)?;
            got.update(&pos)?;
            let xs = layer_inputs(&cfg, &mut rng, b, &cpu)?;
            let xg = xs.iter().map(|x| x.to_device(&dev)).collect::<candle_core::Result<Vec<_>>>()?;
            let (w, g) = (forward(&want_steps, &xs)?, forward(&got_steps, &xg)?);
            for l in 0..cfg.num_hidden_layers {
                ensure!(g[l].y.device().is_cuda(), "layer {l} did not run on the GPU");
                let o = compare(&format!("L{l}"), &g[l].y, &w[l].y, TOL)?;
                ensure!(o.pass, "{storage:?}, step {t}: {o}");
                if let (Some(gk), Some(wk)) = (&g[l].topk, &w[l].topk) {
                    let (gk, wk) = (entry_ids(gk, got.pages(l))?, entry_ids(wk, want.pages(l))?);
                    for (a, b) in gk.iter().zip(&wk) {
                        same += a.iter().filter(|j| b.contains(j)).count();
                        total += a.len();
                    }
                }
            }
            // Negative control: another layer's output does not pass.
            let o = compare("L1 vs L3", &g[1].y, &w[3].y, TOL)?;
            ensure!(!o.pass, "negative control passed: {o}");
        }
        ensure!(same * 10 >= total * 9, "{storage:?}: only {same} of {total} top-k ids agree with the CPU");
    }
    Ok(())
}

/// All layers' steps captured once into a CUDA graph (with Candle's host-upload cache on
/// around the warm-up and the capture) and replayed after each `update`, the layer inputs
/// written into the captured input tensors and the outputs copied into fixed tensors inside the
/// graph: bit for bit the same steps run eagerly on a second set of pools, step after step (the
/// replays read the new positions: outputs change every step).
#[test]
fn graph_replay_equals_eager_steps() -> Result<()> {
    graph_replay_equals_eager_steps_on(&STARTS, ENTRIES, false)
}

/// The same with the sequences crossing into new pages between replays, the graphed pools'
/// pages taken in turn (the eager pools' in load order).
#[test]
fn graph_replay_equals_eager_steps_over_interleaved_pages() -> Result<()> {
    graph_replay_equals_eager_steps_on(&PAGED_STARTS, PAGED_ENTRIES, true)
}

fn graph_replay_equals_eager_steps_on(starts: &[usize], entries: usize, interleaved: bool) -> Result<()> {
    let dev = gpu();
    let cuda = dev.as_cuda_device()?.clone();
    let stream = cuda.cuda_stream();
    let cfg = config_512()?;
    let layers = random_layers(&cfg, &dev, 43)?;
    let mut rng = Rng(0x9a4f);
    let seqs = prefill(&cfg, &layers, starts, &mut rng, &dev)?;
    let b = starts.len();
    for storage in [BatchStorage::BF16, BatchStorage::PACKED_KEYS, BatchStorage::PACKED] {
        let eager = Batch::new(&cfg, &layers, b, entries, storage, &dev)?;
        let graphed = Batch::new(&cfg, &layers, b, entries, storage, &dev)?;
        eager.load(&seqs)?;
        if interleaved {
            graphed.load_interleaved(&seqs)?;
            ensure!(graphed.pages_interleaved(), "the graphed pools' pages are adjacent");
        } else {
            graphed.load(&seqs)?;
        }
        let (eager_steps, graph_steps) = (eager.steps()?, graphed.steps()?);
        let x_in = layer_inputs(&cfg, &mut rng, b, &dev)?;
        let y_out = (0..cfg.num_hidden_layers).map(|_| Tensor::zeros((b, cfg.hidden_size), DType::BF16, &dev)).collect::<candle_core::Result<Vec<_>>>()?;
        let pos = positions(starts, 0, cfg.sliding_window)?;
        graphed.update(&pos)?;
        let graph = {
            let _uploads = cuda.enable_cuda_graph_htod_cache();
            // Warm-up (fills the upload cache; a repeated step at the same positions changes nothing).
            forward(&graph_steps, &x_in)?;
            stream.synchronize()?;
            stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
            let captured = forward(&graph_steps, &x_in).and_then(|outs| {
                for (o, y) in outs.iter().zip(&y_out) {
                    y.slice_set(&o.y, 0, 0)?;
                }
                Ok(())
            });
            let graph = stream.end_capture(CUgraphInstantiate_flags(0));
            captured.context("a step failed during the capture")?;
            graph?.context("the capture returned no graph")?
        };
        let mut previous: Option<Vec<u32>> = None;
        let used = |b: &Batch| -> Vec<usize> { b.caches.iter().filter_map(|c| c.pages()).map(|p| p.used()).collect() };
        let first_used = used(&graphed);
        for t in 0..STEPS {
            let pos = positions(starts, t, cfg.sliding_window)?;
            eager.update(&pos)?;
            graphed.update(&pos)?;
            let xs = layer_inputs(&cfg, &mut rng, b, &dev)?;
            for (fixed, x) in x_in.iter().zip(&xs) {
                fixed.slice_set(x, 0, 0)?;
            }
            let want = forward(&eager_steps, &xs)?;
            graph.launch()?;
            stream.synchronize()?;
            for l in 0..cfg.num_hidden_layers {
                ensure!(bits(&y_out[l])? == bits(&want[l].y)?, "{storage:?}, step {t}, layer {l}: the replay differs from the eager step");
            }
            let now = bits(&y_out[1])?;
            ensure!(previous.as_ref() != Some(&now), "{storage:?}, step {t}: the replay repeated the previous step's output");
            previous = Some(now);
        }
        let last_used = used(&graphed);
        ensure!(!interleaved || first_used.iter().zip(&last_used).all(|(a, b)| b > a), "the replays took no page: {first_used:?} → {last_used:?}");
    }
    Ok(())
}
