//! Top-k and candidate blocks of index-score rows on the GPU (spec §6.3 step 7, §6.4,
//! §0.1b.2): exact radix selections on the bf16 scores with the CPU reference's rules
//! ([`crate::attention::indexer::top_k`], [`crate::attention::indexer::candidate_blocks`]):
//! descending score, ties towards the lower id, outputs ascending and −1 padded. The CPU path is
//! that reference. Kernels: the top-k of rows of at most 64K entries with k ≤ 2048 (the decode
//! shape) reads each row once (`kernels/indexer_topk.cu`: a threshold from a sample of the row,
//! a shared candidate list, id bitmaps for the ordered output, exact
//! fallbacks); longer rows, larger k and the candidate blocks take `kernels/indexer_select.cu`.

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtrMut};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Result, Storage, Tensor};
use half::bf16;

use super::device::{as_cuda, raw_stream, read_ptr, stream_for};
use super::ffi;
use super::indexer_inputs::Visibility;
use super::device::aligned_rows;
use crate::attention::indexer::{candidate_blocks as reference_blocks, top_k as reference_top_k};

/// What to select from a score row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SelectMode {
    /// The top `k` entries (−inf entries eligible; visibility decides).
    TopK,
    /// The candidate blocks of `block` entries (newest visible block pinned, finite only).
    Blocks { block: usize },
}

/// The top `k` of each row of `scores` `[T, N]` bf16 (masked scores, e.g. of
/// [`super::masked_index_scores`]) among its `L_t` visible entries: `[T, k]` i64, entry ids
/// ascending, −1 padded (the best `min(k, L_t)`; ties → lower id).
pub fn index_topk(scores: &Tensor, visibility: &Visibility, k: usize) -> Result<Tensor> {
    select_rows(scores, visibility, k, SelectMode::TopK)
}

/// The candidate blocks of each row of `scores` `[T, N]` bf16 (spec §6.4): block score = max of
/// its visible entries, the block of entry `L_t − 1` pinned, the best `n_keep`, only blocks with
/// a score > −inf kept; `[T, n_keep]` i64, block ids ascending, −1 padded.
pub fn candidate_blocks(scores: &Tensor, visibility: &Visibility, block: usize, n_keep: usize) -> Result<Tensor> {
    if block == 0 {
        candle_core::bail!("candidate_blocks: block size must be >= 1")
    }
    select_rows(scores, visibility, n_keep, SelectMode::Blocks { block })
}

fn select_rows(scores: &Tensor, visibility: &Visibility, k: usize, mode: SelectMode) -> Result<Tensor> {
    const OP: &str = "index top-k";
    let (t, n) = scores.dims2()?;
    if scores.dtype() != DType::BF16 || k == 0 || k > i32::MAX as usize || n > i32::MAX as usize {
        candle_core::bail!("{OP}: scores must be [T, N] bf16 and k in 1..2^31, got {:?} {:?}, k {k}", scores.shape(), scores.dtype())
    }
    visibility.check(OP, t, scores.device())?;
    if !scores.device().is_cuda() {
        return cpu_select(scores, visibility, k, mode);
    }
    let scores = padded_rows(scores)?;
    let (ss, sl) = scores.storage_and_layout();
    let sc = as_cuda(&ss, "scores")?;
    let stream = stream_for(sc)?;
    let vis = match visibility {
        Visibility::Counts(c) => Some(c.contiguous()?),
        Visibility::Causal { .. } => None,
    };
    let vis_sl = vis.as_ref().map(|v| v.storage_and_layout());
    // SAFETY: the kernel writes all k columns of every row.
    let mut out = unsafe { sc.device.alloc::<i64>(t * k)? };
    {
        let (s_p, _g0) = read_ptr::<bf16>(sc, sl, &stream)?;
        let (v_p, _g1) = match &vis_sl {
            Some((s, l)) => {
                let (p, g) = read_ptr::<u32>(as_cuda(s, "visible counts")?, l, &stream)?;
                (p, Some(g))
            }
            None => (std::ptr::null(), None),
        };
        let (o_p, _g2) = out.device_ptr_mut(&stream);
        let row_stride = if t <= 1 { n.div_ceil(8).max(1) * 8 } else { sl.stride()[0] };
        let (start, ratio) = match visibility {
            Visibility::Causal { start, ratio } => (*start as i64, *ratio as i32),
            Visibility::Counts(_) => (0, 1),
        };
        let p = ffi::IndexerSelectParams {
            scores: s_p as *const c_void,
            visible: v_p,
            out: o_p as *mut i64,
            score_row_stride: row_stride.max(8) as i64,
            out_row_stride: k as i64,
            start,
            num_tokens: t as i32,
            num_cols: n as i32,
            k: k as i32,
            mode: 0,
            block: 1,
            ratio,
        };
        launch_select(&p, mode, &stream)?;
    }
    let s = CudaStorage::wrap_cuda_slice(out, sc.device.clone());
    Ok(Tensor::from_storage(Storage::Cuda(s), (t, k), BackpropOp::none(), false))
}

