//! The whole-model batched decode step (`model::ModelDecodeStep`) on the CPU: a model of random
//! weights on the tiny config with its layers rewritten to the kinds the attention step composes
//! (built in code, `support/model_step_run.rs`), B = 4 sequences prefilled to different lengths,
//! then decode steps of all four at once: the logits equal `Model::forward_batch` of one token
//! per sequence bit for bit, step after step (Engram ids hashed per sequence, ratio-2 groups
//! opening and closing, windows wrapping); a repeated step at the same inputs gives the same
//! logits and leaves the pools as one step does; bad inputs are errors naming the value. The kv
//! sources' entries in pages: sequences whose pages interleave, a small page pool
//! (`with_pool_tokens`) that fills (`PoolFull`, nothing changed), a released row loaded with a
//! new sequence — still bit for bit `forward_batch`.
//!
//! `cargo test --release --test model_decode_step` (with `--features cuda` the step's ops run
//! the `cuda` ops' CPU paths).

use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use deepseek_v41::model::ModelCache;
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
use run::{bits, eager_step, full_config, prefill, prefill_lengths, step_config, token_map, tokens, CAPACITY, STARTS};

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

/// Prefill lengths of the paged scenarios (tiny config as released): the ratio-1 sources'
/// sequences cross from their first page of 64 entries into the second at steps 3, 2, 1 and 5.
const PAGED_STARTS: [usize; 4] = [61, 62, 63, 59];
const PAGED_CAPACITY: usize = 160;

/// The pages of the sequences interleave (each takes its second page at another step): the
/// logits still equal `forward_batch`'s bit for bit.
#[test]
fn interleaved_pages_equal_forward_batch() -> Result<()> {
    let (cfg, dev) = (full_config(128)?, Device::Cpu);
    let m = model(&cfg, 37)?;
    let mut rng = Rng(0x9a6e);
    let mut caches = prefill_lengths(&cfg, &m, &PAGED_STARTS, &mut rng, &dev)?;
    let b = PAGED_STARTS.len();
    let mut step = ModelDecodeStep::new(&cfg, &m, b, PAGED_CAPACITY, BatchStorage::BF16, &dev)?;
    for (s, c) in caches.iter().enumerate() {
        step.load(s, c)?;
    }
    for t in 0..6 {
        let toks = tokens(&mut rng, b, cfg.vocab_size);
        let pos: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
        let want = eager_step(&m, &mut caches, &toks)?;
        step.update(&toks, &pos)?;
        ensure!(bits(&step.forward()?)? == bits(&want)?, "step {t} at {pos:?}: the step's logits differ from forward_batch");
    }
    let interleaved = step.caches().iter().filter_map(|c| c.pages()).any(|p| (0..b).any(|s| p.pages_of(s).windows(2).any(|w| w[1] != w[0] + 1)));
    ensure!(interleaved, "no sequence holds pages that are not adjacent");
    Ok(())
}

