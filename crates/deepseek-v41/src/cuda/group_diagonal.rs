//! The diagonal blocks of a stacked grouped product on the GPU (`kernels/group_diagonal.cu`):
//! `nn::GroupedLinear` multiplies its G groups of T rows stacked group-major with the whole
//! weight (`y` `[G·T, G·og]`, one weight stream at decode sizes) and keeps group g's block (rows
//! `g·T..`, columns `g·og..`). One launch gathers them into `[T, G·og]` instead of G narrows and a
//! concatenation; a copy, bit exact with [`group_diagonal_ref`].

use std::ffi::c_void;

use candle_core::{DType, Result, Tensor};

use super::device::{as_cuda, cuda_tensor, float_alloc, float_read_ptr, float_write_ptr, raw_stream, stream_for};
use super::ffi::check_status;

/// `Dsv41GroupDiagonalParams` of `kernels/include/dsv41_group_diagonal.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GroupDiagonalParams {
    y: *const c_void,
    out: *mut c_void,
    t: i64,
    og: i64,
    groups: i32,
    elem: i32,
}

extern "C" {
    fn dsv41_group_diagonal(p: *const GroupDiagonalParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// Group g's block of `y` `[G·T, G·og]` (rows `g·T..`, columns `g·og..`) side by side: `[T, G·og]`
/// — `Tensor::cat` of the narrowed blocks, on any device (the reference).
pub fn group_diagonal_ref(y: &Tensor, groups: usize) -> Result<Tensor> {
    let (rows, width) = y.dims2()?;
    if groups == 0 || !rows.is_multiple_of(groups) || !width.is_multiple_of(groups) {
        candle_core::bail!("group_diagonal: {groups} groups must divide y {:?}", y.shape())
    }
    let (t, og) = (rows / groups, width / groups);
    let blocks = (0..groups).map(|g| y.narrow(0, g * t, t)?.narrow(1, g * og, og)).collect::<Result<Vec<_>>>()?;
    Tensor::cat(&blocks, 1)
}

/// [`group_diagonal_ref`] in one launch: `y` bf16 or f32 on a CUDA device.
pub fn group_diagonal_device(y: &Tensor, groups: usize) -> Result<Tensor> {
    let op = "group_diagonal_device";
    let (rows, width) = y.dims2()?;
    if !y.device().is_cuda() || !matches!(y.dtype(), DType::BF16 | DType::F32) {
        candle_core::bail!("{op}: y must be bf16 or f32 on a CUDA device, got {:?} on {:?}", y.dtype(), y.device())
    }
    if groups == 0 || groups > i32::MAX as usize || !rows.is_multiple_of(groups) || !width.is_multiple_of(groups) || rows == 0 || width == 0 {
        candle_core::bail!("{op}: {groups} groups must divide y {:?} (both dims >= 1)", y.shape())
    }
    let (t, og) = (rows / groups, width / groups);
    let yc = y.contiguous()?;
    let (ys, yl) = yc.storage_and_layout();
    let ycu = as_cuda(&ys, "y")?;
    let cdev = ycu.device.clone();
    let stream = stream_for(ycu)?;
    let is_f32 = y.dtype() == DType::F32;
    // The kernel writes every element of the output.
    let mut out = float_alloc(&cdev, t * width, is_f32)?;
    {
        let (y_p, _gy) = float_read_ptr(ycu, yl, is_f32, &stream)?;
        let (o_p, _go) = float_write_ptr(&mut out, &candle_core::Layout::contiguous((t, width)), is_f32, &stream)?;
        let params = GroupDiagonalParams { y: y_p, out: o_p, t: t as i64, og: og as i64, groups: groups as i32, elem: if is_f32 { 4 } else { 2 } };
        // SAFETY: y is read-locked and contiguous [G·T, G·og]; out holds T·G·og elements of the
        // same dtype; the launcher checks counts and pointers.
        let code = unsafe { dsv41_group_diagonal(&params, std::mem::size_of::<GroupDiagonalParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop(ys);
    Ok(cuda_tensor(out, (t, width)))
}
