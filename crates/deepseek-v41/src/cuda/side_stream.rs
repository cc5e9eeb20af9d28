//! A second stream for work that is off a step's critical path (`docs/architecture.md`, "The
//! whole-model decode step"): the mHC mixes of a sublayer depend only on its input stream and are
//! needed only at its post, so they can run beside the attention or the MoE instead of before
//! them. Captured into a CUDA graph, the fork and the join become a parallel branch.
//!
//! [`SideStream::run`] makes the launchers that take a side stream ([`super::mhc_mixes_device`])
//! enqueue on it: each first makes the side stream wait for everything enqueued so far on the
//! device's stream (its inputs and its freshly allocated outputs included), then launches there.
//! [`SideStream::join`] makes the device's stream wait for the side stream; the caller joins
//! before it reads the outputs, and keeps the inputs alive until then (the decode step's posts
//! read the same stream the mixes read, after the join). A launcher branches only when it
//! frees nothing the side kernel reads before the join (no temporary copies, no scratch):
//! candle frees on the device's stream, where a later allocation could reuse the memory while
//! the side kernel still reads it. Only on devices without per-buffer
//! event tracking ([`super::decode_device`]): there every buffer is ordered by this protocol
//! alone. Elsewhere [`SideStream::new`] gives `None` and the work stays on the device's stream.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::DeviceId;
use candle_core::{Device, Result};

use candle_core::cuda_backend::WrapErr;

thread_local! {
    /// The side stream the launchers enqueue on inside [`SideStream::run`], and whether they did.
    static ACTIVE: RefCell<Option<(Arc<CudaStream>, bool)>> = const { RefCell::new(None) };
}

/// A device's side stream: created once per device (outside any capture: the decode step runs
/// eagerly before it is captured) and kept for the process, so captured graphs stay valid.
pub struct SideStream {
    main: Arc<CudaStream>,
    side: Arc<CudaStream>,
    pending: bool,
}

impl SideStream {
    /// The side stream of `device`, or `None` where there is none to use: not CUDA, a device
    /// with per-buffer event tracking (the default candle devices), or `DSV41_UNFUSE=side_stream`.
    pub fn new(device: &Device) -> Result<Option<Self>> {
        let Device::Cuda(cuda) = device else { return Ok(None) };
        let main = cuda.cuda_stream();
        if main.context().is_event_tracking() || super::policy::unfused("side_stream") {
            return Ok(None);
        }
        static SIDES: OnceLock<Mutex<HashMap<DeviceId, Arc<CudaStream>>>> = OnceLock::new();
        let mut sides = SIDES.get_or_init(Default::default).lock().map_err(|_| candle_core::Error::Msg("side stream: the lock is poisoned".into()))?;
        let side = match sides.get(&cuda.id()) {
            Some(s) => s.clone(),
            None => {
                let s = main.context().new_stream().w()?;
                sides.insert(cuda.id(), s.clone());
                s
            }
        };
        Ok(Some(Self { main, side, pending: false }))
    }

    /// Runs `f` with the side-stream launchers enqueueing on the side stream (other work in `f`
    /// stays on the device's stream, ordered as usual).
    pub fn run<T>(&mut self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        ACTIVE.with(|a| *a.borrow_mut() = Some((self.side.clone(), false)));
        let out = f();
        let launched = ACTIVE.with(|a| a.borrow_mut().take().is_some_and(|(_, l)| l));
        self.pending |= launched;
        out
    }

    /// The device's stream waits for the side stream's work (nothing to do when none was
    /// launched since the last join).
    pub fn join(&mut self) -> Result<()> {
        if self.pending {
            self.main.join(&self.side).w()?;
            self.pending = false;
        }
        Ok(())
    }
}

/// Inside [`SideStream::run`]: the side stream, made to wait for `main`'s work so far (a launcher
/// calls this after allocating its outputs, right before its launch). `None` elsewhere.
pub(crate) fn side_launch_stream(main: &Arc<CudaStream>) -> Result<Option<Arc<CudaStream>>> {
    ACTIVE.with(|a| -> Result<Option<Arc<CudaStream>>> {
        let mut a = a.borrow_mut();
        let Some((side, launched)) = a.as_mut() else { return Ok(None) };
        if !Arc::ptr_eq(side.context(), main.context()) {
            return Ok(None);
        }
        side.join(main).w()?;
        *launched = true;
        Ok(Some(side.clone()))
    })
}
