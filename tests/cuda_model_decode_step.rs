//! GPU tests of the whole-model batched decode step (`model::ModelDecodeStep`) on the scenario
//! of `tests/model_decode_step.rs` (its rewritten config and the tiny config as released, with
//! ratio-1 sources and candidate blocks) with V4.1's head_dim 512 (the fused sparse-attention kernel's
//! head dim) and MXFP4 routed experts (`support/mxfp4_experts.rs`: the MoE runs on the device):
//! * the step on CUDA against the same step on the CPU (sequences prefilled once on the CPU and
//!   loaded into both), within the golden logits tolerance (bf16 activations; products summed in
//!   another order) or, where the model's own CUDA path is noisier than that on a config, no
//!   more than 1.25 × that path's distance from the CPU (the sequences prefilled and stepped by
//!   `Model::forward` / `forward_batch` on CUDA, the path the golden checker accepts); greedy
//!   ids almost everywhere;
//! * the step captured once into a CUDA graph (`model::GraphedDecodeStep`: logits and sampled
//!   ids copied into fixed tensors inside the graph) and replayed after each update of tokens,
//!   positions and sampling steps: bit for bit the eager step on a second set of pools, logits
//!   and temperature-sampled ids, step after step; the same over the paged pools with sequences
//!   crossing into new pages and a released row loaded with a new sequence between replays;
//! * one graph per batch-size bucket (`GraphedDecodeStep::capture_buckets`, 1 / 2 / 4 / 8 over
//!   one set of pools): sequences joining and leaving, each step replaying the smallest bucket
//!   that holds them, bit for bit the eager step over the same rows (`update_first` +
//!   `forward_rows`), logits and sampled ids;
//! * replays that follow the last one on the device (`GraphedDecodeStep::step_next_ids`: tokens
//!   and Engram ids written on the device, the ids read back while the next step runs): bit for
//!   bit the host-driven replays;
//! * `SteppedGeneration` with graph replay (followed steps) gives its eager steps' tokens;
//! * the step inputs' derived rows (`kernels/step_inputs.cu`: RoPE rows, window indices, closing
//!   flags, visible counts) bit for bit the Candle ops they replace (`derive_ref`), over poisoned
//!   outputs, for whole batches, idle rows and leading views.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_model_decode_step`.

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::BatchStorage;
use deepseek_v41::config::Config;
use deepseek_v41::golden::{compare, Tolerance};
use deepseek_v41::model::{GraphedDecodeStep, Model, ModelCache, ModelDecodeStep};
use deepseek_v41::sampling::{sample_batch, SamplingBatch, SamplingParams};
use deepseek_v41::Numerics;

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

#[path = "support/model_step_run.rs"]
#[allow(dead_code)]
mod run;
use run::{bits, eager_step, full_config, prefill, step_config, token_map, tokens, CAPACITY, STARTS};

#[path = "support/mxfp4_experts.rs"]
mod mxfp4_experts;
use mxfp4_experts::Mxfp4Experts;

const STEPS: usize = 5;
const TOL: Tolerance = Tolerance::RelFro { rel_fro: 3e-2, max_abs: None };

fn gpu() -> Device {
    deepseek_v41::cuda::decode_device(0).expect("tests/cuda_model_decode_step.rs needs a CUDA device (none found): these tests must run on a GPU")
}

fn model(cfg: &Config, dev: &Device) -> Result<Model> {
    Ok(Model::new(cfg, Numerics::REFERENCE, Some(token_map(cfg)), Mxfp4Experts::new(23).var_builder(DType::BF16, dev))?)
}

/// A step over `caches` (prefilled on the CPU) on `dev`.
fn step<'m>(cfg: &Config, m: &'m Model, caches: &[ModelCache], dev: &Device) -> Result<ModelDecodeStep<'m>> {
    let mut s = ModelDecodeStep::new(cfg, m, STARTS.len(), CAPACITY, BatchStorage::BF16, dev)?;
    for (i, c) in caches.iter().enumerate() {
        s.load(i, c)?;
    }
    Ok(s)
}