/// `scores` itself when its rows start 16-byte aligned, else a copy padded to a multiple of 8
/// columns (the padding is never read) viewed back to `[T, N]`.
fn padded_rows(scores: &Tensor) -> Result<Tensor> {
    let (t, n) = scores.dims2()?;
    let aligned = aligned_rows(scores)?;
    if t <= 1 || aligned.stride()[0].is_multiple_of(8) {
        return Ok(aligned);
    }
    let pad = n.div_ceil(8) * 8 - n;
    let fill = Tensor::full(f32::NEG_INFINITY, (t, pad), scores.device())?.to_dtype(DType::BF16)?;
    Tensor::cat(&[scores, &fill], 1)?.narrow(1, 0, n)
}

/// Launches the selection kernel on a parameter block whose mode fields are set from `mode`.
pub(crate) fn launch_select(p: &ffi::IndexerSelectParams, mode: SelectMode, stream: &CudaStream) -> Result<()> {
    let (m, block) = match mode {
        SelectMode::TopK => (ffi::SELECT_TOPK, 1),
        SelectMode::Blocks { block } => (ffi::SELECT_BLOCKS, block),
    };
    if block > i32::MAX as usize {
        candle_core::bail!("index top-k: block size {block} out of range")
    }
    let p = ffi::IndexerSelectParams { mode: m, block: block as i32, ..*p };
    // SAFETY: the caller built `p` from storages locked for this call and an output of at least
    // num_tokens x out_row_stride elements; the launcher validates shapes and alignment, and the
    // kernel reads only the first min(N, L_t) entries of each row.
    let code = unsafe { ffi::dsv41_indexer_select(&p, std::mem::size_of::<ffi::IndexerSelectParams>(), raw_stream(stream)) };
    ffi::check_status("index top-k", code)
}

fn cpu_select(scores: &Tensor, visibility: &Visibility, k: usize, mode: SelectMode) -> Result<Tensor> {
    let rows = scores.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let t = rows.len();
    let n = scores.dim(1)?;
    let visible = visibility.host(t, n)?;
    let mut out = Vec::with_capacity(t * k);
    for (row, &vis) in rows.iter().zip(&visible) {
        let masked: Vec<f32> = row.iter().enumerate().map(|(j, &v)| if j < vis { v } else { f32::NEG_INFINITY }).collect();
        match mode {
            SelectMode::TopK => out.extend(reference_top_k(&masked, k, vis)),
            SelectMode::Blocks { block } => {
                let kept = reference_blocks(&masked, vis, block, k);
                out.extend(kept.iter().map(|&b| b as i64).chain(std::iter::repeat(-1)).take(k));
            }
        }
    }
    Tensor::from_vec(out, (t, k), &Device::Cpu)?.to_device(scores.device())
}
