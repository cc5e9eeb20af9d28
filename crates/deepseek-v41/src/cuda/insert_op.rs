//! The bf16 row-insert op shared by [`super::window_insert`], [`super::compressed_insert`] and
//! [`super::index_key_insert`]: for every token t,
//!
//! ```text
//! cache[slots[t]] = [fake_quant]( RoPE(cos[t], sin[t])( [RmsNorm](rows[t]) ) )
//! ```
//!
//! On CUDA this is one fused kernel launch (`kernels/*_insert.cu`); on the CPU it is the
//! reference ([`RowInputs::reference_rows`]: the crate's own norm, RoPE and fake quant), then
//! the rows copied into the cache. The CUDA kernels reproduce it bit for bit, including the bf16
//! roundings between the stages.
//!
//! # In-place safety
//!
//! The cache is written through candle's [`Tensor::inplace_op2`]: candle holds the cache's
//! storage write lock for the whole call and refuses rows that share the cache's storage (this
//! op declares no aliasing access pattern); the other inputs are locked as explained in
//! [`super::row_inputs`]. The kernel writes only rows `slots[t] ∈ [0, S)` of the `[S, D]` cache
//! view, whose rows are checked dense and non-overlapping (row stride >= D), so no write leaves
//! the view. Two tokens naming the same slot in one call would race on the GPU (the row would
//! hold bytes of either): callers pass unique slots (see [`super::keep_last_writer`]); the CPU
//! path rejects duplicates.

use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp2, Layout, Result, Tensor};
use half::bf16;

use super::device::{raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi;
use super::row_inputs::{cpu_rows, row_stride, vector_elems, RowInputs};
use crate::quant::fake_quant::QatFormat;

/// Which of the three cache inserts an op performs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InsertKind {
    /// Window KV rows (spec §4.3), Q1.
    Window,
    /// Compressed KV entries (spec §4.4), Q2.
    Compressed,
    /// Indexer keys with their k_norm (spec §6.2), Q3.
    IndexKey,
}

impl InsertKind {
    fn name(self) -> &'static str {
        match self {
            Self::Window => "window_insert",
            Self::Compressed => "compressed_insert",
            Self::IndexKey => "index_key_insert",
        }
    }

    /// The QAT format of this cache (spec §2.3).
    pub(crate) fn format(self) -> QatFormat {
        match self {
            Self::Window => QatFormat::Fp8Ue8m0B32,
            Self::Compressed => QatFormat::Fp4E4m3B16,
            Self::IndexKey => QatFormat::Fp4Ue8m0B32,
        }
    }
}

/// `enum Dsv41Quant` value of a format.
pub(crate) fn quant_code(fmt: QatFormat) -> i32 {
    match fmt {
        QatFormat::Fp8Ue8m0B32 => ffi::QUANT_FP8_UE8M0_B32,
        QatFormat::Fp4E4m3B16 => ffi::QUANT_FP4_E4M3_B16,
        QatFormat::Fp4Ue8m0B32 => ffi::QUANT_FP4_UE8M0_B32,
    }
}

struct RowInsert {
    kind: InsertKind,
    fake_quant: bool,
    inputs: RowInputs,
}

impl RowInsert {
    fn quant(&self) -> Option<QatFormat> {
        self.fake_quant.then(|| self.kind.format())
    }
}