/// A step over a small page pool (`with_pool_tokens`): when the pool is full the update is
/// `PoolFull` and changes nothing (pages, Engram histories); a finished sequence's row released
/// and loaded with a new sequence, every sequence's next steps equal `forward_batch`'s bit for
/// bit.
#[test]
fn a_full_page_pool_then_release_and_load() -> Result<()> {
    let (cfg, dev) = (full_config(128)?, Device::Cpu);
    let m = model(&cfg, 41)?;
    let mut rng = Rng(0xf0011);
    let mut caches = prefill_lengths(&cfg, &m, &PAGED_STARTS, &mut rng, &dev)?;
    let b = PAGED_STARTS.len();
    // 448 tokens: 7 pages per ratio-1 source (4 loaded, 4 more asked by step 5), 4 per ratio-2 one.
    let mut step = ModelDecodeStep::with_pool_tokens(&cfg, &m, b, PAGED_CAPACITY, 448, BatchStorage::BF16, &dev)?;
    ensure!(step.page_occupancy().iter().all(|o| o.used == 0), "a fresh step holds pages: {:?}", step.page_occupancy());
    for (s, c) in caches.iter().enumerate() {
        step.load(s, c)?;
    }
    let ratio1 = step.page_occupancy().into_iter().filter(|o| cfg.compress_ratios[o.layer] == 1).collect::<Vec<_>>();
    ensure!(!ratio1.is_empty() && ratio1.iter().all(|o| (o.used, o.total) == (4, 7)), "{ratio1:?}");
    let run = |step: &mut ModelDecodeStep, caches: &mut Vec<ModelCache>, rng: &mut Rng, steps: usize| -> Result<()> {
        for t in 0..steps {
            let toks = tokens(rng, b, cfg.vocab_size);
            let pos: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
            step.update(&toks, &pos)?;
            let want = eager_step(&m, caches, &toks)?;
            ensure!(bits(&step.forward()?)? == bits(&want)?, "step {t} at {pos:?}: the step's logits differ from forward_batch");
        }
        Ok(())
    };
    run(&mut step, &mut caches, &mut rng, 5)?;
    let occupancy = step.page_occupancy();
    let toks = tokens(&mut rng, b, cfg.vocab_size);
    let pos: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
    let e = step.update(&toks, &pos).unwrap_err().to_string();
    let first = ratio1[0].layer;
    ensure!(e.contains(&format!("layer {first}: sequence 3 needs 1 more pages")) && e.contains("0 of 7 free"), "{e}");
    ensure!(step.page_occupancy() == occupancy, "the failed update took pages");
    // Sequence 1 is done: a new sequence of 5 tokens in its row.
    step.release(1)?;
    ensure!(step.page_occupancy().iter().zip(&occupancy).all(|(now, was)| now.used < was.used), "{:?}", step.page_occupancy());
    let new = prefill_lengths(&cfg, &m, &[5], &mut rng, &dev)?.remove(0);
    step.load(1, &new)?;
    caches[1] = new;
    // The failed update changed no Engram history: the others step on from the same positions.
    run(&mut step, &mut caches, &mut rng, 3)
}

/// Batch-size buckets (`update_first` + `forward_rows`): a step built for 8 rows runs 3
/// sequences in a bucket of 4 (row 3 idle), then a fourth joins in the lowest free row and 4
/// run in a bucket of 8, then the last leaves, all after a step over 8 idle rows (a bucket
/// capture): every step's logits of the sequences equal `forward_batch`'s bit for bit, and idle
/// rows take no page. Idling a row that holds a sequence
/// and stepping fewer rows than were given tokens are errors.
#[test]
fn bucket_steps_run_only_the_first_rows() -> Result<()> {
    let (cfg, dev) = (full_config(128)?, Device::Cpu);
    let m = model(&cfg, 43)?;
    let mut rng = Rng(0xb0c7);
    let mut caches = prefill_lengths(&cfg, &m, &[2, 3, 9, 20], &mut rng, &dev)?;
    let mut step = ModelDecodeStep::new(&cfg, &m, 8, CAPACITY, BatchStorage::BF16, &dev)?;
    // All rows idle (what a bucket capture steps over): it leaves no state a sequence reads.
    step.idle()?;
    ensure!(step.forward_rows(8)?.dims() == [8, cfg.vocab_size], "the idle step's logits");
    for (s, c) in caches.iter().take(3).enumerate() {
        step.load(s, c)?;
    }
    let run = |step: &mut ModelDecodeStep, caches: &mut [ModelCache], rng: &mut Rng, rows: usize, steps: usize| -> Result<()> {
        for t in 0..steps {
            let toks = tokens(rng, caches.len(), cfg.vocab_size);
            let pos: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
            step.update_first(&toks, &pos)?;
            let got = step.forward_rows(rows)?;
            ensure!(got.dims() == [rows, cfg.vocab_size], "logits {:?}", got.dims());
            let want = eager_step(&m, caches, &toks)?;
            ensure!(bits(&got.narrow(0, 0, caches.len())?)? == bits(&want)?, "{rows} rows, step {t} at {pos:?}: differs from forward_batch");
        }
        Ok(())
    };
    run(&mut step, &mut caches[..3], &mut rng, 4, 3)?;
    let idle_pages = |step: &ModelDecodeStep, from: usize| step.caches().iter().filter_map(|c| c.pages()).all(|p| (from..8).all(|s| p.pages_of(s).is_empty()));
    ensure!(idle_pages(&step, 3), "an idle row took pages");
    // Errors: a step over fewer rows than were given tokens; an update that would idle row 2.
    let e = step.forward_rows(2).unwrap_err().to_string();
    ensure!(e.contains("gave tokens to 3 rows"), "{e}");
    let pos: Vec<usize> = caches.iter().take(2).map(|c| c.seq_len()).collect();
    let e = step.update_first(&tokens(&mut rng, 2, cfg.vocab_size), &pos).unwrap_err().to_string();
    ensure!(e.contains("row 2 holds a sequence"), "{e}");
    step.load(3, &caches[3])?;
    run(&mut step, &mut caches, &mut rng, 8, 3)?;
    ensure!(idle_pages(&step, 4), "an idle row took pages");
    step.release(3)?;
    run(&mut step, &mut caches[..3], &mut rng, 4, 2)
}

