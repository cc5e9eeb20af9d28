//! The row-insert op shared by [`super::window_insert`], [`super::compressed_insert`] and
//! [`super::index_key_insert`]: for every token t,
//!
//! ```text
//! cache[slots[t]] = [fake_quant]( RoPE(cos[t], sin[t])( [RmsNorm](rows[t]) ) )
//! ```
//!
//! On CUDA this is one fused kernel launch (`kernels/*_insert.cu`); on the CPU it is the
//! reference: the crate's own [`RmsNorm`], [`apply_rope_tail`] and [`fake_quant`] applied to the
//! rows, then the rows copied into the cache. The CUDA kernels reproduce that composition bit
//! for bit (including the bf16 roundings between the stages).
//!
//! # In-place safety
//!
//! The cache is written through candle's [`Tensor::inplace_op2`]: candle holds the cache's
//! storage write lock for the whole call and refuses a `rows` tensor that shares the cache's
//! storage (this op declares no aliasing access pattern). Candle's in-place ops lock at most
//! three tensors, so the other inputs (`cos`, `sin` f32, `slots` i64, the norm weight f32) are
//! held by the op and read-locked inside it; their dtypes differ from the cache's (bf16), so
//! they cannot share its storage and the write lock is never requested twice. The kernel writes
//! only rows `slots[t] ∈ [0, S)` of the `[S, D]` cache view (row stride >= D, checked), so no
//! write leaves the view. Two tokens naming the same slot in one call race on the GPU (the row
//! then holds bytes of either token): callers pass unique slots (see
//! [`super::keep_last_writer`]); the CPU path rejects duplicates.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Device, InplaceOp2, Layout, Module, Result, Tensor, WithDType};
use half::bf16;

use super::device::{as_cuda, raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi;
use crate::nn::rms_norm::RmsNorm;
use crate::nn::rope::apply_rope_tail;
use crate::quant::fake_quant::{fake_quant, QatFormat};

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

    fn quant_code(self) -> i32 {
        match self {
            Self::Window => ffi::QUANT_FP8_UE8M0_B32,
            Self::Compressed => ffi::QUANT_FP4_E4M3_B16,
            Self::IndexKey => ffi::QUANT_FP4_UE8M0_B32,
        }
    }
}

/// The inputs of one insert besides the cache and the rows (see the module docs for why they
/// live here). All tensors are contiguous and on the cache's device.
struct RowInsert {
    kind: InsertKind,
    fake_quant: bool,
    /// `[T, R/2]` f32.
    cos: Tensor,
    /// `[T, R/2]` f32.
    sin: Tensor,
    /// `[T]` i64.
    slots: Tensor,
    /// RMSNorm weight `[D]` f32 and eps (index keys only).
    norm: Option<(Tensor, f64)>,
}