/// Both configs: the rewritten one (ratio-2 sources and reuse layers only) and the tiny config
/// as released (ratio-1 sources, candidate blocks and their reindex layers too).
fn configs() -> Result<[Config; 2]> {
    Ok([step_config(512)?, full_config(512)?])
}

#[test]
fn cuda_step_matches_the_cpu_step() -> Result<()> {
    for cfg in configs()? {
        cuda_step_matches_the_cpu_step_on(&cfg).with_context(|| format!("compress ratios {:?}", cfg.compress_ratios))?;
    }
    Ok(())
}

fn cuda_step_matches_the_cpu_step_on(cfg: &Config) -> Result<()> {
    let (dev, cpu) = (gpu(), Device::Cpu);
    let (on_cpu, on_gpu) = (model(cfg, &cpu)?, model(cfg, &dev)?);
    let mut rng = Rng(0xc0de);
    let caches = prefill(cfg, &on_cpu, &mut rng, &cpu)?;
    // The model's CUDA path on the same tokens: the noise floor of this config on this device.
    let mut path_caches = prefill(cfg, &on_gpu, &mut Rng(0xc0de), &dev)?;
    let (mut want, mut got) = (step(cfg, &on_cpu, &caches, &cpu)?, step(cfg, &on_gpu, &caches, &dev)?);
    ensure!(got.host_reads().is_empty(), "the GPU step reads the host: {:?}", got.host_reads());
    let (mut same, mut total) = (0usize, 0usize);
    let mut pos: Vec<usize> = STARTS.to_vec();
    for t in 0..STEPS {
        let toks = tokens(&mut rng, STARTS.len(), cfg.vocab_size);
        want.update(&toks, &pos)?;
        got.update(&toks, &pos)?;
        let (w, g) = (want.forward()?, got.forward()?);
        ensure!(g.device().is_cuda(), "the logits are not on the GPU");
        let o = compare("logits", &g, &w, TOL)?;
        let path = compare("logits", &eager_step(&on_gpu, &mut path_caches, &toks)?, &w, TOL)?;
        eprintln!("step {t}: {o}; the model's CUDA path: {path}");
        ensure!(o.pass || (o.mismatches == 0 && o.rel_fro <= 1.25 * path.rel_fro), "step {t}: {o}; the model's CUDA path: {path}");
        let argmax = |x: &Tensor| -> Result<Vec<u32>> { Ok(x.argmax(candle_core::D::Minus1)?.to_dtype(DType::U32)?.to_device(&cpu)?.to_vec1::<u32>()?) };
        let (a, b) = (argmax(&g)?, argmax(&w)?);
        same += a.iter().zip(&b).filter(|(x, y)| x == y).count();
        total += a.len();
        pos.iter_mut().for_each(|p| *p += 1);
    }
    ensure!(same * 10 >= total * 8, "only {same} of {total} greedy ids agree with the CPU");
    Ok(())
}

#[test]
fn graph_replay_equals_eager_steps() -> Result<()> {
    for cfg in configs()? {
        graph_replay_equals_eager_steps_on(&cfg).with_context(|| format!("compress ratios {:?}", cfg.compress_ratios))?;
    }
    Ok(())
}

