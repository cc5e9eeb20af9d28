//! The top-k selection step of a compressed attention layer (spec §4.5, §6.3–§6.5): index
//! sources compute their top-k with their indexer and publish it (and, for the candidate
//! source, its candidate blocks) in the cache; reuse layers read the published top-k.
//!
//! Everything stays on the activations' device: the top-k is a `[T, index_topk]` i64 tensor and
//! the candidate blocks a `[T, candidate_topk_blocks]` i64 tensor (both −1 padded), computed by
//! the CUDA indexer kernels on a GPU and by the CPU reference otherwise.

use candle_core::{Result, Tensor};

use super::cache::SequenceCache;
use super::indexer::Indexer;
use crate::config::{CandidateRole, TopkRole};
use crate::nn::RopeTable;

/// The top-k `[T, index_topk]` i64 (on `x`'s device, entry ids ascending, −1 padded) of layer
/// `layer`'s tokens at `positions` (consecutive, `positions[0]` = the call's start).
///
/// Index sources (`TopkRole::Full` / `Reindex`) run `indexer` against the key owner's index keys
/// and publish the result (and candidate blocks, for the candidate source) in `cache`; reuse
/// layers read what their index source published. `x`: `[T, hidden]` attn-normed input, `qr`:
/// `[T, q_lora]` q-LoRA activation, `rope`: the layer's RoPE table. When tracing, records
/// `L{layer}.cand_blocks` (candidate source).
#[allow(clippy::too_many_arguments)]
pub fn select(
    layer: usize,
    topk: TopkRole,
    indexer: Option<&Indexer>,
    x: &Tensor,
    qr: &Tensor,
    positions: &[usize],
    rope: &RopeTable,
    cache: &mut SequenceCache,
) -> Result<Tensor> {
    let Some(&start) = positions.first() else {
        candle_core::bail!("layer {layer}: selection of an empty call")
    };
    match (topk, indexer) {
        (TopkRole::Reuse { index_source }, _) => Ok(cache.published_topk(index_source, start, positions.len())?.clone()),
        (TopkRole::Full { candidates } | TopkRole::Reindex { candidates, .. }, Some(indexer)) => {
            let owner = match topk {
                TopkRole::Reindex { key_owner, .. } => key_owner,
                _ => layer,
            };
            let keys = &cache.source(owner)?.index_keys;
            let published = match candidates {
                CandidateRole::Consume { .. } => cache.published_candidates(start),
                _ => None,
            };
            let sel = indexer.select(x, qr, positions, keys, rope, published)?;
            if let Some(c) = sel.candidates {
                cache.record(|| format!("L{layer}.cand_blocks"), &c.kept);
                cache.publish_candidates(start, c);
            }
            cache.publish_topk(layer, start, sel.topk.clone());
            Ok(sel.topk)
        }
        (_, None) => candle_core::bail!("layer {layer}: index source without an indexer"),
    }
}
