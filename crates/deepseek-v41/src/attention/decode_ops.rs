//! The ops of the batched decode step ([`super::decode_batch`]). With the `cuda` feature they are
//! the fused ops of [`crate::cuda`] (one kernel each on a GPU, their CPU references on the CPU);
//! without it, the same CPU references called directly (RoPE [`apply_rope_tail`], the QAT
//! [`fake_quant`], the k_norm [`RmsNorm`], the index scores and top-k of
//! [`crate::attention::indexer`], the reference [`sparse_attention`]), with the rows written into
//! the caller's pools in place. Both give the same bits on the CPU, so the step and its tests
//! run in a build without the feature too (bf16 pools only: packed pools need it).

use candle_core::{Result, Tensor};

use super::batch_cache::PoolRows;
use super::decode_batch::StepOptions;
use super::indexer::{CandidateShape, Candidates, Selection};
use super::page_table::PageTable;

#[cfg(feature = "cuda")]
pub(super) use crate::cuda::{compressed_insert, fake_quant_device, index_key_insert, packed_insert, q_rope_inplace, window_insert};

#[cfg(not(feature = "cuda"))]
pub(super) use cpu::{compressed_insert, fake_quant_device, index_key_insert, q_rope_inplace, window_insert};

/// The index keys of a batch: sequence b's up to `entries` keys in pages of `keys` (entry j at
/// slot `page_table[b][j / P]·P + j mod P`, `[B, max_pages]` i64, P = [`PageTable::PAGE`]),
/// `visible[b]` (`[B]` u32) of them visible.
pub(super) struct SelectKeys<'a> {
    pub keys: &'a PoolRows,
    pub page_table: &'a Tensor,
    pub entries: usize,
    pub visible: &'a Tensor,
}

/// The selection of each sequence's index query `q` (`[B, H_I, d_I]` bf16) with head weights `w`
/// (`[B, H_I]` f32) over its keys: the top-k `[B, k]` i64 entry ids (ascending, −1 padded),
/// restricted to `consume`'s blocks for a candidate consumer, and for the candidate source
/// (`publish`) its candidate blocks `[B, n_keep]` (spec §6.4).
pub(super) fn select_topk(
    q: &Tensor,
    w: &Tensor,
    keys: &SelectKeys,
    k: usize,
    consume: Option<&Candidates>,
    publish: Option<CandidateShape>,
) -> Result<Selection> {
    #[cfg(feature = "cuda")]
    {
        let visibility = crate::cuda::Visibility::Counts(keys.visible);
        let pages = crate::cuda::KeyPages { table: keys.page_table, page_size: PageTable::PAGE };
        let src = crate::cuda::KeySource { keys: keys.keys.index_keys(), base: None, pages: Some(pages), entries: keys.entries, visibility };
        crate::cuda::index_select(q, w, &src, k, consume, publish)
    }
    #[cfg(not(feature = "cuda"))]
    cpu::select_topk(q, w, keys, k, consume, publish)
}

/// The sparse attention `[B, H, D]` of `q` over the rows `idx_window` of `window` and `idx_extra`
/// of `extra` (−1: none), with `sink` and `scale`.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    q: &Tensor,
    window: &PoolRows,
    idx_window: &Tensor,
    extra: &PoolRows,
    idx_extra: &Tensor,
    sink: &Tensor,
    scale: f32,
    options: StepOptions,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        use crate::cuda::{SparseAttentionInputs, SparseAttentionKernel, SparseAttentionOptions, SPARSE_ATTENTION_HEAD_DIM, SPARSE_ATTENTION_MAX_INDICES};
        let (window, extra) = (window.kv_rows(), extra.kv_rows());
        let indices = idx_window.dim(1)? + idx_extra.dim(1)?;
        if q.device().is_cuda() && (q.dim(2)? != SPARSE_ATTENTION_HEAD_DIM || indices > SPARSE_ATTENTION_MAX_INDICES) {
            // The kernel's fallback (plain Candle ops; packed pools through the host).
            return super::sparse_attention::sparse_attention_kv_rows(q, window, idx_window, extra, idx_extra, sink, scale);
        }
        let inputs = SparseAttentionInputs { q, window, idx_window, extra, idx_extra, sink, scale };
        let kernel = if options.num_splits.is_some() { SparseAttentionKernel::Auto } else { options.kernel };
        Ok(inputs.forward(SparseAttentionOptions { num_splits: options.num_splits, kernel })?.0)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = options;
        cpu::attend(q, window, idx_window, extra, idx_extra, sink, scale)
    }
}

#[cfg(not(feature = "cuda"))]
mod cpu {
    use candle_core::{DType, Module, Result, Tensor};

    use super::{CandidateShape, Candidates, PageTable, PoolRows, SelectKeys, Selection};
    use crate::attention::indexer::{index_scores, reference_selection};
    use crate::attention::sparse_attention::sparse_attention;
    use crate::nn::rope::apply_rope_tail;
    use crate::nn::RmsNorm;
    use crate::quant::fake_quant::{fake_quant, QatFormat};

    /// Writes `rows` `[T, D]` at `slots` (`[T]` i64; outside the cache: skipped) of `cache`.
    fn write_rows(cache: &Tensor, rows: &Tensor, slots: &Tensor) -> Result<()> {
        let n = cache.dim(0)? as i64;
        let rows = rows.to_dtype(cache.dtype())?;
        for (t, s) in slots.to_vec1::<i64>()?.into_iter().enumerate() {
            if (0..n).contains(&s) {
                cache.slice_set(&rows.narrow(0, t, 1)?.contiguous()?, 0, s as usize)?;
            }
        }
        Ok(())
    }

