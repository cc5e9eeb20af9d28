//! The inputs shared by the cache-insert ops (bf16 rows in [`super::insert_op`], packed rows in
//! [`super::packed_insert`]): the source rows, the per-token `cos`/`sin` and `slots`, and the
//! optional RMSNorm. Checking them, the CPU reference of the row pipeline, and locking them for
//! a kernel launch live here once.
//!
//! # Locking
//!
//! Candle's in-place ops lock at most three tensors (the destination and two sources), so an
//! insert passes only the rows through candle (which rejects rows sharing the cache's storage)
//! and the op holds the other inputs and read-locks them itself ([`RowInputs::lock`]). Their
//! dtypes (f32, i64) differ from every cache dtype (bf16, u8), so they never share the cache's
//! storage and its write lock is never requested twice on one thread. These read locks are
//! plain (not recursive): should two of these inputs share a storage (say `cos` and `sin` as row
//! ranges of one tensor), a concurrent writer of that storage on another thread could block the
//! second read lock; no code writes such tensors while they are being read.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, SyncOnDrop};
use candle_core::{CpuStorage, DType, Device, Layout, Module, Result, StorageRef, Tensor, WithDType};

use super::device::{as_cuda, read_ptr};
use crate::nn::rms_norm::RmsNorm;
use crate::nn::rope::apply_rope_tail;
use crate::quant::fake_quant::{fake_quant, QatFormat};

/// Head dims the CUDA row kernels are instantiated for.
pub(crate) const CUDA_HEAD_DIMS: [usize; 4] = [64, 128, 256, 512];

/// Vector width (in bf16 elements) the kernels use for a row of `d` elements.
pub(crate) fn vector_elems(d: usize) -> usize {
    (d / 32).clamp(1, 8)
}

/// Elements between consecutive rows of a `[rows, d]` layout; a single row has no stride of
/// its own, so it reports `d` (any stride is valid for it).
pub(crate) fn row_stride(layout: &Layout, d: usize) -> usize {
    if layout.dims()[0] <= 1 {
        d
    } else {
        layout.stride()[0]
    }
}

/// Checked per-token inputs of an insert (contiguous, on the cache's device).
pub(crate) struct RowInputs {
    /// `[T, R/2]` f32.
    pub cos: Tensor,
    /// `[T, R/2]` f32.
    pub sin: Tensor,
    /// `[T]` i64.
    pub slots: Tensor,
    /// RMSNorm weight `[D]` f32 and eps.
    pub norm: Option<(Tensor, f64)>,
}

