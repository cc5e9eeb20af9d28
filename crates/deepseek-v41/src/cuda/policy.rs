//! Which implementation the crate's dispatch takes for tensors on a CUDA device: the fused
//! kernels of [`crate::cuda`] (the default) or plain Candle ops — with a host round trip where
//! Candle has no op (fake quantization, top-k over long rows) — which is the baseline the
//! benchmarks compare the kernels against and a second opinion when debugging a kernel.
//!
//! The switch is per thread and scoped ([`with_plain_candle`]); nothing else changes: the same
//! modules, weights and caches serve both paths.

use std::cell::Cell;

use candle_core::Device;

thread_local! {
    static PLAIN: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the fused CUDA kernels switched off on this thread: the attention layer,
/// indexer, sparse attention, activation and cache fake quantization, and the decoder's small
/// ops (RMSNorm, mHC mixes / collapse / post, Engram gate, MoE SwiGLU and sum) then take their
/// plain Candle paths (the reference path of [`crate::attention::Attention::forward`]) on CUDA
/// tensors too. The previous setting is restored when `f` returns or unwinds.
pub fn with_plain_candle<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            PLAIN.set(self.0);
        }
    }
    let _restore = Restore(PLAIN.replace(true));
    f()
}

/// Whether an operation on tensors of `device` runs the fused CUDA kernels: `device` is a CUDA
/// device and [`with_plain_candle`] is not in effect on this thread.
pub fn fused_kernels(device: &Device) -> bool {
    device.is_cuda() && !PLAIN.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scoped_and_restored() {
        let cpu = Device::Cpu;
        assert!(!fused_kernels(&cpu));
        assert!(!PLAIN.get());
        with_plain_candle(|| {
            assert!(PLAIN.get());
            with_plain_candle(|| assert!(PLAIN.get()));
            assert!(PLAIN.get(), "the inner scope must restore the outer setting");
        });
        assert!(!PLAIN.get());
        let caught = std::panic::catch_unwind(|| with_plain_candle(|| panic!("unwinds")));
        assert!(caught.is_err());
        assert!(!PLAIN.get(), "an unwinding scope must restore the setting");
    }
}
