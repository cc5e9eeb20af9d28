//! The device-level indexer entry (spec §6.3–§6.4): index scores, top-k and (for the candidate
//! source) candidate blocks of a batch of queries in one call, with no host round trip.
//!
//! Memory stays bounded for any context: the scores go through a scratch buffer of at most
//! [`SCORE_SCRATCH_BYTES`] (`[C, N]` bf16 for a chunk of C queries), and per chunk the
//! selection kernel reduces them to `[C, k]` ids, so `[T, N]` is never materialised for long
//! prefills. CPU path: the reference ([`crate::attention::indexer::reference_selection`]).
//!
//! **Top-k threshold.** The top-k is a radix selection on 16-bit order keys of the bf16 scores
//! (digits of 11 and 5 bits). For rows of at most 64K entries (the decode shape) the selection
//! kernel reads each row once: it first takes a digit below which no key of the top k lies from
//! a sample of 4096 entries of the row (exact fallbacks cover rows where the sample misleads).
//! (A *fused histogram*, the first digit histogram built by the scores kernel, was measured and
//! removed: it saved the top-k ~3 µs at B = 256 but cost the scores kernel more, `index_select`
//! was 3-15 µs slower with it; docs/cuda.md "indexer_scores: tried and not kept".) The candidate-block
//! selection (`publish`) builds its own histogram (of block maxima). The separate ops
//! [`super::masked_index_scores`] + [`super::index_topk`] run the same kernels.

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Result, Storage, Tensor};
use half::bf16;

use super::ffi;
use super::indexer_inputs::{IndexKeys, KeySource, Visibility};
use super::indexer_scores::{allowed_mask, check_candidates, check_queries, cpu_scores, launch_scores, token_chunk, with_score_params};
use super::indexer_topk::{launch_select, SelectMode};
use crate::attention::indexer::{reference_selection, CandidateShape, Candidates, Selection};

/// Most bytes of the per-chunk score scratch (`[C, N]` bf16) of [`index_select`].
pub const SCORE_SCRATCH_BYTES: usize = 256 << 20;

/// Index scores, top-k and candidate blocks of T queries, on `q`'s device.
///
/// * `q`: `[T, H, 128]` bf16 index queries (H ≤ 32 on CUDA), `w`: `[T, H]` f32 (bf16-valued)
///   head weights.
/// * `src`: key cache (bf16 rows or packed MXFP4), first row per query, N, visibility.
/// * `k`: top-k width (`index_topk`).
/// * `consume`: a candidate consumer's published blocks (kept `[T, n_keep]` i64): entries outside
///   them score −inf before the top-k.
/// * `publish`: for the candidate source, the block geometry of the candidate blocks to compute
///   (from the unrestricted scores).
///
/// Returns [`Selection`]: `topk` `[T, k]` i64 (entry ids ascending, −1 padded; the best
/// `min(k, L_t)` visible entries, ties → lower id) and, with `publish`, `candidates.kept`
/// `[T, n_keep]` i64 (block ids ascending, −1 padded), both on `q`'s device. Identical to the CPU
/// reference whenever the scores are (see [`super::masked_index_scores`]). Runs with
/// [`SelectOptions::default`].
pub fn index_select(
    q: &Tensor,
    w: &Tensor,
    src: &KeySource,
    k: usize,
    consume: Option<&Candidates>,
    publish: Option<CandidateShape>,
) -> Result<Selection> {
    index_select_with_options(q, w, src, k, consume, publish, &SelectOptions::default())
}

/// How [`index_select_with_options`] runs on a CUDA device (the results never depend on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelectOptions {
    /// Most bytes of the per-chunk score scratch (at least one query row is used): smaller
    /// budgets process the queries in more chunks, with identical results.
    pub scratch_bytes: usize,
}

impl Default for SelectOptions {
    /// [`SCORE_SCRATCH_BYTES`].
    fn default() -> Self {
        Self { scratch_bytes: SCORE_SCRATCH_BYTES }
    }
}