/// Steps that follow the last one on the device (`update_next`: the sampled ids stay on the
/// device, their Engram ids hashed there) give the logits of steps whose tokens the host reads
/// back and updates with, bit for bit, step after step; the host histories catch up when the
/// host updates again (mid-run) and when a row is released; `update_next` with no step to
/// follow (a release since), or a wrong count, is an error; over the first rows of a larger
/// batch it follows exactly those rows.
#[test]
fn steps_followed_on_the_device_equal_host_updates() -> Result<()> {
    let (cfg, dev) = (step_config(128)?, Device::Cpu);
    ensure!(cfg.engram.is_some(), "the step config lost its Engram layers");
    let m = model(&cfg, 23)?;
    let mut rng = Rng(0x7e1d);
    let caches = prefill(&cfg, &m, &mut rng, &dev)?;
    let b = STARTS.len();
    let new_step = |batch: usize| -> Result<ModelDecodeStep> {
        let mut s = ModelDecodeStep::new(&cfg, &m, batch, CAPACITY, BatchStorage::BF16, &dev)?;
        for (r, c) in caches.iter().enumerate().take(batch.min(b)) {
            s.load(r, c)?;
        }
        Ok(s)
    };
    let (mut host, mut dev_step) = (new_step(b)?, new_step(b)?);
    let e = dev_step.update_next(&candle_core::Tensor::zeros(b, DType::U32, &dev)?).unwrap_err().to_string();
    ensure!(e.contains("no step to follow"), "{e}");
    let greedy = SamplingBatch::new(vec![SamplingParams::GREEDY; b], vec![0; b], &dev)?;
    let toks = tokens(&mut rng, b, cfg.vocab_size);
    let mut pos: Vec<usize> = caches.iter().map(|c| c.seq_len()).collect();
    host.update(&toks, &pos)?;
    dev_step.update(&toks, &pos)?;
    let (mut host_ids, mut ids) = (toks.clone(), None);
    for t in 0..7 {
        let (want, want_ids) = host.forward_sampled(&greedy)?;
        let (got, got_ids) = dev_step.forward_sampled(&greedy)?;
        ensure!(bits(&got)? == bits(&want)?, "step {t} at {pos:?}: the followed step's logits differ");
        host_ids = want_ids.to_vec1::<u32>()?;
        ensure!(got_ids.to_vec1::<u32>()? == host_ids, "step {t}: ids");
        pos.iter_mut().for_each(|p| *p += 1);
        host.update(&host_ids, &pos)?;
        if t == 3 {
            // The host takes over once (its histories catch up from the device), then the device again.
            dev_step.update(&host_ids, &pos)?;
        } else {
            dev_step.update_next(&got_ids)?;
        }
        ids = Some(got_ids);
    }
    let e = dev_step.update_next(&ids.unwrap().narrow(0, 0, 2)?).unwrap_err().to_string();
    ensure!(e.contains("sampled must be [4] u32"), "{e}");
    ensure!(bits(&dev_step.forward()?)? == bits(&host.forward()?)?, "the last followed step");
    // A release: the step can no longer be followed; the others' histories stay right.
    dev_step.release(3)?;
    host.release(3)?;
    let e = dev_step.update_next(&candle_core::Tensor::new(host_ids.as_slice(), &dev)?).unwrap_err().to_string();
    ensure!(e.contains("no step to follow"), "{e}");
    // Three rows of a batch of 4: host update, then two followed steps.
    let (ids3, mut pos3) = (&host_ids[..3], pos[..3].iter().map(|p| p + 1).collect::<Vec<_>>());
    host.update_first(ids3, &pos3)?;
    dev_step.update_first(ids3, &pos3)?;
    let greedy3 = greedy.leading(3)?;
    for t in 0..2 {
        let (want, want_ids) = host.forward_sampled_rows(3, &greedy3)?;
        let (got, got_ids) = dev_step.forward_sampled_rows(3, &greedy3)?;
        ensure!(bits(&got)? == bits(&want)?, "3 rows, step {t}: the followed step's logits differ");
        pos3.iter_mut().for_each(|p| *p += 1);
        host.update_first(&want_ids.to_vec1::<u32>()?, &pos3)?;
        dev_step.update_next(&got_ids)?;
    }
    ensure!(bits(&dev_step.forward_rows(3)?)? == bits(&host.forward_rows(3)?)?, "3 rows: the last followed step");
    Ok(())
}

