//! Sparse attention with a sink for head dims the FlashMLA-style kernels do not take
//! (`kernels/sparse_attention_small.cu`; d ≤ [`SPARSE_ATTENTION_SMALL_MAX_DIM`], bf16 rows): one
//! launch in the order of the CPU reference [`crate::attention::sparse_attention_ref`] (blocks
//! of 64 valid rows, the running max, bf16-rounded probabilities), up to the dot products' f32
//! summation order and `expf`'s last bit (`tests/cuda_sparse_attention_small.rs`). It replaces
//! [`crate::attention::sparse_attention_candle`] (~28 Candle kernels) on CUDA for the small
//! configs, e.g. the embedded model's decode step.

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
use candle_core::{DType, Result, Tensor};

use super::device::{as_cuda, cuda_tensor, raw_stream, read_ptr, stream_for};
use super::ffi::check_status;

/// `DSV41_SA_SMALL_MAX_DIM`: the largest head dim of [`sparse_attention_small`].
pub const SPARSE_ATTENTION_SMALL_MAX_DIM: usize = 512;

/// `Dsv41SparseAttentionSmallParams` of `kernels/include/dsv41_sparse_attention_small.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SparseAttentionSmallParams {
    q: *const c_void,
    kv_a: *const c_void,
    idx_a: *const i64,
    kv_b: *const c_void,
    idx_b: *const i64,
    sink: *const f32,
    out: *mut c_void,
    na: i64,
    nb: i64,
    t: i32,
    h: i32,
    d: i32,
    ka: i32,
    kb: i32,
    scale: f32,
}

