//! Index scores on the GPU (spec §6.3 steps 4–6, §0.1b.1): `kernels/indexer_scores.cu` with
//! the reference's bf16 rounding steps, the visibility rule and the consumers' allowed-block
//! mask, for bf16 and packed MXFP4 key rows. CPU path: the crate's
//! [`crate::attention::indexer::index_scores`] + [`crate::attention::indexer::mask_invisible`]
//! (the reference).
//!
//! Besides the public op this file holds the launch plumbing shared with
//! [`super::index_select`]: locking the inputs and building the kernel's parameter block.

use std::ffi::c_void;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtrMut, SyncOnDrop};
use candle_core::cuda_backend::CudaDevice;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Result, Storage, Tensor};
use half::bf16;

use super::device::{aligned_rows, as_cuda, raw_stream, read_ptr, stream_for};
use super::ffi;
use super::indexer_inputs::{IndexKeys, KeySource, Visibility, INDEX_HEAD_DIM, MAX_INDEX_HEADS};
use crate::attention::indexer::{index_scores as reference_scores, mask_invisible, mask_outside_blocks, Candidates};

/// Masked index scores `[T, N]` bf16 on `q`'s device:
/// `S[t, j] = bf16(Σ_h bf16(ReLU(bf16(q[t,h]·K[j])) · w[t,h]))` for visible entries in allowed
/// blocks, −inf otherwise.
///
/// * `q`: `[T, H, 128]` bf16 index queries (H ≤ 32 on CUDA); `w`: `[T, H]` f32 (or bf16) head
///   weights with bf16 values ([`crate::attention::indexer::Indexer::head_weights`]).
/// * `src`: the keys, each query's first row, N and the visibility rule.
/// * `allowed`: a consumer's published candidate blocks (kept `[T, n_keep]` i64): entries outside
///   them get −inf.
///
/// CUDA and CPU agree bit for bit whenever the f32 dot products do (always for fake-quantized
/// queries and keys with block scales within 2^10 of each other, spec §2.3).
pub fn masked_index_scores(q: &Tensor, w: &Tensor, src: &KeySource, allowed: Option<&Candidates>) -> Result<Tensor> {
    const OP: &str = "masked_index_scores";
    let (t, _, _) = check_queries(OP, q, w)?;
    src.check(OP, t, q.device())?;
    if let Some(c) = allowed {
        check_candidates(OP, c, t, q.device())?;
    }
    if !q.device().is_cuda() {
        return cpu_masked_scores(q, w, src, allowed);
    }
    let mask = allowed.map(|c| allowed_mask(c, src.entries).map(|m| (m, c.block))).transpose()?;
    let n = src.entries;
    let stride = n.div_ceil(8).max(1) * 8;
    let scores = with_score_params(q, w, src, mask.as_ref().map(|(m, b)| (m, *b)), |base, stream, dev| {
        // SAFETY: the kernel writes every element of columns [0, N) of every row.
        let mut out = unsafe { dev.alloc::<bf16>(t * stride)? };
        {
            let (ptr, _g) = out.device_ptr_mut(stream);
            let p = ffi::IndexerScoresParams { scores: ptr as *mut c_void, score_row_stride: stride as i64, ..*base };
            launch_scores(&p, stream)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })?;
    Tensor::from_storage(Storage::Cuda(scores), (t, stride), BackpropOp::none(), false).narrow(1, 0, n)
}

/// `(T, H, D)` after validating `q` `[T, H, 128]` bf16 and `w` `[T, H]` float.
pub(crate) fn check_queries(op: &str, q: &Tensor, w: &Tensor) -> Result<(usize, usize, usize)> {
    let (t, h, d) = q.dims3().map_err(|_| candle_core::Error::Msg(format!("{op}: q must be [T, H, D], got {:?}", q.shape())))?;
    if q.dtype() != DType::BF16 || d != INDEX_HEAD_DIM {
        candle_core::bail!("{op}: q must be [T, H, {INDEX_HEAD_DIM}] bf16, got {:?} {:?}", q.shape(), q.dtype())
    }
    if w.dims() != [t, h] || !w.dtype().is_float() || !w.device().same_device(q.device()) {
        candle_core::bail!("{op}: w must be [{t}, {h}] float on q's device, got {:?} {:?}", w.shape(), w.dtype())
    }
    if q.device().is_cuda() && !(1..=MAX_INDEX_HEADS).contains(&h) {
        candle_core::bail!("{op}: the CUDA kernels take 1..={MAX_INDEX_HEADS} index heads, got q {:?}", q.shape())
    }
    if t > i32::MAX as usize {
        candle_core::bail!("{op}: {t} tokens exceed the kernels' i32 range")
    }
    Ok((t, h, d))
}

pub(crate) fn check_candidates(op: &str, c: &Candidates, tokens: usize, device: &Device) -> Result<()> {
    if c.kept.rank() != 2 || c.kept.dim(0)? != tokens || c.kept.dtype() != DType::I64 || c.block == 0 {
        candle_core::bail!(
            "{op}: candidates must be kept blocks [{tokens}, n_keep] i64 with block >= 1, got {:?} {:?} block {}",
            c.kept.shape(),
            c.kept.dtype(),
            c.block
        )
    }
    if !c.kept.device().same_device(device) {
        candle_core::bail!("{op}: candidates are on {:?}, queries on {device:?}", c.kept.device())
    }
    Ok(())
}

/// The CPU reference: per group of queries sharing their first key row, the reference scores,
/// then the visibility and candidate masks.
fn cpu_masked_scores(q: &Tensor, w: &Tensor, src: &KeySource, allowed: Option<&Candidates>) -> Result<Tensor> {
    let rows = cpu_scores(q, w, src)?;
    let t = rows.len();
    let n = src.entries;
    let visible = src.visibility.host(t, n)?;
    let kept = allowed.map(|c| c.kept_rows().map(|r| (c.block, r))).transpose()?;
    let mut out = Vec::with_capacity(t * n);
    for (ti, row) in rows.into_iter().enumerate() {
        let mut s = mask_invisible(row, visible[ti]);
        if let Some((block, kept)) = &kept {
            mask_outside_blocks(&mut s, *block, &kept[ti]);
        }
        out.extend(s);
    }
    Tensor::from_vec(out, (t, n), &Device::Cpu)?.to_dtype(DType::BF16)?.to_device(q.device())
}

/// Unmasked reference score rows `[T][N]` (entries past a query's cache rows: −inf).
pub(crate) fn cpu_scores(q: &Tensor, w: &Tensor, src: &KeySource) -> Result<Vec<Vec<f32>>> {
    let (t, _, _) = q.dims3()?;
    let (q, w) = (q.to_device(&Device::Cpu)?, w.to_device(&Device::Cpu)?.to_dtype(DType::F32)?);
    let n = src.entries;
    let mut out = vec![Vec::new(); t];
    if let Some(paged) = src.host_paged_rows(t)? {
        // Through the page table: each query's own rows.
        for (ti, slots) in paged.into_iter().enumerate() {
            let mut row = if slots.is_empty() {
                Vec::new()
            } else {
                let keys = src.keys.host_slots(&slots)?.to_dtype(DType::BF16)?;
                reference_scores(&q.narrow(0, ti, 1)?, &w.narrow(0, ti, 1)?, &keys)?.remove(0)
            };
            row.resize(n, f32::NEG_INFINITY);
            out[ti] = row;
        }
        return Ok(out);
    }
    let rows_total = src.keys.rows()?;
    let base = src.host_base(t)?;
    let mut t0 = 0;
    while t0 < t {
        let mut t1 = t0 + 1;
        while t1 < t && base[t1] == base[t0] {
            t1 += 1;
        }
        let avail = rows_total.saturating_sub(base[t0]).min(n);
        let keys = src.keys.host_rows(base[t0], avail)?.to_dtype(DType::BF16)?;
        let s = reference_scores(&q.narrow(0, t0, t1 - t0)?, &w.narrow(0, t0, t1 - t0)?, &keys)?;
        for (i, mut row) in s.into_iter().enumerate() {
            row.resize(n, f32::NEG_INFINITY);
            out[t0 + i] = row;
        }
        t0 = t1;
    }
    Ok(out)
}

/// The allowed-block bitmask `[T, words]` u32 of published candidates over `entries` entries
/// (`kernels/indexer_allowed_mask.cu`).
pub(crate) fn allowed_mask(c: &Candidates, entries: usize) -> Result<Tensor> {
    const OP: &str = "indexer allowed mask";
    let (t, n_blocks) = c.kept.dims2()?;
    let words = entries.div_ceil(c.block).div_ceil(32).max(1);
    if words > 12288 || n_blocks > i32::MAX as usize {
        candle_core::bail!("{OP}: {entries} entries in blocks of {} need {words} mask words (at most 12288)", c.block)
    }
    let kept = c.kept.contiguous()?;
    let (ks, kl) = kept.storage_and_layout();
    let kc = as_cuda(&ks, "candidates")?;
    let stream = stream_for(kc)?;
    // SAFETY: the kernel writes all `words` words of every row.
    let mut out = unsafe { kc.device.alloc::<u32>(t * words)? };
    {
        let (k_p, _g0) = read_ptr::<i64>(kc, kl, &stream)?;
        let (o_p, _g1) = out.device_ptr_mut(&stream);
        let p = ffi::IndexerMaskParams {
            blocks: k_p,
            allowed: o_p as *mut u32,
            num_tokens: t as i32,
            n_blocks: n_blocks as i32,
            words: words as i32,
            _pad: 0,
        };
        // SAFETY: pointers of storages locked for this call, shapes checked above.
        let code =
            unsafe { ffi::dsv41_indexer_allowed_mask(&p, std::mem::size_of::<ffi::IndexerMaskParams>(), raw_stream(&stream)) };
        ffi::check_status(OP, code)?;
    }
    let s = CudaStorage::wrap_cuda_slice(out, kc.device.clone());
    Ok(Tensor::from_storage(Storage::Cuda(s), (t, words), BackpropOp::none(), false))
}


/// Locks the scoring inputs, builds the parameter block for all T tokens (no `scores` pointer
/// yet) and runs `f` with it, the stream and the device; the inputs stay locked during `f`.
/// `mask`: the allowed-block bitmask `[T, words]` u32 of [`allowed_mask`] and its block size.
pub(crate) fn with_score_params<R>(
    q: &Tensor,
    w: &Tensor,
    src: &KeySource,
    mask: Option<(&Tensor, usize)>,
    f: impl FnOnce(&ffi::IndexerScoresParams, &Arc<CudaStream>, &CudaDevice) -> Result<R>,
) -> Result<R> {
    let (t, h, d) = q.dims3()?;
    let q = q.contiguous()?;
    let w = w.to_dtype(DType::F32)?.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let qc = as_cuda(&qs, "q")?;
    let stream = stream_for(qc)?;
    let (ws, wl) = w.storage_and_layout();
    let (q_p, _g0) = read_ptr::<bf16>(qc, ql, &stream)?;
    let (w_p, _g1) = read_ptr::<f32>(as_cuda(&ws, "w")?, wl, &stream)?;
    let (keys, format, row_stride, page_size) = match src.keys {
        IndexKeys::Rows(k) => {
            let k = aligned_rows(k)?;
            let stride = if k.dim(0)? <= 1 { INDEX_HEAD_DIM } else { k.stride()[0] };
            (k, ffi::INDEX_KEYS_BF16, stride as i64, 0)
        }
        IndexKeys::Packed { cache, layout } => {
            if !cache.layout().start_offset().is_multiple_of(16) {
                candle_core::bail!("index scores: the packed cache view must start on a 16-byte boundary")
            }
            (cache.clone(), ffi::INDEX_KEYS_MXFP4, layout.page_bytes() as i64, layout.page_size() as i32)
        }
    };
    let (ks, kl) = keys.storage_and_layout();
    let kc = as_cuda(&ks, "keys")?;
    let (k_p, _g2) = if format == ffi::INDEX_KEYS_BF16 {
        let (p, g) = read_ptr::<bf16>(kc, kl, &stream)?;
        (p as *const c_void, g)
    } else {
        let (p, g) = read_ptr::<u8>(kc, kl, &stream)?;
        (p as *const c_void, g)
    };
    let base = src.base.map(|b| b.contiguous()).transpose()?;
    let base_sl = base.as_ref().map(|b| b.storage_and_layout());
    let table_sl = src.pages.map(|p| p.table.storage_and_layout());
    let (table_p, table_guard) = match (&table_sl, src.pages) {
        (Some((ts, tl)), Some(p)) => {
            let (ptr, g) = read_ptr::<i64>(as_cuda(ts, "page table")?, tl, &stream)?;
            let stride = if p.table.dim(0)? <= 1 { p.table.dim(1)? } else { p.table.stride()[0] };
            (ptr, Some((g, stride, p.page_size)))
        }
        _ => (std::ptr::null(), None),
    };
    let (table_stride, table_page) = table_guard.as_ref().map_or((0, 0), |(_, s, p)| (*s as i64, *p as i32));
    let vis = match src.visibility {
        Visibility::Counts(c) => Some(c.contiguous()?),
        Visibility::Causal { .. } => None,
    };
    let vis_sl = vis.as_ref().map(|v| v.storage_and_layout());
    let mask_sl = mask.map(|(m, _)| m.storage_and_layout());
    let mut guards = Vec::new();
    let base_p = ptr_u32(base_sl.as_ref().map(|(s, l)| (&**s, *l)), "key base", &stream, &mut guards)?;
    let vis_p = ptr_u32(vis_sl.as_ref().map(|(s, l)| (&**s, *l)), "visible counts", &stream, &mut guards)?;
    let mask_p = ptr_u32(mask_sl.as_ref().map(|(s, l)| (&**s, *l)), "allowed mask", &stream, &mut guards)?;
    let (start, ratio) = match src.visibility {
        Visibility::Causal { start, ratio } => (start as i64, ratio as i32),
        Visibility::Counts(_) => (0, 1),
    };
    let params = ffi::IndexerScoresParams {
        q: q_p as *const c_void,
        w: w_p,
        keys: k_p,
        key_base: base_p,
        visible: vis_p,
        allowed: mask_p,
        page_table: table_p,
        scores: std::ptr::null_mut(),
        key_row_stride: row_stride,
        num_key_rows: src.keys.rows()? as i64,
        score_row_stride: 0,
        start,
        page_table_stride: table_stride,
        num_tokens: t as i32,
        num_heads: h as i32,
        head_dim: d as i32,
        num_cols: src.entries as i32,
        key_format: format,
        page_size,
        ratio,
        allowed_words: mask.map_or(Ok(0), |(m, _)| m.dim(1))? as i32,
        allowed_block: mask.map_or(1, |(_, b)| b) as i32,
        table_page_size: table_page,
    };
    let r = f(&params, &stream, &qc.device);
    drop(guards);
    r
}

/// Read pointer of an optional u32 tensor (null when absent); its guard goes to `guards`.
fn ptr_u32<'a>(
    sl: Option<(&'a Storage, &candle_core::Layout)>,
    what: &str,
    stream: &'a CudaStream,
    guards: &mut Vec<SyncOnDrop<'a>>,
) -> Result<*const u32> {
    match sl {
        Some((s, l)) => {
            let (p, g) = read_ptr::<u32>(as_cuda(s, what)?, l, stream)?;
            guards.push(g);
            Ok(p)
        }
        None => Ok(std::ptr::null()),
    }
}

/// The parameter block of tokens `t0 .. t0 + tc` of `p` (pointers advanced, causal start moved).
pub(crate) fn token_chunk(p: &ffi::IndexerScoresParams, t0: usize, tc: usize) -> ffi::IndexerScoresParams {
    let h = p.num_heads as usize;
    let adv_u32 = |ptr: *const u32, per: usize| if ptr.is_null() { ptr } else { ptr.wrapping_add(t0 * per) };
    ffi::IndexerScoresParams {
        q: (p.q as *const bf16).wrapping_add(t0 * h * INDEX_HEAD_DIM) as *const c_void,
        w: p.w.wrapping_add(t0 * h),
        key_base: adv_u32(p.key_base, 1),
        visible: adv_u32(p.visible, 1),
        allowed: adv_u32(p.allowed, p.allowed_words as usize),
        page_table: if p.page_table.is_null() { p.page_table } else { p.page_table.wrapping_add(t0 * p.page_table_stride as usize) },
        start: p.start + t0 as i64,
        num_tokens: tc as i32,
        ..*p
    }
}

/// Launches the scores kernel with a complete parameter block.
pub(crate) fn launch_scores(p: &ffi::IndexerScoresParams, stream: &CudaStream) -> Result<()> {
    // SAFETY: the caller built `p` from storages locked for this call (`with_score_params`) and an
    // output of at least num_tokens x score_row_stride elements; the launcher validates shapes
    // and alignment, and the kernel reads only key rows < num_key_rows.
    let code = unsafe { ffi::dsv41_indexer_scores(p, std::mem::size_of::<ffi::IndexerScoresParams>(), raw_stream(stream)) };
    ffi::check_status("index scores", code)
}