/// The formula of `kernels/step_inputs.cu`, evaluated on the host from each inputs object's
/// uploaded rows, equals the Candle ops of `DecodeStepInputs::derive_ref` bit for bit (both with
/// the CPU's `sin` / `cos`): `f32(p)·inv_freq`, the window slots `(p + 1 + k) mod W + b·W'` where
/// `p + 1 + k ≥ W`, the closing flags and visible counts — for positions below, at and past the
/// window, idle rows included.
#[test]
fn the_step_inputs_kernel_formula_equals_the_candle_ops() -> Result<()> {
    let (cfg, dev) = (full_config(128)?, Device::Cpu);
    let m = model(&cfg, 3)?;
    let rows = 6;
    let step = ModelDecodeStep::new(&cfg, &m, rows, CAPACITY, BatchStorage::BF16, &dev)?;
    let mut rng = Rng(0x57e9);
    let mut pos: Vec<usize> = vec![0; rows];
    for n in [6usize, 4, 6] {
        pos.iter_mut().for_each(|p| *p += 1 + rng.below(10));
        for (k, i) in step.inputs().iter().enumerate() {
            i.update_first(&pos[..n])?;
            i.derive_ref()?;
            let p = i.positions().to_vec1::<i64>()?;
            let freq = i.rope().inv_freq().flatten_all()?.to_vec1::<f32>()?;
            let (w, ws) = (i.window_indices().dim(1)?, i.window_stride());
            let (cos, sin, neg) = i.rope_rows();
            let (cos, sin, neg) = (cos.to_vec2::<f32>()?, sin.to_vec2::<f32>()?, neg.to_vec2::<f32>()?);
            let idx = i.window_indices().to_vec2::<i64>()?;
            for b in 0..rows {
                for (j, &f) in freq.iter().enumerate() {
                    let a = p[b] as f32 * f;
                    ensure!(cos[b][j].to_bits() == a.cos().to_bits() && sin[b][j].to_bits() == a.sin().to_bits(), "inputs {k}, row {b}: rope rows");
                    ensure!(neg[b][j].to_bits() == (-a.sin()).to_bits(), "inputs {k}, row {b}: −sin");
                }
                for (kk, &got) in idx[b].iter().enumerate() {
                    let q = p[b] + 1 + kk as i64;
                    let want = if q >= w as i64 { q % w as i64 + (b * ws) as i64 } else { -1 };
                    ensure!(got == want, "inputs {k}, row {b}, offset {kk}: window index {got}, the formula gives {want}");
                }
            }
            if let Some(c) = i.compressed() {
                let (ecos, closing, visible) = (c.entry_cos.to_vec2::<f32>()?, c.closing.flatten_all()?.to_vec1::<u8>()?, c.visible.to_vec1::<u32>()?);
                let slots = c.entry_slots.to_vec1::<i64>()?;
                for b in 0..rows {
                    let (pb, r) = (p[b] as usize, c.ratio);
                    let (entry, vis) = if b < n { (pb / r * r, (pb + 1) / r) } else { (0, 0) };
                    ensure!(ecos[b][0].to_bits() == (entry as f32 * freq[0]).cos().to_bits(), "inputs {k}, row {b}: entry rope rows");
                    ensure!(closing[b] == u8::from(slots[b] >= 0) && visible[b] == vis as u32, "inputs {k}, row {b}: closing / visible");
                }
            }
        }
    }
    Ok(())
}