/// Vector width (in bf16 elements) the kernels use for a row of `d` elements.
fn vector_elems(d: usize) -> usize {
    (d / 32).clamp(1, 8)
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
    if cache.dtype() != DType::BF16 || rows.dtype() != DType::BF16 {
        candle_core::bail!(
            "{op}: cache and rows must be bf16, got cache {:?} {:?} and rows {:?} {:?}",
            cache.dtype(),
            cache.shape(),
            rows.dtype(),
            rows.shape()
        )
    }
    let (num_slots, d) = cache.dims2().map_err(|_| {
        candle_core::Error::Msg(format!("{op}: cache must be [num_slots, head_dim], got {:?}", cache.shape()))
    })?;
    let (t, rd) = rows.dims2().map_err(|_| {
        candle_core::Error::Msg(format!("{op}: rows must be [T, head_dim], got {:?}", rows.shape()))
    })?;
    if rd != d {
        candle_core::bail!("{op}: rows {:?} and cache {:?} differ in head_dim", rows.shape(), cache.shape())
    }
    for (name, x) in [("cos", cos), ("sin", sin)] {
        if x.dtype() != DType::F32 || x.rank() != 2 || x.dim(0)? != t {
            candle_core::bail!("{op}: {name} must be [T={t}, rope_dim/2] f32, got {:?} {:?}", x.dtype(), x.shape())
        }
    }
    if cos.dims() != sin.dims() {
        candle_core::bail!("{op}: cos {:?} and sin {:?} differ", cos.shape(), sin.shape())
    }
    let rope_dim = 2 * cos.dim(1)?;
    if rope_dim == 0 || rope_dim > d {
        candle_core::bail!("{op}: rope_dim {rope_dim} (from cos {:?}) must be in 2..={d}", cos.shape())
    }
    if slots.dtype() != DType::I64 || slots.dims() != [t] {
        candle_core::bail!("{op}: slots must be [T={t}] i64, got {:?} {:?}", slots.dtype(), slots.shape())
    }
    let block = kind.format().block();
    if fake_quant && d % block != 0 {
        candle_core::bail!("{op}: head_dim {d} is not a multiple of the {} block {block}", kind.format())
    }
    let norm = match norm {
        None => None,
        Some((w, eps)) => {
            if w.dims() != [d] {
                candle_core::bail!("{op}: norm weight must be [head_dim={d}], got {:?}", w.shape())
            }
            Some((w.to_dtype(DType::F32)?.contiguous()?, eps))
        }
    };
    let device = cache.device();
    for (name, x) in [("rows", rows), ("cos", cos), ("sin", sin), ("slots", slots)] {
        if !x.device().same_device(device) {
            candle_core::bail!("{op}: {name} is on {:?} but the cache is on {:?}", x.device(), device)
        }
    }
    if let Some((w, _)) = &norm {
        if !w.device().same_device(device) {
            candle_core::bail!("{op}: the norm weight is on {:?} but the cache is on {:?}", w.device(), device)
        }
    }
    let cache_stride = cache.stride();
    if cache_stride[1] != 1 || (num_slots > 1 && cache_stride[0] < d) {
        candle_core::bail!("{op}: cache rows must be dense and non-overlapping, got strides {cache_stride:?}")
    }
    if t == 0 {
        return Ok(());
    }
    if t > i32::MAX as usize {
        candle_core::bail!("{op}: {t} tokens exceed the kernel's i32 token count")
    }
    let mut rows = rows.clone();
    if device.is_cuda() {
        if ![64, 128, 256, 512].contains(&d) {
            candle_core::bail!("{op}: the CUDA kernel supports head_dim 64, 128, 256 or 512, got {d}")
        }
        let v = vector_elems(d);
        let cache_offset = cache.layout().start_offset();
        if cache_offset % v != 0 || cache_stride[0] % v != 0 {
            candle_core::bail!(
                "{op}: cache view (offset {cache_offset}, row stride {}) is not aligned to {v} elements",
                cache_stride[0]
            )
        }
        let rs = rows.stride();
        if rs[1] != 1 || rows.layout().start_offset() % v != 0 || rs[0] % v != 0 || rs[0] < d {
            rows = rows.contiguous()?;
            if rows.layout().start_offset() % v != 0 {
                rows = rows.copy()?;
            }
        }
    }
    let op = RowInsert {
        kind,
        fake_quant,
        cos: cos.contiguous()?,
        sin: sin.contiguous()?,
        slots: slots.contiguous()?,
        norm,
    };
    cache.inplace_op2(&rows, &op)
}

impl RowInsert {
    /// The CPU reference: the rows after norm, RoPE and fake quant (`[T, D]` bf16, on the CPU).
    fn reference_rows(&self, rows: &Tensor) -> Result<Tensor> {
        let x = match &self.norm {
            Some((w, eps)) => RmsNorm::from_weight(w.clone(), *eps)?.forward(rows)?,
            None => rows.clone(),
        };
        let x = apply_rope_tail(&x, &self.cos, &self.sin)?;
        if self.fake_quant {
            fake_quant(&x, self.kind.format())
        } else {
            Ok(x)
        }
    }
}

/// Storage offsets of the elements of `layout`, in logical (row-major) order.
pub(crate) fn layout_offsets(layout: &Layout) -> Vec<usize> {
    let mut out = vec![layout.start_offset()];
    for (&dim, &stride) in layout.dims().iter().zip(layout.stride()) {
        out = out.iter().flat_map(|&o| (0..dim).map(move |i| o + i * stride)).collect();
    }
    out
}

/// The elements of a CPU storage in the logical order of `layout`.
pub(crate) fn gather<T: WithDType>(storage: &CpuStorage, layout: &Layout, what: &str) -> Result<Vec<T>> {
    let v = storage.as_slice::<T>().map_err(|_| {
        candle_core::Error::Msg(format!("{what}: expected {:?} storage, got {:?}", T::DTYPE, storage.dtype()))
    })?;
    Ok(match layout.contiguous_offsets() {
        Some((a, b)) => v[a..b].to_vec(),
        None => layout_offsets(layout).into_iter().map(|i| v[i]).collect(),
    })
}

