//! A second stream for work that is off a step's critical path (`docs/architecture.md`, "The
//! whole-model decode step"): the mHC mixes of a sublayer depend only on its input stream and are
//! needed only at its post, so they can run beside the attention or the MoE instead of before
//! them; the MoE's shared expert likewise beside the routing and the routed experts (joined before
//! the combine). Captured into a CUDA graph, the fork and the join become a parallel branch.
//!
//! [`SideStream::run`] makes the launchers that take a side stream ([`super::mhc_mixes_device`],
//! the FP8 linears' [`super::fp8_linear_with`], [`super::swiglu_device`]) enqueue on it: each first makes the side stream wait for everything enqueued so far on the
//! device's stream (its inputs and its freshly allocated outputs included), then launches there.
//! [`SideStream::join`] makes the device's stream wait for the side stream; the caller joins
//! before it reads the outputs. Candle frees on the device's stream, where a later allocation
//! could reuse the memory while a side kernel still reads it, so a launcher that branches hands
//! the side stream what its kernel reads ([`side_keep`]: its input tensors, its scratch), which
//! the join releases — after the device's stream has waited for the side stream. Inside `run`
//! everything else (Candle ops) stays on the device's stream: a closure may feed side kernels
//! from it, but reads side outputs only after the join. Only on devices without per-buffer
//! event tracking ([`super::decode_device`]): there every buffer is ordered by this protocol
//! alone. Elsewhere [`SideStream::new`] gives `None` and the work stays on the device's stream.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::DeviceId;
use candle_core::{Device, Result};

use candle_core::cuda_backend::WrapErr;

/// The state of a [`SideStream::run`] on this thread: the side stream, whether a launcher used
/// it, and what its kernels read (kept until the join).
struct Active {
    side: Arc<CudaStream>,
    launched: bool,
    kept: Vec<Box<dyn Any>>,
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

/// A device's side stream: created once per device (outside any capture: the decode step runs
/// eagerly before it is captured) and kept for the process, so captured graphs stay valid.
pub struct SideStream {
    main: Arc<CudaStream>,
    side: Arc<CudaStream>,
    pending: bool,
    kept: Vec<Box<dyn Any>>,
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
        Ok(Some(Self { main, side, pending: false, kept: Vec::new() }))
    }

    /// Runs `f` with the side-stream launchers enqueueing on the side stream (other work in `f`
    /// stays on the device's stream, ordered as usual).
    pub fn run<T>(&mut self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let outer = ACTIVE.with(|a| a.borrow_mut().replace(Active { side: self.side.clone(), launched: false, kept: Vec::new() }));
        let out = f();
        let mine = ACTIVE.with(|a| std::mem::replace(&mut *a.borrow_mut(), outer));
        if let Some(m) = mine {
            self.pending |= m.launched;
            self.kept.extend(m.kept);
        }
        out
    }

    /// The device's stream waits for the side stream's work (nothing to do when none was
    /// launched since the last join); then what the side kernels read is released.
    pub fn join(&mut self) -> Result<()> {
        if self.pending {
            self.main.join(&self.side).w()?;
            self.pending = false;
        }
        self.kept.clear();
        Ok(())
    }
}

impl Drop for SideStream {
    /// A side stream dropped without its join (an error in between): the device's stream still
    /// waits for it before anything it kept is freed.
    fn drop(&mut self) {
        if self.pending {
            let _ = self.main.join(&self.side);
        }
    }
}

/// Inside [`SideStream::run`], after a launch on the side stream: keeps `what` (a clone of an
/// input tensor, a scratch buffer) alive until the join. Elsewhere it is dropped at once.
pub(crate) fn side_keep(what: Box<dyn Any>) {
    ACTIVE.with(|a| {
        if let Some(a) = a.borrow_mut().as_mut() {
            a.kept.push(what);
        }
    });
}

/// Inside [`SideStream::run`]: the side stream, made to wait for `main`'s work so far (a launcher
/// calls this after allocating its outputs and scratch, right before its launch, and then hands
/// what the kernel reads to [`side_keep`]). `None` elsewhere.
pub(crate) fn side_launch_stream(main: &Arc<CudaStream>) -> Result<Option<Arc<CudaStream>>> {
    ACTIVE.with(|a| -> Result<Option<Arc<CudaStream>>> {
        let mut a = a.borrow_mut();
        let Some(act) = a.as_mut() else { return Ok(None) };
        if !Arc::ptr_eq(act.side.context(), main.context()) {
            return Ok(None);
        }
        act.side.join(main).w()?;
        act.launched = true;
        Ok(Some(act.side.clone()))
    })
}
