//! The whole-model batched decode step (`model::ModelDecodeStep`) on the CPU: a model of random
//! weights on the tiny config with its layers rewritten to the kinds the attention step composes
//! (built in code, `support/model_step_run.rs`), B = 4 sequences prefilled to different lengths,
//! then decode steps of all four at once: the logits equal `Model::forward_batch` of one token
//! per sequence bit for bit, step after step (Engram ids hashed per sequence, ratio-2 groups
//! opening and closing, windows wrapping); a repeated step at the same inputs gives the same
//! logits and leaves the pools as one step does; bad inputs are errors naming the value.
//!
//! `cargo test --release --test model_decode_step` (with `--features cuda` the step's ops run
//! the `cuda` ops' CPU paths).

use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use deepseek_v41::attention::BatchStorage;
use deepseek_v41::config::Config;
use deepseek_v41::model::{Model, ModelDecodeStep};
use deepseek_v41::nn::RandomWeights;
use deepseek_v41::sampling::{SamplingBatch, SamplingParams};
use deepseek_v41::Numerics;

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

#[path = "support/model_step_run.rs"]
#[allow(dead_code)]
mod run;
use run::{bits, eager_step, full_config, prefill, step_config, token_map, tokens, CAPACITY, STARTS};

const STEPS: usize = 4;

fn model(cfg: &Config, seed: u64) -> Result<Model> {
    let vb = RandomWeights::new(seed).var_builder(DType::BF16, &Device::Cpu);
    Ok(Model::new(cfg, Numerics::REFERENCE, Some(token_map(cfg)), vb)?)
}

/// Every step's logits equal the eager batched step's bit for bit, and the greedy / sampled ids
/// of `forward_sampled` are those of the eager logits.
#[test]
fn step_logits_equal_forward_batch_bit_for_bit() -> Result<()> {
    let (cfg, dev) = (step_config(128)?, Device::Cpu);
    let m = model(&cfg, 11)?;
    let mut rng = Rng(0x5e9);
    let mut caches = prefill(&cfg, &m, &mut rng, &dev)?;
    let b = STARTS.len();
    let mut step = ModelDecodeStep::new(&cfg, &m, b, CAPACITY, BatchStorage::BF16, &dev)?;
    ensure!(step.host_reads().is_empty(), "{:?}", step.host_reads());
    for (s, c) in caches.iter().enumerate() {
        step.load(s, c)?;
    }
    // Window-only layers share one inputs object, the layers of each kv source one.
    ensure!(step.inputs().len() == 3, "{} inputs objects", step.inputs().len());
    let mut previous: Option<Vec<u32>> = None;
    for t in 0..STEPS {
        let toks = tokens(&mut rng, b, cfg.vocab_size);
        let pos: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
        let want = eager_step(&m, &mut caches, &toks)?;
        step.update(&toks, &pos)?;
        let params = vec![SamplingParams::GREEDY; b];
        let sampling = SamplingBatch::new(params, vec![t as u64; b], &dev)?;
        let (got, ids) = step.forward_sampled(&sampling)?;
        ensure!(got.dims() == [b, cfg.vocab_size], "logits {:?}", got.dims());
        ensure!(bits(&got)? == bits(&want)?, "step {t} at {pos:?}: the step's logits differ from forward_batch");
        let argmax = want.argmax(candle_core::D::Minus1)?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
        ensure!(ids.to_vec1::<u32>()? == argmax, "step {t}: greedy ids");
        let now = bits(&got)?;
        ensure!(previous.as_ref() != Some(&now), "step {t}: the same logits as the step before");
        previous = Some(now);
    }
    Ok(())
}

/// Every layer kind of the tiny config as released — ratio-1 kv sources, the candidate source
/// publishing blocks and the reindex layers consuming them — through the whole-model step: the
/// logits equal `forward_batch`'s bit for bit, step after step.
#[test]
fn released_layer_kinds_equal_forward_batch() -> Result<()> {
    let (cfg, dev) = (full_config(128)?, Device::Cpu);
    ensure!(cfg.compress_ratios.contains(&1) && cfg.candidate_source_layer_id.is_some(), "the tiny config lost its ratio-1 / candidate layers");
    let m = model(&cfg, 17)?;
    let mut rng = Rng(0xf011);
    let mut caches = prefill(&cfg, &m, &mut rng, &dev)?;
    let b = STARTS.len();
    let mut step = ModelDecodeStep::new(&cfg, &m, b, CAPACITY, BatchStorage::BF16, &dev)?;
    for (s, c) in caches.iter().enumerate() {
        step.load(s, c)?;
    }
    for t in 0..STEPS {
        let toks = tokens(&mut rng, b, cfg.vocab_size);
        let pos: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
        let want = eager_step(&m, &mut caches, &toks)?;
        step.update(&toks, &pos)?;
        ensure!(bits(&step.forward()?)? == bits(&want)?, "step {t} at {pos:?}: the step's logits differ from forward_batch");
    }
    Ok(())
}

