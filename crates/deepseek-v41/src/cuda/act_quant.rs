//! Blockwise fake quantization of a dense activation on the GPU (`kernels/act_quant.cu`): the
//! FP8 activation quantization of every FP8/FP4-weight linear's input (spec §0.1b.8) and the
//! other QAT fake quants computed outside a fused insert (spec §2.3).
//!
//! [`crate::quant::fake_quant()`] and [`crate::quant::fp8_activation_quant`] call this for
//! tensors on a CUDA device; on the CPU this function is the crate's host reference itself. The
//! kernel reproduces the host reference bit for bit (`tests/cuda_layer.rs`).

use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Result, Storage, Tensor, D};
use half::bf16;

use super::device::{as_cuda, raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi;
use super::insert_op::quant_code;
use crate::quant::fake_quant::{fake_quant_host, QatFormat};

/// Fake-quantizes `x` (`[..., K]` bf16 or f32, K a multiple of `fmt.block()`) per block of the
/// last dim with `fmt`; returns the dequantized values `[..., K]` in `x`'s dtype on `x`'s device.
///
/// On CUDA one kernel launch (bit for bit equal to the host reference); on the CPU (and for
/// other float dtypes) the host reference [`crate::quant::fake_quant()`] computes it.
pub fn fake_quant_device(x: &Tensor, fmt: QatFormat) -> Result<Tensor> {
    let op = "fake_quant_device";
    if !x.device().is_cuda() || !matches!(x.dtype(), DType::BF16 | DType::F32) || x.rank() == 0 {
        return fake_quant_host(x, fmt);
    }
    let k = x.dim(D::Minus1)?;
    if !k.is_multiple_of(fmt.block()) {
        candle_core::bail!("{op} {fmt}: last dim {k} of shape {:?} is not a multiple of the block {}", x.shape(), fmt.block())
    }
    let x = x.contiguous()?;
    let n = x.elem_count();
    if n == 0 {
        return Ok(x);
    }
    let (xs, xl) = x.storage_and_layout();
    let xc = as_cuda(&xs, "x")?;
    let stream = stream_for(xc)?;
    let out_layout = candle_core::Layout::contiguous(x.shape());
    let is_f32 = x.dtype() == DType::F32;
    let mut out = if is_f32 {
        // SAFETY: the kernel writes every element.
        CudaStorage::wrap_cuda_slice(unsafe { xc.device.alloc::<f32>(n)? }, xc.device.clone())
    } else {
        CudaStorage::wrap_cuda_slice(unsafe { xc.device.alloc::<bf16>(n)? }, xc.device.clone())
    };
    {
        let (x_p, o_p, _g0, _g1) = if is_f32 {
            let (a, ga) = read_ptr::<f32>(xc, xl, &stream)?;
            let (b, gb) = write_ptr::<f32>(&mut out, &out_layout, &stream)?;
            (a.cast::<std::ffi::c_void>(), b.cast::<std::ffi::c_void>(), ga, gb)
        } else {
            let (a, ga) = read_ptr::<bf16>(xc, xl, &stream)?;
            let (b, gb) = write_ptr::<bf16>(&mut out, &out_layout, &stream)?;
            (a.cast::<std::ffi::c_void>(), b.cast::<std::ffi::c_void>(), ga, gb)
        };
        let params = ffi::FakeQuantParams { x: x_p, out: o_p, num_elems: n as i64, quant: quant_code(fmt), is_f32: is_f32 as i32 };
        // SAFETY: `x` is read-locked and contiguous with `n` elements from its offset; `out` is a
        // fresh allocation of `n` elements of the same dtype; the launcher checks the count and
        // the format; the guards order the launch on the storages' stream.
        let code = unsafe { ffi::dsv41_fake_quant(&params, std::mem::size_of::<ffi::FakeQuantParams>(), raw_stream(&stream)) };
        ffi::check_status(op, code)?;
    }
    drop(xs);
    Ok(Tensor::from_storage(Storage::Cuda(out), x.shape().clone(), BackpropOp::none(), false))
}
