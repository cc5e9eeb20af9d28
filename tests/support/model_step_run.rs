//! The scenario of `tests/model_decode_step.rs` (CPU) and `tests/cuda_model_decode_step.rs`
//! (GPU): the tiny config with its layers rewritten to the kinds the batched attention step
//! composes (window-only, ratio-2 kv + index sources, top-k reuse; no ratio-1 source, no
//! candidate blocks), two Engram layers with resident tables, a model of random weights; B
//! sequences prefilled to different lengths, then decode steps of all B at once through
//! `ModelDecodeStep` next to `Model::forward_batch` of one token per sequence.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use deepseek_v41::config::Config;
use deepseek_v41::model::{BatchItem, Model, ModelCache, TokenMap};

use crate::rng::Rng;

/// Prefill lengths (W = 8): the first group just closed (2), an open group (3), past the window
/// (9), far past it (20).
pub const STARTS: [usize; 4] = [2, 3, 9, 20];
/// Tokens each sequence can hold in the step.
pub const CAPACITY: usize = 40;

/// The tiny fixture config (read from the repository, or from the working folder where a packed
/// test binary runs).
pub fn tiny_path() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny/config.json"));
    if built.exists() {
        built
    } else {
        std::path::PathBuf::from("tests/fixtures/v41-tiny/config.json")
    }
}

/// The tiny config with compress ratios `[0, 2, 2, 2, 2, 0, 2, 0, 0]`: layers 1 and 3 ratio-2
/// kv and index sources, 2 reusing 1, 4 and 6 reusing 3, the rest window-only; no candidate
/// blocks; Engram at layers 1 and 5. `head_dim` as given (the fused CUDA attention needs 512).
pub fn step_config(head_dim: usize) -> Result<Config> {
    let mut cfg = Config::from_file(tiny_path())?;
    cfg.compress_ratios = vec![0, 2, 2, 2, 2, 0, 2, 0, 0];
    cfg.kv_source_layer_ids = vec![1, 3];
    cfg.index_source_layer_ids = vec![1, 3];
    cfg.candidate_source_layer_id = None;
    cfg.candidate_topk_blocks = 0;
    cfg.candidate_block_size = 0;
    cfg.head_dim = head_dim;
    Ok(cfg.resolve()?)
}

/// The tiny config as released (ratio-1 kv sources, the candidate source and its reindex
/// consumers included), with `head_dim` set.
pub fn full_config(head_dim: usize) -> Result<Config> {
    let mut cfg = Config::from_file(tiny_path())?;
    cfg.head_dim = head_dim;
    Ok(cfg.resolve()?)
}

/// The token map of the tiny config (compressed id = id / 2).
pub fn token_map(cfg: &Config) -> TokenMap {
    TokenMap::div2(cfg.vocab_size)
}

/// Random tokens.
pub fn tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

/// One cache per sequence, each prefilled with `STARTS[s]` random tokens (one call each).
pub fn prefill(cfg: &Config, model: &Model, rng: &mut Rng, dev: &Device) -> Result<Vec<ModelCache>> {
    prefill_lengths(cfg, model, &STARTS, rng, dev)
}

/// One cache per length, each prefilled with that many random tokens (one call each).
pub fn prefill_lengths(cfg: &Config, model: &Model, lengths: &[usize], rng: &mut Rng, dev: &Device) -> Result<Vec<ModelCache>> {
    lengths
        .iter()
        .map(|&n| {
            let mut c = ModelCache::new(cfg, DType::BF16, dev)?;
            model.forward(&tokens(rng, n, cfg.vocab_size), &mut c)?;
            Ok(c)
        })
        .collect()
}

/// The eager batched step: `Model::forward_batch` of one token per sequence (logits `[B, vocab]`).
pub fn eager_step(model: &Model, caches: &mut [ModelCache], toks: &[u32]) -> Result<Tensor> {
    let one: Vec<[u32; 1]> = toks.iter().map(|&t| [t]).collect();
    let mut items: Vec<BatchItem> = caches.iter_mut().zip(&one).map(|(c, t)| BatchItem::new(t, c)).collect();
    Ok(model.forward_batch(&mut items)?.logits)
}

/// The bits of `t` (any float dtype, any device) as f32 words.
pub fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}