fn graph_replay_equals_eager_steps_on(cfg: &Config) -> Result<()> {
    let (dev, cpu) = (gpu(), Device::Cpu);
    let (on_cpu, on_gpu) = (model(cfg, &cpu)?, model(cfg, &dev)?);
    let mut rng = Rng(0x9a4f);
    let caches = prefill(cfg, &on_cpu, &mut rng, &cpu)?;
    let b = STARTS.len();
    let mut eager = step(cfg, &on_gpu, &caches, &dev)?;
    // Temperature sampling with per-sequence seeds: the replayed draws must follow the steps.
    let params: Vec<SamplingParams> = (0..b).map(|s| SamplingParams { temperature: 0.9, top_k: 0, top_p: 0.95, seed: 17 + s as u64 }).collect();
    let mut pos: Vec<usize> = STARTS.to_vec();
    let mut toks = tokens(&mut rng, b, cfg.vocab_size);
    let graphed = GraphedDecodeStep::capture(step(cfg, &on_gpu, &caches, &dev)?, SamplingBatch::new(params.clone(), vec![0; b], &dev)?, &toks, &pos);
    let mut graphed = graphed.context("capturing the step")?;
    ensure!(graphed.graphs()[0].1.nodes() > 0, "an empty graph");
    let mut previous: Option<Vec<u32>> = None;
    for t in 0..STEPS {
        let steps = vec![t as u64; b];
        if t > 0 {
            toks = tokens(&mut rng, b, cfg.vocab_size);
            graphed.step(&toks, &pos, &steps)?;
        }
        eager.update(&toks, &pos)?;
        let (want, want_ids) = eager.forward_sampled(&SamplingBatch::new(params.clone(), steps, &dev)?)?;
        ensure!(bits(&graphed.logits()?)? == bits(&want)?, "step {t} at {pos:?}: the replayed logits differ from the eager step");
        ensure!(graphed.ids()?.to_vec1::<u32>()? == want_ids.to_vec1::<u32>()?, "step {t}: sampled ids");
        let now = bits(&graphed.logits()?)?;
        ensure!(previous.as_ref() != Some(&now), "step {t}: the replay repeated the previous step's logits");
        previous = Some(now);
        pos.iter_mut().for_each(|p| *p += 1);
    }
    Ok(())
}

/// Replays that follow the last one on the device (`GraphedDecodeStep::step_next_ids`: the
/// sampled ids stay on the device, their Engram ids hashed there, each step's ids read back
/// while the next one runs) equal replays whose tokens the host reads back and gives with
/// `step`, bit for bit, logits and temperature-sampled ids, step after step, on both configs;
/// the host takes over once mid-run (its histories catch up from the device).
#[test]
fn followed_replays_equal_host_driven_replays() -> Result<()> {
    for cfg in configs()? {
        followed_replays_on(&cfg).with_context(|| format!("compress ratios {:?}", cfg.compress_ratios))?;
    }
    Ok(())
}

fn followed_replays_on(cfg: &Config) -> Result<()> {
    let (dev, cpu) = (gpu(), Device::Cpu);
    let (on_cpu, on_gpu) = (model(cfg, &cpu)?, model(cfg, &dev)?);
    let mut rng = Rng(0xf0110);
    let caches = prefill(cfg, &on_cpu, &mut rng, &cpu)?;
    let b = STARTS.len();
    let params: Vec<SamplingParams> = (0..b).map(|s| SamplingParams { temperature: 0.9, top_k: 0, top_p: 0.95, seed: 29 + s as u64 }).collect();
    let mut pos: Vec<usize> = STARTS.to_vec();
    let toks = tokens(&mut rng, b, cfg.vocab_size);
    let capture = || -> Result<GraphedDecodeStep> { Ok(GraphedDecodeStep::capture(step(cfg, &on_gpu, &caches, &dev)?, SamplingBatch::new(params.clone(), vec![0; b], &dev)?, &toks, &pos)?) };
    let (mut host, mut followed) = (capture().context("capturing the host-driven step")?, capture().context("capturing the followed step")?);
    let mut last = host.ids()?.to_vec1::<u32>()?;
    for t in 1..8u64 {
        let steps = vec![t; b];
        pos.iter_mut().for_each(|p| *p += 1);
        host.step(&last, &pos, &steps)?;
        let before = if t == 4 {
            // The host gives the tokens once: the followed step's histories catch up first.
            followed.step(&last, &pos, &steps)?;
            last.clone()
        } else {
            followed.step_next_ids(&steps)?
        };
        ensure!(before == last, "step {t}: the ids read while the next step ran differ from the host-driven step's");
        ensure!(bits(&followed.logits()?)? == bits(&host.logits()?)?, "step {t} at {pos:?}: the followed replay's logits differ");
        last = host.ids()?.to_vec1::<u32>()?;
        ensure!(followed.ids()?.to_vec1::<u32>()? == last, "step {t}: sampled ids");
    }
    Ok(())
}

