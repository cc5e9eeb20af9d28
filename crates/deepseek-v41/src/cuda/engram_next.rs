//! The tokens and Engram row ids of a decode step that follows the last one on the device
//! (`kernels/engram_next.cu`): [`crate::model::engram_next::NextIds::apply`] on CUDA, bit for bit
//! its CPU reference [`crate::model::engram_next::next_ids_ref`] (`tests/cuda_engram_next.rs`).
//! The id buffer is written in place (candle's in-place op API holds its write lock while the
//! kernel is enqueued).

use std::ffi::c_void;

use candle_core::backend::BackendStorage;

use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp1, Layout, Result, Tensor};

use super::device::{as_cuda, raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi::check_status;
use crate::model::engram_next::NextIdsGeometry;

/// `Dsv41EngramNextParams` of `kernels/include/dsv41_engram_next.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct EngramNextParams {
    sampled: *const u32,
    map: *const u32,
    tables: *const i64,
    buf: *mut u32,
    batch: i32,
    rows: i32,
    layers: i32,
    cols: i32,
    ngram: i32,
    heads: i32,
    vocab: i32,
    _pad: i32,
}

extern "C" {
    fn dsv41_engram_next(p: *const EngramNextParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// Writes the first `sampled.len()` rows of the id buffer `buf` (`[g.len()]` u32, contiguous)
/// from `sampled` (`[n]` u32, contiguous), the token map `map` (`[vocab]` u32) and the hash
/// tables `tables` (`[g.layers · g.table_width()]` i64), all on one CUDA device; the shapes are
/// checked by the caller, [`crate::model::engram_next::NextIds::apply`].
pub fn engram_next_device(buf: &Tensor, sampled: &Tensor, map: &Tensor, tables: &Tensor, g: NextIdsGeometry) -> Result<()> {
    let op = "engram_next_device";
    let n = sampled.dims1()?;
    let fits = |v: usize| v <= i32::MAX as usize;
    if ![g.batch, g.layers, g.cols, g.ngram, g.heads, map.elem_count()].into_iter().all(fits) {
        candle_core::bail!("{op}: geometry {g:?} or a map of {} ids out of range", map.elem_count())
    }
    if g.layers > 0 && (map.elem_count() == 0 || tables.elem_count() != g.layers * g.table_width()) {
        candle_core::bail!("{op}: {} table values and {} map ids for {} layers", tables.elem_count(), map.elem_count(), g.layers)
    }
    if n == 0 {
        return Ok(());
    }
    let (ss, sl) = sampled.storage_and_layout();
    let (ms, ml) = map.storage_and_layout();
    let (ts, tl) = tables.storage_and_layout();
    let sc = as_cuda(&ss, "sampled")?;
    let stream = stream_for(sc)?;
    let (s_p, _gs) = read_ptr::<u32>(sc, sl, &stream)?;
    let with_tables = g.layers > 0;
    let (m_p, _gm) = if with_tables { read_ptr::<u32>(as_cuda(&ms, "map")?, ml, &stream).map(|(p, g)| (p, Some(g)))? } else { (std::ptr::null(), None) };
    let (t_p, _gt) = if with_tables { read_ptr::<i64>(as_cuda(&ts, "tables")?, tl, &stream).map(|(p, g)| (p, Some(g)))? } else { (std::ptr::null(), None) };
    let params = EngramNextParams {
        sampled: s_p,
        map: m_p,
        tables: t_p,
        buf: std::ptr::null_mut(),
        batch: g.batch as i32,
        rows: n as i32,
        layers: g.layers as i32,
        cols: g.cols as i32,
        ngram: g.ngram as i32,
        heads: g.heads as i32,
        vocab: map.elem_count() as i32,
        _pad: 0,
    };
    buf.inplace_op1(&Launch { params })?;
    Ok(())
}

/// The launch with the buffer write-locked.
struct Launch {
    params: EngramNextParams,
}

impl InplaceOp1 for Launch {
    fn name(&self) -> &'static str {
        "engram_next"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("engram_next_device: the id buffer must be on a CUDA device")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        if !l.is_contiguous() || s.dtype() != DType::U32 {
            candle_core::bail!("engram_next_device: the id buffer must be contiguous u32")
        }
        let stream = stream_for(s)?;
        let (b_p, _g) = write_ptr::<u32>(s, l, &stream)?;
        let p = EngramNextParams { buf: b_p, ..self.params };
        // SAFETY: the read pointers are read-locked contiguous tensors of the checked sizes (held
        // by the caller across this call), the buffer is write-locked with the geometry's length;
        // the launcher checks counts and pointers.
        let code = unsafe { dsv41_engram_next(&p, std::mem::size_of::<EngramNextParams>(), raw_stream(&stream)) };
        check_status("engram_next_device", code)
    }
}