extern "C" {
    fn dsv41_sparse_attention_small(p: *const SparseAttentionSmallParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// Whether [`sparse_attention_small`] takes a query `[T, H, d]` over bf16 rows: bf16 on a CUDA
/// device, 1 ≤ d ≤ [`SPARSE_ATTENTION_SMALL_MAX_DIM`].
pub fn sparse_attention_small_supported(q: &Tensor, window: &Tensor, extra: &Tensor) -> bool {
    let d = q.dims().get(2).copied().unwrap_or(0);
    q.device().is_cuda()
        && q.dtype() == DType::BF16
        && window.dtype() == DType::BF16
        && extra.dtype() == DType::BF16
        && (1..=SPARSE_ATTENTION_SMALL_MAX_DIM).contains(&d)
}

/// Token t, head h attends to the valid rows of `[window[idx_window[t]] ; extra[idx_extra[t]]]`
/// (an index < 0 or past its source is none; K = V = the row) with the sink logit `sink[h]` in
/// the denominator: `q` `[T, H, d]` bf16, `window` `[Nw, d]` / `extra` `[Ne, d]` bf16 rows,
/// `idx_window` `[T, Kw]` / `idx_extra` `[T, Ke]` i64 (Ke may be 0), `sink` `[H]` f32, all on
/// one CUDA device. Returns `[T, H, d]` bf16; a token without valid rows and without a sink gets
/// zeros. Errors (never panics) on another dtype, device or shape.
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention_small(q: &Tensor, window: &Tensor, idx_window: &Tensor, extra: &Tensor, idx_extra: &Tensor, sink: &Tensor, scale: f32) -> Result<Tensor> {
    let op = "sparse_attention_small";
    let (t, h, d) = q.dims3()?;
    if !sparse_attention_small_supported(q, window, extra) {
        candle_core::bail!(
            "{op}: q [T, H, d] with 1 <= d <= {SPARSE_ATTENTION_SMALL_MAX_DIM} and the rows must be bf16 on a CUDA device, got q {:?} {:?} on {:?}, rows {:?} / {:?}",
            q.shape(),
            q.dtype(),
            q.device(),
            window.dtype(),
            extra.dtype()
        )
    }
    let (nw, wd) = window.dims2()?;
    let (ne, ed) = extra.dims2()?;
    let (tw, kw) = idx_window.dims2()?;
    let (te, ke) = idx_extra.dims2()?;
    if wd != d || ed != d || tw != t || te != t || sink.dims1()? != h {
        candle_core::bail!(
            "{op}: q {:?}, rows {:?} / {:?}, indices {:?} / {:?}, sink {:?} disagree (want rows [N, d], indices [T, K], sink [H])",
            q.shape(),
            window.shape(),
            extra.shape(),
            idx_window.shape(),
            idx_extra.shape(),
            sink.shape()
        )
    }
    if idx_window.dtype() != DType::I64 || idx_extra.dtype() != DType::I64 || sink.dtype() != DType::F32 {
        candle_core::bail!("{op}: indices must be i64 and the sink f32, got {:?} / {:?} and {:?}", idx_window.dtype(), idx_extra.dtype(), sink.dtype())
    }
    for x in [window, idx_window, extra, idx_extra, sink] {
        if !x.device().same_device(q.device()) {
            candle_core::bail!("{op}: every tensor must be on q's device {:?}, got one on {:?}", q.device(), x.device())
        }
    }
    if t * h > i32::MAX as usize || kw + ke > i32::MAX as usize - 256 {
        candle_core::bail!("{op}: T·H = {} and Kw + Ke = {} must stay below 2^31", t * h, kw + ke)
    }
    if t == 0 {
        return Tensor::zeros((0, h, d), DType::BF16, q.device());
    }
    let (q, window, iw, extra, ie, sink) = (q.contiguous()?, window.contiguous()?, idx_window.contiguous()?, extra.contiguous()?, idx_extra.contiguous()?, sink.contiguous()?);
    let (qs, ql) = q.storage_and_layout();
    let (ws, wl) = window.storage_and_layout();
    let (iws, iwl) = iw.storage_and_layout();
    let (es, el) = extra.storage_and_layout();
    let (ies, iel) = ie.storage_and_layout();
    let (ss, sl) = sink.storage_and_layout();
    let qc = as_cuda(&qs, "q")?;
    let stream = stream_for(qc)?;
    let dev = qc.device.clone();
    // SAFETY: the kernel writes every element of the output.
    let mut out = unsafe { dev.alloc::<half::bf16>(t * h * d)? };
    {
        let (q_p, _g0) = read_ptr::<half::bf16>(qc, ql, &stream)?;
        let (w_p, _g1) = read_ptr::<half::bf16>(as_cuda(&ws, "window")?, wl, &stream)?;
        let (iw_p, _g2) = read_ptr::<i64>(as_cuda(&iws, "idx_window")?, iwl, &stream)?;
        let (e_p, _g3) = read_ptr::<half::bf16>(as_cuda(&es, "extra")?, el, &stream)?;
        let (ie_p, _g4) = read_ptr::<i64>(as_cuda(&ies, "idx_extra")?, iel, &stream)?;
        let (s_p, _g5) = read_ptr::<f32>(as_cuda(&ss, "sink")?, sl, &stream)?;
        let (o_p, _g6) = out.device_ptr_mut(&stream);
        // A source without rows has no valid index (its buffer may not even have an address).
        let (ka, kb) = (if nw == 0 { 0 } else { kw }, if ne == 0 { 0 } else { ke });
        let params = SparseAttentionSmallParams {
            q: q_p as *const c_void,
            kv_a: w_p as *const c_void,
            idx_a: if ka == 0 { std::ptr::null() } else { iw_p },
            kv_b: e_p as *const c_void,
            idx_b: if kb == 0 { std::ptr::null() } else { ie_p },
            sink: s_p,
            out: o_p as *mut c_void,
            na: nw as i64,
            nb: ne as i64,
            t: t as i32,
            h: h as i32,
            d: d as i32,
            ka: ka as i32,
            kb: kb as i32,
            scale,
        };
        // SAFETY: every input is a read-locked contiguous tensor of the checked shape and dtype;
        // the output holds T·H·d bf16; the launcher checks counts and pointers.
        let code = unsafe { dsv41_sparse_attention_small(&params, std::mem::size_of::<SparseAttentionSmallParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop((qs, ws, iws, es, ies, ss));
    Ok(cuda_tensor(candle_core::CudaStorage::wrap_cuda_slice(out, dev), (t, h, d)))
}