/// `SteppedGeneration` with graph replay (the first decode step captured, the later ones
/// following it on the device, each token read back while the next step runs) gives the tokens
/// of its eager steps on the same GPU (bit-for-bit logits), greedy and sampled, to the budget and
/// to an EOS — with the same number of draws made (the step enqueued past the EOS discarded).
#[test]
fn stepped_generation_replays_give_the_eager_steps_tokens() -> Result<()> {
    use deepseek_v41::generation::{Sampler, Sampling, SteppedGeneration};
    let cfg = step_config(512)?;
    let dev = gpu();
    let m = model(&cfg, &dev)?;
    let mut rng = Rng(0x57e9);
    let prompt = tokens(&mut rng, 9, cfg.vocab_size);
    let eager = SteppedGeneration { model: &m, config: &cfg, graph: false };
    let graphed = SteppedGeneration { graph: true, ..eager };
    for sampling in [Sampling::GREEDY, Sampling { temperature: 0.9, top_p: 0.95, seed: 5 }] {
        let run = |g: &SteppedGeneration, max_new: usize, eos: Option<u32>| -> Result<(Vec<u32>, u64)> {
            let mut sampler = Sampler::new(sampling)?;
            let mut streamed = Vec::new();
            let out = g.generate(&mut ModelCache::new(&cfg, DType::BF16, &dev)?, &prompt, max_new, &mut sampler, eos, |id| {
                streamed.push(id);
                Ok(())
            })?;
            ensure!(streamed == out, "streamed tokens differ from the returned ones");
            Ok((out, sampler.step()))
        };
        let want = run(&eager, 24, None)?;
        ensure!(want.0.len() == 24, "{} tokens", want.0.len());
        ensure!(run(&graphed, 24, None)? == want, "{sampling:?}: the replayed generation differs");
        ensure!(run(&graphed, 2, None)? == run(&eager, 2, None)?, "{sampling:?}: a budget of 2");
        let eos = want.0[10];
        let (stopped, draws) = run(&graphed, 24, Some(eos))?;
        let first = want.0.iter().position(|&t| t == eos).unwrap_or(10);
        ensure!(stopped == want.0[..=first], "{sampling:?} with EOS {eos}: {stopped:?}");
        ensure!(draws == first as u64 + 1, "{sampling:?}: {draws} draws for {} tokens", first + 1);
    }
    Ok(())
}

/// Prefill lengths past most of a page of 64 entries at the ratio-1 sources: the sequences take
/// their second pages at different steps (not adjacent to their first).
const PAGED_STARTS: [usize; 4] = [61, 62, 63, 59];

/// The tiny config as released over the paged pools: the sequences cross into new pages between
/// replays (the updates write the page table the captured step reads), and a row released and
/// loaded with a new sequence between two replays; the replayed logits equal the eager step's
/// (a second set of pools, the same updates) bit for bit, step after step.
#[test]
fn graph_replay_over_interleaved_pages() -> Result<()> {
    let cfg = full_config(512)?;
    let (dev, cpu) = (gpu(), Device::Cpu);
    let (on_cpu, on_gpu) = (model(&cfg, &cpu)?, model(&cfg, &dev)?);
    let mut rng = Rng(0x9a6e);
    let caches = run::prefill_lengths(&cfg, &on_cpu, &PAGED_STARTS, &mut rng, &cpu)?;
    let fresh = run::prefill_lengths(&cfg, &on_cpu, &[7], &mut rng, &cpu)?.remove(0);
    let b = PAGED_STARTS.len();
    let new_step = || -> Result<ModelDecodeStep> {
        let mut s = ModelDecodeStep::with_pool_tokens(&cfg, &on_gpu, b, 160, 640, BatchStorage::BF16, &dev)?;
        for (i, c) in caches.iter().enumerate() {
            s.load(i, c)?;
        }
        Ok(s)
    };
    let mut eager = new_step()?;
    let mut pos: Vec<usize> = PAGED_STARTS.to_vec();
    let mut toks = tokens(&mut rng, b, cfg.vocab_size);
    let greedy = SamplingBatch::new(vec![SamplingParams::GREEDY; b], vec![0; b], &dev)?;
    let mut graphed = GraphedDecodeStep::capture(new_step()?, greedy, &toks, &pos).context("capturing the step")?;
    let ratio1 = |s: &ModelDecodeStep| s.page_occupancy().into_iter().filter(|o| cfg.compress_ratios[o.layer] == 1).map(|o| o.used).sum::<usize>();
    let first_used = ratio1(graphed.inner());
    for t in 0..7 {
        if t == 4 {
            // Row 1 is done: a new sequence of 7 tokens in its row, in both steps.
            for s in [&mut eager, graphed.step_mut()] {
                s.release(1)?;
                s.load(1, &fresh)?;
            }
            pos[1] = 7;
        }
        if t > 0 {
            toks = tokens(&mut rng, b, cfg.vocab_size);
            graphed.step(&toks, &pos, &vec![0; b])?;
        }
        eager.update(&toks, &pos)?;
        let want = eager.forward()?;
        ensure!(bits(&graphed.logits()?)? == bits(&want)?, "step {t} at {pos:?}: the replayed logits differ from the eager step");
        pos.iter_mut().for_each(|p| *p += 1);
    }
    ensure!(ratio1(graphed.inner()) > first_used, "the replays took no page");
    let interleaved = graphed.inner().caches().iter().filter_map(|c| c.pages()).any(|p| (0..b).any(|s| p.pages_of(s).windows(2).any(|w| w[1] != w[0] + 1)));
    ensure!(interleaved, "no sequence holds pages that are not adjacent");
    Ok(())
}