impl InplaceOp2 for RowInsert {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, src: &CpuStorage, sl: &Layout) -> Result<()> {
        let op = self.kind.name();
        let (t, d) = sl.shape().dims2()?;
        let x = Tensor::from_vec(gather::<bf16>(src, sl, op)?, (t, d), &Device::Cpu)?;
        let rows = self.reference_rows(&x)?.flatten_all()?.to_vec1::<bf16>()?;
        let slots = self.slots.to_vec1::<i64>()?;
        let num_slots = dl.shape().dims2()?.0 as i64;
        let mut seen = std::collections::HashSet::new();
        for &s in slots.iter().filter(|&&s| (0..num_slots).contains(&s)) {
            if !seen.insert(s) {
                candle_core::bail!("{op}: slot {s} is named by two tokens of one call (slots {slots:?})")
            }
        }
        let CpuStorage::BF16(cache) = dst else {
            candle_core::bail!("{op}: expected a bf16 cache, got {:?}", dst.dtype())
        };
        let (off, stride) = (dl.start_offset(), dl.stride()[0]);
        for (ti, &s) in slots.iter().enumerate() {
            if (0..num_slots).contains(&s) {
                let o = off + s as usize * stride;
                cache[o..o + d].copy_from_slice(&rows[ti * d..(ti + 1) * d]);
            }
        }
        Ok(())
    }

    fn cuda_fwd(&self, dst: &mut CudaStorage, dl: &Layout, src: &CudaStorage, sl: &Layout) -> Result<()> {
        let op = self.kind.name();
        let stream = stream_for(src)?;
        let (t, d) = sl.shape().dims2()?;
        let num_slots = dl.shape().dims2()?.0;

        let (cos_st, cos_l) = self.cos.storage_and_layout();
        let (cos, _cos_sync) = read_ptr::<f32>(as_cuda(&cos_st, "cos")?, cos_l, &stream)?;
        let (sin_st, sin_l) = self.sin.storage_and_layout();
        let (sin, _sin_sync) = read_ptr::<f32>(as_cuda(&sin_st, "sin")?, sin_l, &stream)?;
        let (slots_st, slots_l) = self.slots.storage_and_layout();
        let (slots, _slots_sync) = read_ptr::<i64>(as_cuda(&slots_st, "slots")?, slots_l, &stream)?;
        let norm_st = self.norm.as_ref().map(|(w, eps)| (w.storage_and_layout(), *eps));
        let (weight, eps, _w_sync) = match &norm_st {
            Some(((st, l), eps)) => {
                let (p, g) = read_ptr::<f32>(as_cuda(st, "norm weight")?, l, &stream)?;
                (p, *eps, Some(g))
            }
            None => (std::ptr::null(), 0.0, None),
        };
        let (src_ptr, _src_sync) = read_ptr::<bf16>(src, sl, &stream)?;
        let (cache, _cache_sync) = write_ptr::<bf16>(dst, dl, &stream)?;

        let params = ffi::RowInsertParams {
            src: src_ptr.cast(),
            cos,
            sin,
            slots,
            norm_weight: weight,
            cache: cache.cast(),
            src_row_stride: sl.stride()[0] as i64,
            cache_row_stride: dl.stride()[0] as i64,
            num_slots: num_slots as i64,
            num_tokens: t as i32,
            head_dim: d as i32,
            rope_dim: 2 * cos_l.dims()[1] as i32,
            quant: if self.fake_quant { self.kind.quant_code() } else { ffi::QUANT_NONE },
            apply_norm: self.norm.is_some() as i32,
            norm_eps: eps as f32,
            norm_inv_dim: (1.0 / d as f64) as f32,
            _pad: 0,
        };
        let launcher = match self.kind {
            InsertKind::Window => ffi::dsv41_window_insert,
            InsertKind::Compressed => ffi::dsv41_compressed_insert,
            InsertKind::IndexKey => ffi::dsv41_index_key_insert,
        };
        // SAFETY: every pointer comes from a live storage locked for this call (the cache with
        // its write lock), offsets and strides were checked against the kernels' contract in
        // `insert_rows`, and the kernel only writes rows [0, num_slots) of the cache view (see
        // the module docs). The guards keep the buffers' stream synchronization until the
        // launch is enqueued.
        let code = unsafe { launcher(&params, std::mem::size_of::<ffi::RowInsertParams>(), raw_stream(&stream)) };
        ffi::check_status(op, code)
    }
}