    fn insert(cache: &Tensor, rows: &Tensor, cos: &Tensor, sin: &Tensor, slots: &Tensor, quant: Option<QatFormat>) -> Result<()> {
        let x = apply_rope_tail(rows, cos, sin)?;
        let x = match quant {
            Some(fmt) => fake_quant(&x, fmt)?,
            None => x,
        };
        write_rows(cache, &x, slots)
    }

    /// `crate::cuda::window_insert`'s CPU path.
    pub fn window_insert(cache: &Tensor, kv: &Tensor, cos: &Tensor, sin: &Tensor, slots: &Tensor, fq: bool) -> Result<()> {
        insert(cache, kv, cos, sin, slots, fq.then_some(QatFormat::Fp8Ue8m0B32))
    }

    /// `crate::cuda::compressed_insert`'s CPU path.
    pub fn compressed_insert(cache: &Tensor, latent: &Tensor, cos: &Tensor, sin: &Tensor, slots: &Tensor, fq: bool) -> Result<()> {
        insert(cache, latent, cos, sin, slots, fq.then_some(QatFormat::Fp4E4m3B16))
    }

    /// `crate::cuda::index_key_insert`'s CPU path.
    #[allow(clippy::too_many_arguments)]
    pub fn index_key_insert(cache: &Tensor, k_pre: &Tensor, norm: &Tensor, eps: f64, cos: &Tensor, sin: &Tensor, slots: &Tensor, fq: bool) -> Result<()> {
        let k = RmsNorm::from_weight(norm.clone(), eps)?.forward(k_pre)?;
        insert(cache, &k, cos, sin, slots, fq.then_some(QatFormat::Fp4Ue8m0B32))
    }

    /// `crate::cuda::q_rope_inplace`'s CPU path (`q` contiguous).
    pub fn q_rope_inplace(q: &Tensor, cos: &Tensor, sin: &Tensor, norm_eps: Option<f64>) -> Result<()> {
        if norm_eps.is_some() {
            candle_core::bail!("q_rope_inplace: the per-head norm is V4.0's, not composed here")
        }
        q.slice_set(&apply_rope_tail(q, cos, sin)?.contiguous()?, 0, 0)
    }

    /// `crate::cuda::fake_quant_device`'s CPU path.
    pub fn fake_quant_device(x: &Tensor, fmt: QatFormat) -> Result<Tensor> {
        fake_quant(x, fmt)
    }

    /// `crate::cuda::index_select`'s CPU path for these keys (the reference scores of each
    /// sequence's keys, its visible count, the reference top-k and candidate blocks).
    pub fn select_topk(
        q: &Tensor,
        w: &Tensor,
        src: &SelectKeys,
        k: usize,
        consume: Option<&Candidates>,
        publish: Option<CandidateShape>,
    ) -> Result<Selection> {
        let PoolRows::Bf16(keys) = src.keys;
        let (entries, total) = (src.entries, keys.dim(0)?);
        let (table, vis) = (src.page_table.to_vec2::<i64>()?, src.visible.to_vec1::<u32>()?);
        let w = w.to_dtype(DType::F32)?;
        let mut scores = Vec::with_capacity(table.len());
        for (b, pages) in table.iter().enumerate() {
            // The sequence's entries in entry order: the slots of the pages it holds (up to the
            // first page it does not hold), at most `entries`.
            let slots: Vec<u32> = pages
                .iter()
                .map_while(|&pg| usize::try_from(pg).ok().filter(|pg| (pg + 1) * PageTable::PAGE <= total))
                .flat_map(|pg| (pg * PageTable::PAGE..(pg + 1) * PageTable::PAGE).map(|s| s as u32))
                .take(entries)
                .collect();
            let mut row = if slots.is_empty() {
                Vec::new()
            } else {
                let n = slots.len();
                let rows = keys.index_select(&Tensor::from_vec(slots, n, keys.device())?, 0)?;
                index_scores(&q.narrow(0, b, 1)?, &w.narrow(0, b, 1)?, &rows)?.remove(0)
            };
            row.resize(entries, f32::NEG_INFINITY);
            scores.push(row);
        }
        let visible: Vec<usize> = vis.iter().map(|&v| (v as usize).min(entries)).collect();
        reference_selection(scores, &visible, k, consume, publish, q.device())
    }

    /// The reference sparse attention over the window pool's rows followed by the extra pool's.
    pub fn attend(q: &Tensor, window: &PoolRows, idx_window: &Tensor, extra: &PoolRows, idx_extra: &Tensor, sink: &Tensor, scale: f32) -> Result<Tensor> {
        let (PoolRows::Bf16(w), PoolRows::Bf16(e)) = (window, extra);
        if idx_extra.dim(1)? == 0 {
            return sparse_attention(q, w, idx_window, sink, scale);
        }
        let n = w.dim(0)? as i64;
        let shifted = idx_extra.ge(0i64)?.where_cond(&idx_extra.affine(1.0, n as f64)?, idx_extra)?;
        let indices = Tensor::cat(&[idx_window, &shifted], 1)?;
        sparse_attention(q, &Tensor::cat(&[w, e], 0)?, &indices, sink, scale)
    }
}
