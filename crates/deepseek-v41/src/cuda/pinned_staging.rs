//! A page-locked host staging buffer for host → device copies that recur every step (the host
//! Engram tables' rows, `model::engram_host`; the decode step's integer rows, `crate::host_upload`):
//! filled on the host, copied to a fresh device buffer or into an existing tensor with one
//! asynchronous copy on the device's stream, reused by the next call.
//!
//! Page-locked (pinned) memory comes from cudarc (`CudaContext::alloc_pinned`, `cuMemHostAlloc`
//! with `CU_MEMHOSTALLOC_WRITECOMBINED`: fast for the host to write and the DMA engine to read;
//! never read back on the host here). A copy from pinned memory is a true asynchronous DMA, so the
//! buffer must not be refilled before the copy has read it: each copy records an event on the
//! stream and the next fill waits for it. (cudarc's own per-buffer events are not relied upon:
//! `cuda::decode_device` switches them off.)

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{result, CudaEvent, PinnedHostSlice};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaDevice, CudaStorage, DType, Device, InplaceOp1, Layout, Result, Tensor};

use super::device::{cuda_tensor, stream_for, write_ptr};

/// A reusable page-locked staging buffer for one device (see the module doc).
pub(crate) struct PinnedStaging {
    dev: CudaDevice,
    buf: Option<PinnedHostSlice<u8>>,
    /// Recorded after the last copy out of `buf`.
    copied: Option<CudaEvent>,
}

impl PinnedStaging {
    /// An empty buffer for `dev` (nothing allocated yet).
    pub(crate) fn new(dev: &CudaDevice) -> Self {
        Self { dev: dev.clone(), buf: None, copied: None }
    }

    /// The bytes allocated.
    pub(crate) fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    /// Waits until the last copy out of the buffer has read it.
    fn wait(&self) -> Result<()> {
        match &self.copied {
            Some(e) => e.synchronize().w(),
            None => Ok(()),
        }
    }

    /// Makes the buffer hold at least `len` bytes, growing it to the next power of two (so that a
    /// run of calls of similar sizes allocates once). Errors when page-locked memory cannot be
    /// allocated; the caller may then stage in pageable memory.
    pub(crate) fn reserve(&mut self, len: usize) -> Result<()> {
        if self.capacity() >= len {
            return Ok(());
        }
        self.wait()?;
        self.buf = None;
        let cap = len.checked_next_power_of_two().unwrap_or(len);
        let ctx = self.dev.cuda_stream().context().clone();
        // SAFETY: the buffer's contents are uninitialized; `fill` writes the bytes `copy` copies
        // (`fill` gets exactly the `len` bytes that go to the device) and nothing else reads it.
        self.buf = Some(unsafe { ctx.alloc_pinned::<u8>(cap) }.w()?);
        Ok(())
    }

    /// Grows the buffer to `len` bytes, waits until the previous copy has read it and fills the
    /// first `len` bytes with `fill`. Runs on any
    /// thread (e.g. a gather ahead of the step that uses the rows: `model::engram_host`).
    pub(crate) fn fill(&mut self, len: usize, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<()> {
        self.reserve(len)?;
        self.wait()?;
        let Some(buf) = self.buf.as_mut() else { candle_core::bail!("pinned staging: no buffer after reserving {len} bytes") };
        fill(&mut buf.as_mut_slice().w()?[..len])
    }

    /// The first `len` bytes, as filled by [`PinnedStaging::fill`], copied into a fresh `[len]` u8
    /// tensor on the device: one asynchronous copy on the device's stream, ordered before every
    /// later op on it.
    pub(crate) fn copy(&mut self, len: usize) -> Result<Tensor> {
        let Some(buf) = self.buf.as_ref() else { candle_core::bail!("pinned staging: copy of {len} bytes before any fill") };
        if buf.len() < len {
            candle_core::bail!("pinned staging: copy of {len} bytes from a buffer of {}", buf.len())
        }
        let host = &buf.as_slice().w()?[..len];
        // SAFETY: uninitialized device memory, fully written by the copy below before any read.
        let mut dst = unsafe { self.dev.alloc::<u8>(len) }?;
        // A `[u8]` source: cudarc adds no stream synchronization; the driver sees page-locked
        // memory and runs an asynchronous DMA, which `copied` tracks.
        self.dev.memcpy_htod(host, &mut dst)?;
        let stream = self.dev.cuda_stream();
        match &self.copied {
            Some(e) => e.record(&stream).w()?,
            None => self.copied = Some(stream.record_event(None).w()?),
        }
        Ok(cuda_tensor(CudaStorage::wrap_cuda_slice(dst, self.dev.clone()), len))
    }

    /// The first `len` bytes, as filled by [`PinnedStaging::fill`], copied into the contiguous
    /// tensor `dst` (u32 or i64, at least `len` bytes) from its first element: one asynchronous
    /// copy on the device's stream into the existing buffer (no allocation, no device-side copy).
    pub(crate) fn copy_into(&mut self, dst: &Tensor, len: usize) -> Result<()> {
        let Some(buf) = self.buf.as_ref() else { candle_core::bail!("pinned staging: copy of {len} bytes before any fill") };
        if buf.len() < len {
            candle_core::bail!("pinned staging: copy of {len} bytes from a buffer of {}", buf.len())
        }
        if !dst.device().same_device(&Device::Cuda(self.dev.clone())) {
            candle_core::bail!("pinned staging: the destination is on {:?}, the staging buffer is for another device", dst.device())
        }
        dst.inplace_op1(&CopyIn { src: &buf.as_slice().w()?[..len] })?;
        let stream = self.dev.cuda_stream();
        match &self.copied {
            Some(e) => e.record(&stream).w()?,
            None => self.copied = Some(stream.record_event(None).w()?),
        }
        Ok(())
    }
}

/// The host → device copy of [`PinnedStaging::copy_into`] as an in-place op on the destination.
struct CopyIn<'a> {
    src: &'a [u8],
}

impl InplaceOp1 for CopyIn<'_> {
    fn name(&self) -> &'static str {
        "pinned_copy_in"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("pinned staging: the destination must be on a CUDA device")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        let bytes = l.shape().elem_count() * s.dtype().size_in_bytes();
        if !l.is_contiguous() || bytes < self.src.len() {
            candle_core::bail!("pinned staging: a copy of {} bytes into a {:?} tensor of {bytes} bytes (contiguous: {})", self.src.len(), l.shape(), l.is_contiguous())
        }
        let stream = stream_for(s)?;
        let (dst, _guard) = match s.dtype() {
            DType::U32 => write_ptr::<u32>(s, l, &stream).map(|(p, g)| (p as u64, g))?,
            DType::I64 => write_ptr::<i64>(s, l, &stream).map(|(p, g)| (p as u64, g))?,
            other => candle_core::bail!("pinned staging: a copy into a {other:?} tensor (u32 or i64 expected)"),
        };
        // SAFETY: `dst` points at ≥ src.len() bytes of the destination (checked above), valid
        // until the guard records the copy on the stream; the source is page-locked memory that
        // the staging buffer keeps until the event recorded after this copy has passed.
        unsafe { result::memcpy_htod_async(dst, self.src, stream.cu_stream()) }.w()
    }
}

impl Drop for PinnedStaging {
    /// The buffer is freed only after the last copy out of it has read it.
    fn drop(&mut self) {
        let _ = self.wait();
    }
}
