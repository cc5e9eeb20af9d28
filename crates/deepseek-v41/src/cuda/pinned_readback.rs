//! A page-locked host buffer for device → host reads that must not wait for the work queued
//! after them ([`crate::model::GraphedDecodeStep::step_next_ids`]: a step's sampled ids, read
//! while the next step runs). The copy is enqueued on the device's stream with an event recorded
//! after it; [`PinnedReadback::read`] waits for that event only, not for the stream. The memory is
//! allocated without write-combining (the host reads it).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, PinnedHostSlice};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Result, Tensor};

use super::device::{as_cuda, stream_for};

/// A reusable u32 readback buffer for one device (see the module doc).
pub(crate) struct PinnedReadback {
    dev: CudaDevice,
    buf: Option<PinnedHostSlice<u32>>,
    /// Recorded again after each enqueued copy (created with the first).
    event: Option<CudaEvent>,
    /// The values the last enqueued copy copies, until they are read.
    pending: Option<usize>,
}

impl std::fmt::Debug for PinnedReadback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedReadback").field("pending", &self.pending).finish_non_exhaustive()
    }
}

impl PinnedReadback {
    /// An empty buffer for `dev` (nothing allocated yet).
    pub(crate) fn new(dev: &CudaDevice) -> Self {
        Self { dev: dev.clone(), buf: None, event: None, pending: None }
    }

    /// Enqueues a copy of `src` (rank 1, u32, on this device) into the buffer, after the work
    /// already queued on the device's stream. A copy not yet read is replaced.
    pub(crate) fn enqueue(&mut self, src: &Tensor) -> Result<()> {
        let n = src.dims1()?;
        if src.dtype() != DType::U32 {
            candle_core::bail!("PinnedReadback: u32 values expected, got {:?}", src.dtype())
        }
        if self.pending.take().is_some() {
            if let Some(e) = &self.event {
                e.synchronize().w()?;
            }
        }
        if self.buf.as_ref().map_or(0, |b| b.len()) < n.max(1) {
            let ctx = self.dev.cuda_stream().context().clone();
            // SAFETY: the contents are uninitialized until a copy writes them; `read` returns only
            // the values the last copy wrote, after waiting for it.
            self.buf = Some(unsafe { ctx.alloc_pinned_with_flags::<u32>(n.max(1).next_power_of_two(), 0) }.w()?);
        }
        let Some(buf) = self.buf.as_mut() else { candle_core::bail!("PinnedReadback: no buffer") };
        let src = src.contiguous()?;
        let (s, l) = src.storage_and_layout();
        let cs = as_cuda(&s, "the values to read back")?;
        if !cs.device().same_device(&self.dev) {
            candle_core::bail!("PinnedReadback: the values are on another device")
        }
        let stream = stream_for(cs)?;
        let view = cs.as_cuda_slice::<u32>()?.slice(l.start_offset()..l.start_offset() + n);
        if n > 0 {
            stream.memcpy_dtoh(&view, buf).w()?;
        }
        match &self.event {
            Some(e) => e.record(&stream).w()?,
            None => self.event = Some(stream.record_event(None).w()?),
        }
        self.pending = Some(n);
        Ok(())
    }

    /// The values of the last enqueued copy, once it is done (empty when none was enqueued).
    pub(crate) fn read(&mut self) -> Result<Vec<u32>> {
        let (Some(n), Some(event)) = (self.pending.take(), &self.event) else { return Ok(Vec::new()) };
        event.synchronize().w()?;
        match &self.buf {
            Some(b) => Ok(b.as_slice().w()?[..n].to_vec()),
            None => Ok(Vec::new()),
        }
    }
}