/// A step repeated at the same inputs (a warm-up before a graph capture) gives the same logits,
/// and the next step equals the eager path as if it had run once.
#[test]
fn a_repeated_step_changes_nothing() -> Result<()> {
    let (cfg, dev) = (step_config(128)?, Device::Cpu);
    let m = model(&cfg, 5)?;
    let mut rng = Rng(0xab);
    let mut caches = prefill(&cfg, &m, &mut rng, &dev)?;
    let b = STARTS.len();
    let mut step = ModelDecodeStep::new(&cfg, &m, b, CAPACITY, BatchStorage::BF16, &dev)?;
    for (s, c) in caches.iter().enumerate() {
        step.load(s, c)?;
    }
    for t in 0..3 {
        let toks = tokens(&mut rng, b, cfg.vocab_size);
        let pos: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
        let want = eager_step(&m, &mut caches, &toks)?;
        step.update(&toks, &pos)?;
        let once = step.forward()?;
        let again = step.forward()?;
        ensure!(bits(&once)? == bits(&again)?, "step {t}: the repeated step differs");
        ensure!(bits(&once)? == bits(&want)?, "step {t}: differs from forward_batch after a repeat");
    }
    Ok(())
}

/// Bad inputs are errors naming the value; a failed update changes nothing; a model whose
/// activations are not bf16 is refused at construction.
#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let (cfg, dev) = (step_config(128)?, Device::Cpu);
    let m = model(&cfg, 3)?;
    let mut rng = Rng(0x77);
    let caches = prefill(&cfg, &m, &mut rng, &dev)?;
    let b = STARTS.len();
    let e = ModelDecodeStep::new(&cfg, &m, 0, CAPACITY, BatchStorage::BF16, &dev).unwrap_err().to_string();
    ensure!(e.contains("at least 1"), "{e}");
    let mut step = ModelDecodeStep::new(&cfg, &m, b, CAPACITY, BatchStorage::BF16, &dev)?;
    for (s, c) in caches.iter().enumerate() {
        step.load(s, c)?;
    }
    let e = step.load(b, &caches[0]).unwrap_err().to_string();
    ensure!(e.contains("sequence index") && e.contains(&format!("batch has {b}")), "{e}");
    let pos: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
    let e = step.update(&[1, 2], &pos).unwrap_err().to_string();
    ensure!(e.contains("tokens is for 2 sequences"), "{e}");
    let e = step.update(&[1, 2, 3, cfg.vocab_size as u32], &pos).unwrap_err().to_string();
    ensure!(e.contains(&cfg.vocab_size.to_string()), "{e}");
    let mut wrong = pos.clone();
    wrong[1] += 1;
    let e = step.update(&[1, 2, 3, 4], &wrong).unwrap_err().to_string();
    ensure!(e.contains("sequence 1") && e.contains("Engram history holds"), "{e}");
    let mut far = pos.clone();
    far[2] = CAPACITY;
    let e = step.update(&[1, 2, 3, 4], &far).unwrap_err().to_string();
    ensure!(e.contains(&format!("position {CAPACITY}")), "{e}");
    // Nothing changed: the step at the right positions still equals the eager path.
    let toks = [5, 6, 7, 8];
    step.update(&toks, &pos)?;
    let got = step.forward()?;
    // The same prefill again (fresh caches: the eager step appends into them).
    let mut rng2 = Rng(0x77);
    let mut fresh = prefill(&cfg, &m, &mut rng2, &dev)?;
    ensure!(bits(&got)? == bits(&eager_step(&m, &mut fresh, &toks)?)?, "a failed update changed the step");
    // A model loaded in f32: refused (the step runs bf16).
    let vb = RandomWeights::new(3).var_builder(DType::F32, &Device::Cpu);
    let f32_model = Model::new(&cfg, Numerics::REFERENCE, Some(token_map(&cfg)), vb)?;
    let e = ModelDecodeStep::new(&cfg, &f32_model, b, CAPACITY, BatchStorage::BF16, &dev).unwrap_err().to_string();
    ensure!(e.contains("F32") && e.contains("bf16"), "{e}");
    Ok(())
}
