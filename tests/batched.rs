//! Several sequences in one forward (`Model::forward_batch`) on the embedded Shakespeare model,
//! CPU: each item's logits are bit for bit those of `Model::forward` of its chunk alone (the
//! row-wise products multiply each sequence's rows as its own call does, `nn::grouped_matmul`),
//! greedy generation of 16 prompts of different lengths batched together (joining and leaving
//! mid-way, prefill chunks beside decode tokens) equals one-at-a-time generation token for token,
//! so does sampled generation with a seed per sequence, and bad batches are errors.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use deepseek_v41::generation::{generate, generate_batch, generate_batch_greedy, BatchRequest, Sampler, Sampling};
use deepseek_v41::model::{BatchError, BatchItem, LogitRows, ModelCache, Pretrained};
use deepseek_v41::Numerics;

/// The embedded model (`models/v41-shakespeare-tiny`).
fn load() -> Result<Pretrained> {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/v41-shakespeare-tiny");
    Ok(Pretrained::load_dir(&dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)?)
}

/// 16 prompts of 16 different lengths (1 ..= 46 tokens: some past the 32-token window), BOS
/// first.
fn prompts(p: &Pretrained) -> Result<Vec<Vec<u32>>> {
    let text = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are all \
                resolved rather to die than to famish? All: Resolved. resolved. First Citizen: First, you know Caius Marcius \
                is chief enemy to the people.";
    let ids = p.tokenizer.encode(text, true)?;
    anyhow::ensure!(ids.len() >= 60, "the text encodes to {} tokens", ids.len());
    Ok((0..16).map(|i| {
        let len = 1 + 3 * i;
        let from = if i % 3 == 0 { 0 } else { 1 + (7 * i) % 12 };
        let mut v = vec![ids[0]];
        v.extend(&ids[from + 1..from + len]);
        v
    }).collect())
}

fn bits(t: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(t.to_dtype(DType::F32)?.to_vec2::<f32>()?)
}

/// A batched prefill of all 16 prompts, then a call mixing decode tokens of some with second
/// chunks of others, against one-at-a-time forwards: the logits are equal bit for bit.
#[test]
fn batched_logits_equal_one_at_a_time_bit_for_bit() -> Result<()> {
    let p = load()?;
    let prompts = prompts(&p)?;
    let mut alone: Vec<ModelCache> = (0..16).map(|_| p.new_cache()).collect::<candle_core::Result<_>>()?;
    // Fresh caches, not clones: a clone shares the tensors the cache appends into in place.
    let mut batched: Vec<ModelCache> = (0..16).map(|_| p.new_cache()).collect::<candle_core::Result<_>>()?;
    let want: Vec<Tensor> = prompts.iter().zip(&mut alone).map(|(t, c)| p.model.forward(t, c)).collect::<candle_core::Result<_>>()?;
    let mut items: Vec<BatchItem> =
        prompts.iter().zip(&mut batched).map(|(t, c)| BatchItem::new(t, c).with_logits(LogitRows::All)).collect();
    let got = p.model.forward_batch(&mut items)?;
    for (i, w) in want.iter().enumerate() {
        assert_eq!(bits(&got.item(i)?)?, bits(w)?, "prompt {i} ({} tokens)", prompts[i].len());
    }
    // Step 2: even items decode one token, odd items prefill a second chunk of 5; logits of
    // chosen rows (odd: rows 4 and 1, in that order).
    let next: Vec<Vec<u32>> = (0..16usize).map(|i| if i.is_multiple_of(2) { vec![100 + i as u32] } else { (0..5).map(|j| 200 + (i * 5 + j) as u32).collect() }).collect();
    let rows = |i: usize| if i.is_multiple_of(2) { LogitRows::Last } else { LogitRows::Rows(vec![4, 1]) };
    let want: Vec<Tensor> = next.iter().zip(&mut alone).map(|(t, c)| p.model.forward(t, c)).collect::<candle_core::Result<_>>()?;
    let mut items: Vec<BatchItem> = next.iter().zip(&mut batched).enumerate().map(|(i, (t, c))| BatchItem::new(t, c).with_logits(rows(i))).collect();
    let got = p.model.forward_batch(&mut items)?;
    assert_eq!(got.logits.dims(), &[8 + 8 * 2, p.model.vocab_size()]);
    for (i, w) in want.iter().enumerate() {
        let w = if i.is_multiple_of(2) { w.narrow(0, 0, 1)? } else { Tensor::cat(&[w.get(4)?, w.get(1)?], 0)?.reshape((2, ()))? };
        assert_eq!(bits(&got.item(i)?)?, bits(&w)?, "item {i}, step 2");
    }
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(a.seq_len(), b.seq_len());
    }
    Ok(())
}