/// Buckets 1 / 2 / 4 / 8 captured over one set of pools of 8 rows before any sequence: 3
/// sequences (bucket 4), a fourth joining (4), a fifth (8), the fifth leaving (4); each replay's
/// logits equal the eager step's over the bucket's rows bit for bit, its temperature-sampled ids
/// those drawn from the eager logits. More sequences than the largest bucket, and a step that
/// would idle a row holding a sequence, are errors.
#[test]
fn bucket_graphs_equal_the_eager_rows() -> Result<()> {
    let cfg = full_config(512)?;
    let (dev, cpu) = (gpu(), Device::Cpu);
    let (on_cpu, on_gpu) = (model(&cfg, &cpu)?, model(&cfg, &dev)?);
    let mut rng = Rng(0xb0c7);
    let caches = run::prefill_lengths(&cfg, &on_cpu, &[61, 62, 63, 59, 7], &mut rng, &cpu)?;
    let rows = 8;
    let params: Vec<SamplingParams> = (0..rows).map(|s| SamplingParams { temperature: 0.8, top_k: 0, top_p: 0.95, seed: 11 + s as u64 }).collect();
    let sampling = SamplingBatch::new(params.clone(), vec![0; rows], &dev)?;
    let mut eager = ModelDecodeStep::new(&cfg, &on_gpu, rows, 160, BatchStorage::BF16, &dev)?;
    let mut graphed = GraphedDecodeStep::capture_buckets(ModelDecodeStep::new(&cfg, &on_gpu, rows, 160, BatchStorage::BF16, &dev)?, sampling, &[])?;
    let sizes: Vec<usize> = graphed.graphs().iter().map(|g| g.0).collect();
    ensure!(sizes == [1, 2, 4, 8], "buckets {sizes:?}");
    let mut pos: Vec<usize> = Vec::new();
    for t in 0..9 {
        // Who is in the batch: rows 0..3, then row 3 joins at step 3, row 4 at step 5, row 4 leaves at step 7.
        let join = match t {
            0 => 0..3,
            3 => 3..4,
            5 => 4..5,
            _ => 0..0,
        };
        for s in join {
            eager.load(s, &caches[s])?;
            graphed.step_mut().load(s, &caches[s])?;
            pos.push(caches[s].seq_len());
        }
        if t == 7 {
            eager.release(4)?;
            graphed.step_mut().release(4)?;
            pos.pop();
        }
        let n = pos.len();
        let toks = tokens(&mut rng, n, cfg.vocab_size);
        let steps = vec![t as u64; n];
        graphed.step(&toks, &pos, &steps)?;
        let bucket = sizes.iter().copied().find(|&r| r >= n).context("a bucket")?;
        eager.update_first(&toks, &pos)?;
        let want = eager.forward_rows(bucket)?;
        let mut drawn = SamplingBatch::new(params[..bucket].to_vec(), vec![t as u64; bucket], &dev)?;
        drawn.set_first_steps(&steps)?;
        let want_ids = sample_batch(&want, &drawn)?.narrow(0, 0, n)?;
        ensure!(bits(&graphed.logits()?)? == bits(&want.narrow(0, 0, n)?)?, "step {t}, {n} sequences in bucket {bucket}: logits differ from the eager rows");
        ensure!(graphed.ids()?.to_vec1::<u32>()? == want_ids.to_vec1::<u32>()?, "step {t}: sampled ids");
        pos.iter_mut().for_each(|p| *p += 1);
    }
    let e = graphed.step(&tokens(&mut rng, 9, cfg.vocab_size), &[70; 9], &[0; 9]).unwrap_err().to_string();
    ensure!(e.contains("largest captured bucket has 8 rows"), "{e}");
    let e = graphed.step(&tokens(&mut rng, 2, cfg.vocab_size), &pos[..2], &[0; 2]).unwrap_err().to_string();
    ensure!(e.contains("row 2 holds a sequence"), "{e}");
    Ok(())
}

