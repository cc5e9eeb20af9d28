//! Which implementation the crate's dispatch takes for tensors on a CUDA device: the fused
//! kernels of [`crate::cuda`] (the default) or plain Candle ops — with a host round trip where
//! Candle has no op (fake quantization, top-k over long rows) — which is the baseline the
//! benchmarks compare the kernels against and a second opinion when debugging a kernel.
//!
//! The switch is per thread and scoped ([`with_plain_candle`]); nothing else changes: the same
//! modules, weights and caches serve both paths.
//!
//! A second scoped switch, [`with_device_routing`], opts in to the MoE routing decision on the
//! device (`moe_route_device` in `model::Gate::route`); off by default, because its softplus can
//! differ from the host's libm by an ulp (`kernels/moe_route.cu`), which decides near-ties.

use std::cell::Cell;

use candle_core::Device;

thread_local! {
    static PLAIN: Cell<bool> = const { Cell::new(false) };
    static DEVICE_ROUTING: Cell<bool> = const { Cell::new(false) };
}

/// Sets `cell` to `on` for the duration of `f`, restoring the previous value when `f` returns or
/// unwinds.
fn scoped<R>(cell: &'static std::thread::LocalKey<Cell<bool>>, on: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(&'static std::thread::LocalKey<Cell<bool>>, bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            self.0.set(self.1);
        }
    }
    let _restore = Restore(cell, cell.replace(on));
    f()
}

/// Runs `f` with the fused CUDA kernels switched off on this thread: the attention layer,
/// indexer, sparse attention, activation and cache fake quantization, and the decoder's small
/// ops (RMSNorm, mHC mixes / collapse / post, Engram gate, MoE SwiGLU and sum) then take their
/// plain Candle paths (the reference path of [`crate::attention::Attention::forward`]) on CUDA
/// tensors too. The previous setting is restored when `f` returns or unwinds.
pub fn with_plain_candle<R>(f: impl FnOnce() -> R) -> R {
    scoped(&PLAIN, true, f)
}

/// Runs `f` with the MoE routing decision made on the device on this thread: `model::Gate::route`
/// of CUDA tensors then calls [`crate::cuda::moe_route_device`] and reads back the `[T, k]` ids
/// and weights instead of the `[T, E]` router logits. Inside [`with_plain_candle`] the host
/// routing is kept. The previous setting is restored when `f` returns or unwinds.
pub fn with_device_routing<R>(f: impl FnOnce() -> R) -> R {
    scoped(&DEVICE_ROUTING, true, f)
}

/// Whether `model::Gate::route` on tensors of `device` makes its decision on the device:
/// [`fused_kernels`] holds and [`with_device_routing`] is in effect on this thread.
pub fn device_routing(device: &Device) -> bool {
    fused_kernels(device) && DEVICE_ROUTING.get()
}

/// Whether an operation on tensors of `device` runs the fused CUDA kernels: `device` is a CUDA
/// device and [`with_plain_candle`] is not in effect on this thread.
pub fn fused_kernels(device: &Device) -> bool {
    device.is_cuda() && !PLAIN.get()
}

/// The kernels a diagnosis can switch off one by one, by name, in the environment variable
/// `DSV41_UNFUSE` (comma-separated, read once per process): each named op then takes the path it
/// took before its kernel existed (a second opinion when a result moves): `sparse_small` (the
/// sparse attention of head dims below 512: Candle ops), `mhc_mixes` (rsqrt, cuBLAS product,
/// split), `f32_linear` (cast + cuBLAS), `scale_round` and `group_diagonal` (Candle ops, the
/// same bits), `fp8_fused` (the FP8 linears' prep launch, the shared expert's shared
/// quantization), `mhc_post` (Candle ops with cuBLAS's comb product), `mhc_norm` (the collapse
/// and the norm after it, with the post before them, as separate launches; the same bits),
/// `side_stream` (the decode step's mHC mixes in line on the device's stream; the same bits),
/// `stacked` (`wq_a` and `wkv` as two FP8 launches instead of one over their stacked weight,
/// `nn::LinearPair`).
pub const UNFUSE_NAMES: [&str; 10] =
    ["sparse_small", "mhc_mixes", "f32_linear", "scale_round", "group_diagonal", "fp8_fused", "mhc_post", "mhc_norm", "side_stream", "stacked"];

/// Whether `name` (one of [`UNFUSE_NAMES`]) is switched off by `DSV41_UNFUSE`.
pub fn unfused(name: &str) -> bool {
    static SET: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    SET.get_or_init(|| std::env::var("DSV41_UNFUSE").map(|v| v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()).unwrap_or_default())
        .iter()
        .any(|s| s == name)
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

    #[test]
    fn device_routing_is_scoped_and_needs_a_cuda_device() {
        assert!(!DEVICE_ROUTING.get());
        with_device_routing(|| {
            assert!(DEVICE_ROUTING.get());
            assert!(!device_routing(&Device::Cpu), "host tensors are always routed on the host");
        });
        assert!(!DEVICE_ROUTING.get());
    }
}