/// 16 prompts, greedy: joining at steps 0..4, leaving after 3 ..= 18 tokens; equal token for
/// token to `generate` of each prompt alone.
#[test]
fn batched_greedy_generation_equals_one_at_a_time() -> Result<()> {
    let p = load()?;
    let prompts = prompts(&p)?;
    let max_new = |i: usize| 3 + (i * 5) % 16;
    let join = |i: usize| (i * 7) % 5;
    let mut want = Vec::new();
    for (i, t) in prompts.iter().enumerate() {
        let mut cache = p.new_cache()?;
        want.push(generate(&p.model, &mut cache, t, max_new(i), &mut Sampler::new(Sampling::GREEDY)?, None, |_| Ok(()))?);
    }
    let mut caches: Vec<ModelCache> = (0..16).map(|_| p.new_cache()).collect::<candle_core::Result<_>>()?;
    let mut requests: Vec<BatchRequest> = prompts
        .iter()
        .zip(&mut caches)
        .enumerate()
        .map(|(i, (t, c))| BatchRequest { prompt: t, cache: c, max_new: max_new(i), join_step: join(i) })
        .collect();
    let got = generate_batch_greedy(&p.model, &mut requests, None)?;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "prompt {i} ({} tokens, joins at step {})", prompts[i].len(), join(i));
    }
    for (i, c) in caches.iter().enumerate() {
        assert_eq!(c.seq_len(), prompts[i].len() + max_new(i) - 1);
    }
    Ok(())
}

/// 8 prompts sampled with their own settings and seeds, joining at different steps: equal token
/// for token to `generate` of each prompt alone with a `Sampler` of the same settings.
#[test]
fn batched_sampled_generation_equals_one_at_a_time() -> Result<()> {
    let p = load()?;
    let prompts: Vec<Vec<u32>> = prompts(&p)?.into_iter().step_by(2).collect();
    let max_new = |i: usize| 4 + (i * 3) % 9;
    let join = |i: usize| i % 3;
    let sampling: Vec<Sampling> =
        (0..prompts.len()).map(|i| Sampling { temperature: 0.6 + 0.2 * i as f64, top_p: [1.0, 0.9, 0.5][i % 3], seed: 100 + i as u64 }).collect();
    let mut want = Vec::new();
    for (i, t) in prompts.iter().enumerate() {
        let mut cache = p.new_cache()?;
        want.push(generate(&p.model, &mut cache, t, max_new(i), &mut Sampler::new(sampling[i])?, None, |_| Ok(()))?);
    }
    let mut caches: Vec<ModelCache> = (0..prompts.len()).map(|_| p.new_cache()).collect::<candle_core::Result<_>>()?;
    let mut requests: Vec<BatchRequest> = prompts
        .iter()
        .zip(&mut caches)
        .enumerate()
        .map(|(i, (t, c))| BatchRequest { prompt: t, cache: c, max_new: max_new(i), join_step: join(i) })
        .collect();
    let got = generate_batch(&p.model, &mut requests, &sampling, None)?;
    assert_eq!(got, want);
    // Different seeds give different continuations (the draws are not greedy).
    let greedy = generate_batch_greedy(&p.model, &mut [BatchRequest { prompt: &prompts[3], cache: &mut p.new_cache()?, max_new: max_new(3), join_step: 0 }], None)?;
    assert_ne!(greedy[0], want[3], "sampling at T = {} drew the greedy tokens", sampling[3].temperature);
    let e = generate_batch(&p.model, &mut requests, &sampling[1..], None).unwrap_err().to_string();
    assert!(e.contains("7 sampling settings for 8 requests"), "{e}");
    Ok(())
}

/// An empty batch, an empty chunk, a logit row outside its chunk and a token outside the
/// vocabulary are errors naming the problem, and no cache changes.
#[test]
fn bad_batches_are_errors() -> Result<()> {
    let p = load()?;
    let (mut a, mut b) = (p.new_cache()?, p.new_cache()?);
    let err = |e: candle_core::Error| e.to_string();
    let e = err(p.model.forward_batch(&mut []).unwrap_err());
    assert!(e.starts_with(&BatchError::Empty.to_string()), "{e}");
    let e = err(p.model.forward_batch(&mut [BatchItem::new(&[0, 5], &mut a), BatchItem::new(&[], &mut b)]).unwrap_err());
    assert!(e.contains("batch item 1 has no tokens"), "{e}");
    let e = err(p.model.forward_batch(&mut [BatchItem::new(&[0, 5, 6], &mut a).with_logits(LogitRows::Rows(vec![0, 3]))]).unwrap_err());
    assert!(e.contains("row 3") && e.contains("3 tokens"), "{e}");
    let big = p.model.vocab_size() as u32;
    let e = err(p.model.forward_batch(&mut [BatchItem::new(&[0], &mut a), BatchItem::new(&[0, big], &mut b)]).unwrap_err());
    assert!(e.contains(&format!("token id {big}")), "{e}");
    assert_eq!((a.seq_len(), b.seq_len()), (0, 0));
    // The same cache twice does not compile (each item borrows it mutably): see the
    // `compile_fail` example of `deepseek_v41::model::batch`.
    Ok(())
}