/// Every inputs object of the step (window-only, ratio-1 and ratio-2 kv sources): after random
/// updates (positions below, at and past the window; rows idle), the kernel's derived rows over
/// poisoned outputs equal the Candle ops' bit for bit, for the whole batch and a leading view.
#[test]
fn derived_inputs_equal_the_candle_ops() -> Result<()> {
    let cfg = full_config(512)?;
    let dev = gpu();
    let m = model(&cfg, &dev)?;
    let rows = 8;
    let step = ModelDecodeStep::new(&cfg, &m, rows, 160, BatchStorage::BF16, &dev)?;
    let mut rng = Rng(0xd371);
    let outputs = |i: &deepseek_v41::attention::DecodeStepInputs| -> Vec<Tensor> {
        let (cos, sin, neg) = i.rope_rows();
        let mut v = vec![cos.clone(), sin.clone(), neg.clone(), i.window_indices().clone()];
        if let Some(c) = i.compressed() {
            v.extend([c.entry_cos.clone(), c.entry_sin.clone(), c.closing.clone(), c.visible.clone()]);
        }
        v
    };
    let snapshot = |ts: &[Tensor]| -> Result<Vec<Vec<u32>>> {
        ts.iter().map(|t| Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())).collect()
    };
    let poison = |ts: &[Tensor]| -> Result<()> {
        for t in ts {
            let junk = match t.dtype() {
                DType::F32 => Tensor::full(f32::NAN, t.shape(), &dev)?,
                DType::I64 => Tensor::full(-7i64, t.shape(), &dev)?,
                DType::U8 => Tensor::full(7u8, t.shape(), &dev)?,
                _ => Tensor::full(7u32, t.shape(), &dev)?,
            };
            t.slice_set(&junk, 0, 0)?;
        }
        Ok(())
    };
    ensure!(step.inputs().iter().any(|i| i.compressed().is_some()) && step.inputs().iter().any(|i| i.compressed().is_none()), "the kinds of inputs");
    // Positions only grow (pages are taken as entries grow); rows past `n` idle.
    let mut pos: Vec<usize> = (0..rows).map(|_| rng.below(6)).collect();
    for (t, n) in [8usize, 5, 8, 3].into_iter().enumerate() {
        pos.iter_mut().for_each(|p| *p += 1 + rng.below(30));
        for (k, i) in step.inputs().iter().enumerate() {
            i.update_first(&pos[..n])?;
            let outs = outputs(i);
            i.derive_ref()?;
            let want = snapshot(&outs)?;
            poison(&outs)?;
            i.derive()?;
            ensure!(snapshot(&outs)? == want, "update {t}, inputs {k}: the kernel's derived rows differ from the Candle ops");
            let lead = i.leading(3)?;
            poison(&outs)?;
            lead.derive()?;
            let got = snapshot(&outputs(&lead))?;
            let lead_want: Vec<Vec<u32>> = want.iter().map(|w| w[..w.len() / rows * 3].to_vec()).collect();
            ensure!(got == lead_want, "update {t}, inputs {k}: a leading view's derived rows differ");
        }
    }
    Ok(())
}