/// Checks every argument and runs the insert (the common body of the three public functions).
#[allow(clippy::too_many_arguments)]
pub(crate) fn insert_rows(
    kind: InsertKind,
    cache: &Tensor,
    rows: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    slots: &Tensor,
    norm: Option<(&Tensor, f64)>,
    fake_quant: bool,
) -> Result<()> {
    let op = kind.name();
    if cache.dtype() != DType::BF16 || cache.rank() != 2 {
        candle_core::bail!(
            "{op}: cache must be [num_slots, head_dim] bf16, got {:?} {:?}",
            cache.dtype(),
            cache.shape()
        )
    }
    let d = cache.dim(1)?;
    let block = kind.format().block();
    if fake_quant && !d.is_multiple_of(block) {
        candle_core::bail!("{op}: head_dim {d} is not a multiple of the {} block {block}", kind.format())
    }
    let (inputs, rows) = RowInputs::check(op, d, cache.device(), rows, cos, sin, slots, norm)?;
    let (cs, stride) = (cache.stride(), row_stride(cache.layout(), d));
    if cs[1] != 1 || stride < d {
        candle_core::bail!("{op}: cache rows must be dense and non-overlapping, got strides {cs:?}")
    }
    if cache.device().is_cuda() {
        let (v, off) = (vector_elems(d), cache.layout().start_offset());
        if !off.is_multiple_of(v) || !stride.is_multiple_of(v) {
            candle_core::bail!("{op}: cache view (offset {off}, row stride {stride}) is not aligned to {v} elements")
        }
    }
    if rows.dim(0)? == 0 {
        return Ok(());
    }
    cache.inplace_op2(&rows, &RowInsert { kind, fake_quant, inputs })
}

impl InplaceOp2 for RowInsert {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, src: &CpuStorage, sl: &Layout) -> Result<()> {
        let op = self.kind.name();
        let d = sl.dims()[1];
        let rows = self.inputs.reference_rows(&cpu_rows(src, sl, op)?, self.quant())?;
        let rows = rows.flatten_all()?.to_vec1::<bf16>()?;
        let num_slots = dl.dims()[0];
        let slots = self.inputs.host_slots(op, num_slots)?;
        let CpuStorage::BF16(cache) = dst else { candle_core::bail!("{op}: expected a bf16 cache storage") };
        let (off, stride) = (dl.start_offset(), row_stride(dl, d));
        for (t, &s) in slots.iter().enumerate() {
            if s >= 0 && (s as u64) < num_slots as u64 {
                let o = off + s as usize * stride;
                cache[o..o + d].copy_from_slice(&rows[t * d..(t + 1) * d]);
            }
        }
        Ok(())
    }

    fn cuda_fwd(&self, dst: &mut CudaStorage, dl: &Layout, src: &CudaStorage, sl: &Layout) -> Result<()> {
        let stream = stream_for(src)?;
        let (t, d) = (sl.dims()[0], sl.dims()[1]);
        let locked = self.inputs.lock();
        let inp = locked.pointers(&stream)?;
        let (src_ptr, _src_sync) = read_ptr::<bf16>(src, sl, &stream)?;
        let (cache, _cache_sync) = write_ptr::<bf16>(dst, dl, &stream)?;
        let params = ffi::RowInsertParams {
            src: src_ptr.cast(),
            cos: inp.cos,
            sin: inp.sin,
            slots: inp.slots,
            norm_weight: inp.norm_weight,
            cache: cache.cast(),
            src_row_stride: row_stride(sl, d) as i64,
            cache_row_stride: row_stride(dl, d) as i64,
            num_slots: dl.dims()[0] as i64,
            num_tokens: t as i32,
            head_dim: d as i32,
            rope_dim: self.inputs.rope_dim()? as i32,
            quant: self.quant().map_or(ffi::QUANT_NONE, quant_code),
            apply_norm: self.inputs.norm.is_some() as i32,
            norm_eps: inp.norm_eps as f32,
            norm_inv_dim: (1.0 / d as f64) as f32,
            _pad: 0,
        };
        let launcher = match self.kind {
            InsertKind::Window => ffi::dsv41_window_insert,
            InsertKind::Compressed => ffi::dsv41_compressed_insert,
            InsertKind::IndexKey => ffi::dsv41_index_key_insert,
        };
        // SAFETY: every pointer comes from a storage locked for this call (the cache with its
        // write lock); shapes, strides and alignment were checked in `insert_rows` and again by
        // the launcher; the kernel writes only rows [0, num_slots) of the cache view (module
        // docs). The guards keep cudarc's stream ordering until the launch is enqueued.
        let code = unsafe { launcher(&params, std::mem::size_of::<ffi::RowInsertParams>(), raw_stream(&stream)) };
        ffi::check_status(self.kind.name(), code)
    }
}