/// [`index_select`] with explicit [`SelectOptions`]; same arguments, same result.
pub fn index_select_with_options(
    q: &Tensor,
    w: &Tensor,
    src: &KeySource,
    k: usize,
    consume: Option<&Candidates>,
    publish: Option<CandidateShape>,
    opts: &SelectOptions,
) -> Result<Selection> {
    const OP: &str = "index_select";
    let scratch_bytes = opts.scratch_bytes;
    let (t, _, _) = check_queries(OP, q, w)?;
    src.check(OP, t, q.device())?;
    if let Some(c) = consume {
        check_candidates(OP, c, t, q.device())?;
    }
    if k == 0 || k > i32::MAX as usize || publish.is_some_and(|p| p.block == 0 || p.n_keep == 0 || p.n_keep > i32::MAX as usize) {
        candle_core::bail!("{OP}: k = {k} and candidate shape {publish:?} must be positive and below 2^31")
    }
    if !q.device().is_cuda() {
        let visible = src.visibility.host(t, src.entries)?;
        return reference_selection(cpu_scores(q, w, src)?, &visible, k, consume, publish, q.device());
    }
    if t == 0 {
        let topk = Tensor::zeros((0, k), DType::I64, q.device())?;
        let candidates = publish
            .map(|s| Tensor::zeros((0, s.n_keep), DType::I64, q.device()).map(|kept| Candidates { block: s.block, kept }))
            .transpose()?;
        return Ok(Selection { topk, candidates });
    }
    let mask = consume.map(|c| allowed_mask(c, src.entries).map(|m| (m, c.block))).transpose()?;
    let n = src.entries;
    let stride = n.div_ceil(8).max(1) * 8;
    let chunk = (scratch_bytes / (2 * stride)).clamp(1, t);
    let n_keep = publish.map_or(0, |s| s.n_keep);
    let (topk, kept) = with_score_params(q, w, src, mask.as_ref().map(|(m, b)| (m, *b)), |base, stream, dev| {
        // SAFETY: every chunk's scores are written by the scores kernel before the selection
        // reads them, and the selection writes all k (n_keep) columns of every token's row.
        let mut scratch = unsafe { dev.alloc::<bf16>(chunk * stride)? };
        let mut topk = unsafe { dev.alloc::<i64>(t * k)? };
        let mut kept = if n_keep > 0 { Some(unsafe { dev.alloc::<i64>(t * n_keep)? }) } else { None };
        {
            let (s_p, _g0) = scratch.device_ptr_mut(stream);
            let (t_p, _g1) = topk.device_ptr_mut(stream);
            let kept_p = kept.as_mut().map(|kp| kp.device_ptr_mut(stream));
            for t0 in (0..t).step_by(chunk) {
                let tc = chunk.min(t - t0);
                let sp = ffi::IndexerScoresParams {
                    scores: s_p as *mut c_void,
                    score_row_stride: stride as i64,
                    ..token_chunk(base, t0, tc)
                };
                launch_scores(&sp, stream)?;
                let sel = ffi::IndexerSelectParams {
                    scores: s_p as *const c_void,
                    visible: sp.visible,
                    out: (t_p as *mut i64).wrapping_add(t0 * k),
                    score_row_stride: stride as i64,
                    out_row_stride: k as i64,
                    start: sp.start,
                    num_tokens: tc as i32,
                    num_cols: n as i32,
                    k: k as i32,
                    mode: 0,
                    block: 1,
                    ratio: sp.ratio,
                };
                launch_select(&sel, SelectMode::TopK, stream)?;
                if let (Some(shape), Some((kp, _))) = (publish, kept_p.as_ref()) {
                    let blocks = ffi::IndexerSelectParams {
                        out: (*kp as *mut i64).wrapping_add(t0 * n_keep),
                        out_row_stride: n_keep as i64,
                        k: n_keep as i32,
                        ..sel
                    };
                    launch_select(&blocks, SelectMode::Blocks { block: shape.block }, stream)?;
                }
            }
        }
        // The scratch is freed on drop after being used on this stream (candle's allocator
        // orders the free after the queued work).
        drop(scratch);
        let topk = CudaStorage::wrap_cuda_slice(topk, dev.clone());
        let kept = kept.map(|kp| CudaStorage::wrap_cuda_slice(kp, dev.clone()));
        Ok((topk, kept))
    })?;
    let topk = Tensor::from_storage(Storage::Cuda(topk), (t, k), BackpropOp::none(), false);
    let candidates = match (publish, kept) {
        (Some(shape), Some(kp)) => Some(Candidates {
            block: shape.block,
            kept: Tensor::from_storage(Storage::Cuda(kp), (t, shape.n_keep), BackpropOp::none(), false),
        }),
        _ => None,
    };
    Ok(Selection { topk, candidates })
}

/// [`index_select`] of one sequence's tokens at `positions` against the first `n` rows of its
/// key cache `keys` (bf16 `[R, 128]` rows or packed pages, R ≥ n; the layer's selection step):
/// causal visibility `(p + 1) div ratio`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn select_on_device(
    q: &Tensor,
    w: &Tensor,
    keys: IndexKeys<'_>,
    n: usize,
    positions: &[usize],
    ratio: usize,
    k: usize,
    consume: Option<&Candidates>,
    publish: Option<CandidateShape>,
) -> Result<Selection> {
    let start = positions.first().copied().unwrap_or(0);
    let consecutive = positions.iter().enumerate().all(|(i, &p)| p == start + i);
    let counts;
    let visibility = if consecutive {
        Visibility::Causal { start, ratio }
    } else {
        let v: Vec<u32> = positions.iter().map(|&p| ((p + 1) / ratio).min(n) as u32).collect();
        counts = Tensor::new(v, q.device())?;
        Visibility::Counts(&counts)
    };
    let src = KeySource { keys, base: None, pages: None, entries: n, visibility };
    index_select(q, w, &src, k, consume, publish)
}
