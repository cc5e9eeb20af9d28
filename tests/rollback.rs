//! `ModelCache::truncate` on the embedded model (sliding window 32, ratio-2 and ratio-1 kv
//! sources, Engram): after a truncation to `n`, continuing gives bit for bit the logits of a fresh
//! run of the first `n` tokens, for truncation points inside and at the end of compressor
//! groups, across the window edge and across calls longer than the window; rollbacks that need
//! state no longer held fail with a clear error and change nothing.

use std::path::PathBuf;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use deepseek_v41::model::{ModelCache, Pretrained};
use deepseek_v41::Numerics;

fn model() -> Result<Pretrained> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/v41-shakespeare-tiny");
    Ok(Pretrained::load_dir(dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)?)
}

/// Deterministic ids spread over the vocabulary (BOS first).
fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut x = seed;
    let mut v = vec![0u32];
    while v.len() < n {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        v.push(3 + ((x >> 33) as usize % (vocab - 3)) as u32);
    }
    v
}

/// Logits of each call of `calls` (token slices), in order, as f32 vectors.
fn run(p: &Pretrained, cache: &mut ModelCache, calls: &[&[u32]]) -> Result<Vec<Vec<Vec<f32>>>> {
    calls.iter().map(|c| Ok(p.model.forward(c, cache)?.to_dtype(DType::F32)?.to_vec2::<f32>()?)).collect()
}

fn one_by_one(ids: &[u32]) -> Vec<&[u32]> {
    ids.chunks(1).collect()
}

fn window_ring(cache: &ModelCache, layer: usize) -> Result<Vec<Vec<f32>>> {
    Ok(cache.attention.layer(layer)?.window.ring_rows()?.to_dtype(DType::F32)?.to_vec2::<f32>()?)
}

#[test]
fn truncate_then_continue_equals_a_fresh_run() -> Result<()> {
    let p = model()?;
    let w = p.config.sliding_window;
    assert_eq!(w, 32, "the points below assume the embedded model's window");
    let seq = tokens(50, 7, p.config.vocab_size);
    let depth = 12;
    let fresh_run = |prefix: &[u32], cont: &[u32]| -> Result<(ModelCache, Vec<Vec<Vec<f32>>>)> {
        let mut fresh = p.new_cache()?;
        run(&p, &mut fresh, &one_by_one(prefix))?;
        let logits = run(&p, &mut fresh, &one_by_one(cont))?;
        Ok((fresh, logits))
    };
    // Inside a ratio-2 group (odd), group ends, down to the depth limit (50 − 12).
    for (i, n) in [49usize, 45, 42, 39, 38].into_iter().enumerate() {
        let mut cache = p.new_cache()?;
        cache.set_rollback_depth(depth)?;
        run(&p, &mut cache, &one_by_one(&seq))?;
        cache.truncate(n)?;
        assert_eq!(cache.seq_len(), n);
        let cont = tokens(5, 100 + i as u64, p.config.vocab_size)[1..].to_vec();
        let ours = run(&p, &mut cache, &one_by_one(&cont))?;
        let (fresh, want) = fresh_run(&seq[..n], &cont)?;
        assert!(ours == want, "truncate({n}) then continue differs from a fresh run of {n} tokens");
        for layer in 0..p.config.num_hidden_layers {
            assert!(window_ring(&cache, layer)? == window_ring(&fresh, layer)?, "layer {layer} ring after truncate({n})");
        }
    }
    // Repeated use of one cache: truncate, continue, truncate again further back (the reach is
    // counted from the longest length, 50).
    let mut cache = p.new_cache()?;
    cache.set_rollback_depth(depth)?;
    run(&p, &mut cache, &one_by_one(&seq))?;
    cache.truncate(45)?;
    let cont = tokens(5, 200, p.config.vocab_size)[1..].to_vec();
    run(&p, &mut cache, &one_by_one(&cont))?;
    cache.truncate(41)?;
    let ours = run(&p, &mut cache, &one_by_one(&cont))?;
    assert!(ours == fresh_run(&seq[..41], &cont)?.1, "second truncation differs from a fresh run");
    Ok(())
}

#[test]
fn truncate_across_a_call_longer_than_the_window() -> Result<()> {
    let p = model()?;
    let seq = tokens(83, 11, p.config.vocab_size);
    let cont = tokens(4, 12, p.config.vocab_size)[1..].to_vec();
    for n in [41usize, 42] {
        // One prefill call, a 41/42-token call (longer than the window), rolled back.
        let mut cache = p.new_cache()?;
        cache.set_rollback_depth(seq.len() - n)?;
        run(&p, &mut cache, &[&seq[..n], &seq[n..]])?;
        cache.truncate(n)?;
        let ours = run(&p, &mut cache, &[&cont])?;
        let mut fresh = p.new_cache()?;
        let want = run(&p, &mut fresh, &[&seq[..n], &cont])?;
        assert!(ours[0] == want[1], "truncate({n}) after a long call differs from a fresh run");
    }
    Ok(())
}

#[test]
fn rollback_beyond_what_is_held_fails_and_changes_nothing() -> Result<()> {
    let p = model()?;
    let seq = tokens(50, 3, p.config.vocab_size);
    let mut cache = p.new_cache()?;
    cache.set_rollback_depth(12)?;
    run(&p, &mut cache, &one_by_one(&seq))?;
    let before = window_ring(&cache, 0)?;
    let err = cache.truncate(37).unwrap_err().to_string();
    assert!(err.contains("from 50 to 37 tokens") && err.contains("rollback depth of at least 13"), "{err}");
    let err = cache.truncate(51).unwrap_err().to_string();
    assert!(err.contains("holds only 50"), "{err}");
    assert_eq!(cache.seq_len(), 50);
    assert!(window_ring(&cache, 0)? == before);
    let err = cache.set_rollback_depth(4).unwrap_err().to_string();
    assert!(err.contains("empty cache"), "{err}");

    // Without a depth: the Engram history (and a compressor's open group) are not held.
    let mut plain = p.new_cache()?;
    run(&p, &mut plain, &[&seq[..20]])?;
    let err = plain.truncate(13).unwrap_err().to_string();
    assert!(err.contains("no longer holds positions"), "{err}");
    assert_eq!(plain.seq_len(), 20);
    // Truncating to the start always works; the cache then runs like a fresh one.
    plain.truncate(0)?;
    let again = run(&p, &mut plain, &[&seq[..5]])?;
    let want = run(&p, &mut p.new_cache()?, &[&seq[..5]])?;
    assert!(again == want);
    Ok(())
}

#[test]
fn forward_rejects_empty_and_out_of_vocabulary_tokens_with_the_value() -> Result<()> {
    let p = model()?;
    let vocab = p.config.vocab_size;
    let mut cache = p.new_cache()?;
    let err = p.model.forward(&[], &mut cache).unwrap_err().to_string();
    assert!(err.contains("no tokens"), "{err}");
    let err = p.model.forward(&[0, 5, 99999], &mut cache).unwrap_err().to_string();
    assert!(err.contains("99999") && err.contains(&format!("vocab_size = {vocab}")), "{err}");
    assert_eq!(cache.seq_len(), 0, "a rejected call leaves the cache untouched");
    let err = p.model.forward(&[vocab as u32], &mut cache).unwrap_err().to_string();
    assert!(err.contains(&format!("token id {vocab}")), "{err}");
    // The largest id works.
    let logits: Tensor = p.model.forward(&[0, vocab as u32 - 1], &mut cache)?;
    assert_eq!(logits.dims(), [2, vocab]);
    Ok(())
}
