//! [`SideWork`]: work off a step's critical path, on the device's side stream where it has one.

use candle_core::Result;

/// Work run off a step's critical path: on a CUDA decode device on its side stream
/// ([`crate::cuda::SideStream`]: the decode step's mHC mixes, the MoE's shared expert), elsewhere
/// (the CPU, other CUDA devices, builds without the `cuda` feature) in line.
pub(crate) struct SideWork {
    #[cfg(feature = "cuda")]
    side: Option<crate::cuda::SideStream>,
}

impl SideWork {
    /// The side work of `device` (in line where it has no side stream).
    pub(crate) fn new(_device: &candle_core::Device) -> Result<Self> {
        Ok(Self {
            #[cfg(feature = "cuda")]
            side: crate::cuda::SideStream::new(_device)?,
        })
    }

    /// Runs `f`, its branching launches on the side stream ([`crate::cuda::SideStream::run`]).
    pub(crate) fn run<T>(&mut self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        #[cfg(feature = "cuda")]
        if let Some(s) = self.side.as_mut() {
            return s.run(f);
        }
        f()
    }

    /// The device's stream waits for the side work ([`crate::cuda::SideStream::join`]).
    pub(crate) fn join(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(s) = self.side.as_mut() {
            s.join()?;
        }
        Ok(())
    }
}
