//! The f32-weight linears at decode sizes on the GPU (`kernels/f32_linear.cu`): `y = f32(x)·Wᵀ`
//! for up to [`F32_LINEAR_MAX_M`] rows of bf16 or f32 input in one launch, instead of a cast of
//! `x` and a cuBLAS product (one to three kernels). `nn::Linear` calls it for its
//! [`crate::nn::LinearKind::F32`] weights on CUDA (the MoE router, the compressor's `wkv` and
//! `wgate`, the output head); the CPU reference is the dense product of `nn::Linear`
//! ([`f32_linear_ref`]).
//!
//! Numerics: f32 products summed in the kernel's order (not cuBLAS's, not the CPU's), within the
//! golden tolerance of the reference; a row's result does not depend on the other rows.

use std::ffi::c_void;

use candle_core::{DType, Result, Tensor};

use super::device::{as_cuda, cuda_tensor, float_read_ptr, raw_stream, read_ptr, stream_for};
use super::ffi::check_status;

/// Most rows the kernel takes (`DSV41_F32_LINEAR_MAX_M`).
pub const F32_LINEAR_MAX_M: usize = 16;

/// `Dsv41F32LinearParams` of `kernels/include/dsv41_f32_linear.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct F32LinearParams {
    x: *const c_void,
    w: *const f32,
    y: *mut f32,
    n: i64,
    k: i64,
    x_stride: i64,
    m: i32,
    x_f32: i32,
}

extern "C" {
    fn dsv41_f32_linear(p: *const F32LinearParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// Whether [`f32_linear_device`] takes `x` `[m, k]` and `w` `[n, k]`: both on one CUDA device, `x`
/// bf16 or f32 with `1 ≤ m ≤` [`F32_LINEAR_MAX_M`], `w` f32.
pub fn f32_linear_supported(x: &Tensor, w: &Tensor) -> bool {
    let (Ok((m, k)), Ok((n, wk))) = (x.dims2(), w.dims2()) else { return false };
    x.device().is_cuda()
        && w.device().same_device(x.device())
        && matches!(x.dtype(), DType::BF16 | DType::F32)
        && w.dtype() == DType::F32
        && (1..=F32_LINEAR_MAX_M).contains(&m)
        && k == wk
        && k >= 1
        && n >= 1
}

/// `f32(x)·wᵀ` `[m, n]` f32 of `x` `[m, k]` (bf16 or f32, `m ≤` [`F32_LINEAR_MAX_M`]) and `w`
/// `[n, k]` f32 on one CUDA device, in one launch.
pub fn f32_linear_device(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let op = "f32_linear_device";
    if !f32_linear_supported(x, w) {
        candle_core::bail!(
            "{op}: x must be [m <= {F32_LINEAR_MAX_M}, k] bf16 or f32 and w [n, k] f32 on one CUDA device, got x {:?} {:?} on {:?}, w {:?} {:?} on {:?}",
            x.dtype(),
            x.shape(),
            x.device(),
            w.dtype(),
            w.shape(),
            w.device()
        )
    }
    let ((m, k), n) = (x.dims2()?, w.dim(0)?);
    let (xc, wc) = (x.contiguous()?, w.contiguous()?);
    let (xs, xl) = xc.storage_and_layout();
    let (ws, wl) = wc.storage_and_layout();
    let (xcu, wcu) = (as_cuda(&xs, "x")?, as_cuda(&ws, "w")?);
    let stream = stream_for(xcu)?;
    let dev = xcu.device.clone();
    // SAFETY: the kernel writes every element of the output.
    let mut y = unsafe { dev.alloc::<f32>(m * n)? };
    {
        let is_f32 = x.dtype() == DType::F32;
        let (x_p, _g0) = float_read_ptr(xcu, xl, is_f32, &stream)?;
        let (w_p, _g1) = read_ptr::<f32>(wcu, wl, &stream)?;
        let (y_p, _g2) = candle_core::cuda_backend::cudarc::driver::DevicePtrMut::device_ptr_mut(&mut y, &stream);
        let params = F32LinearParams { x: x_p, w: w_p, y: y_p as *mut f32, n: n as i64, k: k as i64, x_stride: k as i64, m: m as i32, x_f32: is_f32 as i32 };
        // SAFETY: x and w are read-locked, contiguous, of the checked shapes and dtypes; y holds
        // m·n f32; the launcher checks counts and pointers.
        let code = unsafe { dsv41_f32_linear(&params, std::mem::size_of::<F32LinearParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop((xs, ws));
    Ok(cuda_tensor(candle_core::CudaStorage::wrap_cuda_slice(y, dev), (m, n)))
}

/// The reference of [`f32_linear_device`] on any device: `x` cast to f32 times `wᵀ` (Candle's
/// matmul; on the CPU the dense product of `nn::Linear`).
pub fn f32_linear_ref(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.to_dtype(DType::F32)?.matmul(&w.to_dtype(DType::F32)?.t()?)
}