impl RowInputs {
    /// Checks `rows` (`[T, d]` bf16) and the per-token inputs against `device`, and returns the
    /// inputs together with the rows, re-laid out if the CUDA kernels cannot read them as they
    /// are (rows must be dense and vector-aligned there). Errors name `op` and the argument.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check(
        op: &str,
        d: usize,
        device: &Device,
        rows: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        slots: &Tensor,
        norm: Option<(&Tensor, f64)>,
    ) -> Result<(Self, Tensor)> {
        if rows.dtype() != DType::BF16 || rows.rank() != 2 || rows.dim(1)? != d {
            candle_core::bail!("{op}: rows must be [T, head_dim={d}] bf16, got {:?} {:?}", rows.dtype(), rows.shape())
        }
        let t = rows.dim(0)?;
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
        if t > i32::MAX as usize {
            candle_core::bail!("{op}: {t} tokens exceed the kernel's i32 token count")
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
        let named = [("rows", rows), ("cos", cos), ("sin", sin), ("slots", slots)];
        for (name, x) in named.into_iter().chain(norm.as_ref().map(|(w, _)| ("norm weight", w))) {
            if !x.device().same_device(device) {
                candle_core::bail!("{op}: {name} is on {:?} but the cache is on {:?}", x.device(), device)
            }
        }
        let mut rows = rows.clone();
        if device.is_cuda() {
            if !CUDA_HEAD_DIMS.contains(&d) {
                candle_core::bail!("{op}: the CUDA kernel supports head_dim 64, 128, 256 or 512, got {d}")
            }
            let v = vector_elems(d);
            let (rs, stride) = (rows.stride(), row_stride(rows.layout(), d));
            if rs[1] != 1 || !rows.layout().start_offset().is_multiple_of(v) || !stride.is_multiple_of(v) || stride < d
            {
                rows = rows.contiguous()?;
                if !rows.layout().start_offset().is_multiple_of(v) {
                    rows = rows.copy()?;
                }
            }
        }
        let inputs = Self { cos: cos.contiguous()?, sin: sin.contiguous()?, slots: slots.contiguous()?, norm };
        Ok((inputs, rows))
    }

    /// `R`, the number of rotated dims.
    pub(crate) fn rope_dim(&self) -> Result<usize> {
        Ok(2 * self.cos.dim(1)?)
    }

    /// The CPU reference of the row pipeline on `rows` (`[T, D]` bf16, CPU): the crate's
    /// [`RmsNorm`] (if any), [`apply_rope_tail`], then [`fake_quant`] in `quant` (if any).
    pub(crate) fn reference_rows(&self, rows: &Tensor, quant: Option<QatFormat>) -> Result<Tensor> {
        let x = match &self.norm {
            Some((w, eps)) => RmsNorm::from_weight(w.clone(), *eps)?.forward(rows)?,
            None => rows.clone(),
        };
        let x = apply_rope_tail(&x, &self.cos, &self.sin)?;
        match quant {
            Some(fmt) => fake_quant(&x, fmt),
            None => Ok(x),
        }
    }

    /// The slots as host values, rejecting duplicates among those in `[0, num_slots)` (the CPU
    /// path's check of the kernels' uniqueness precondition).
    pub(crate) fn host_slots(&self, op: &str, num_slots: usize) -> Result<Vec<i64>> {
        let slots = self.slots.to_vec1::<i64>()?;
        let mut seen = std::collections::HashSet::new();
        for &s in slots.iter().filter(|&&s| s >= 0 && (s as u64) < num_slots as u64) {
            if !seen.insert(s) {
                candle_core::bail!("{op}: slot {s} is named by two tokens of one call")
            }
        }
        Ok(slots)
    }

    /// Read-locks the inputs' storages for a kernel launch.
    pub(crate) fn lock(&self) -> Locked<'_> {
        Locked {
            cos: self.cos.storage_and_layout(),
            sin: self.sin.storage_and_layout(),
            slots: self.slots.storage_and_layout(),
            norm: self.norm.as_ref().map(|(w, eps)| (w.storage_and_layout(), *eps)),
        }
    }
}

/// The inputs' storages, read-locked.
pub(crate) struct Locked<'a> {
    cos: (StorageRef<'a>, &'a Layout),
    sin: (StorageRef<'a>, &'a Layout),
    slots: (StorageRef<'a>, &'a Layout),
    norm: Option<((StorageRef<'a>, &'a Layout), f64)>,
}

/// Device pointers of the locked inputs, valid while the guards live (drop after the launch).
pub(crate) struct Pointers<'a> {
    pub cos: *const f32,
    pub sin: *const f32,
    pub slots: *const i64,
    /// Null without a norm.
    pub norm_weight: *const f32,
    pub norm_eps: f64,
    _sync: Vec<SyncOnDrop<'a>>,
}

impl Locked<'_> {
    /// Device pointers of the inputs on `stream` (cudarc orders the stream after pending writes
    /// of each buffer and records the use when the guards drop).
    pub(crate) fn pointers<'b>(&'b self, stream: &'b CudaStream) -> Result<Pointers<'b>> {
        let mut sync = Vec::with_capacity(4);
        let (cos, g) = read_ptr::<f32>(as_cuda(&self.cos.0, "cos")?, self.cos.1, stream)?;
        sync.push(g);
        let (sin, g) = read_ptr::<f32>(as_cuda(&self.sin.0, "sin")?, self.sin.1, stream)?;
        sync.push(g);
        let (slots, g) = read_ptr::<i64>(as_cuda(&self.slots.0, "slots")?, self.slots.1, stream)?;
        sync.push(g);
        let (norm_weight, norm_eps) = match &self.norm {
            Some(((st, l), eps)) => {
                let (p, g) = read_ptr::<f32>(as_cuda(st, "norm weight")?, l, stream)?;
                sync.push(g);
                (p, *eps)
            }
            None => (std::ptr::null(), 0.0),
        };
        Ok(Pointers { cos, sin, slots, norm_weight, norm_eps, _sync: sync })
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

/// The rows of a source storage as a CPU tensor `[T, D]` bf16.
pub(crate) fn cpu_rows(src: &CpuStorage, layout: &Layout, what: &str) -> Result<Tensor> {
    Tensor::from_vec(gather::<half::bf16>(src, layout, what)?, layout.shape(), &Device::Cpu)
}
