//! The MoE experts' clamped SwiGLU on the GPU (`kernels/swiglu.cu`, spec §8): one launch between
//! `w1`/`w3` and `w2` instead of Candle's nine kernels (and the uploads of the scalar bounds and
//! broadcast strides), bit for bit those Candle ops on a CUDA device
//! (`tests/cuda_decoder_ops.rs`). [`crate::model::Expert`] calls it for CUDA tensors.

use std::ffi::c_void;

use candle_core::{DType, Layout, Result, Tensor};

use super::device::{as_cuda, cuda_tensor, float_alloc, float_read_ptr, float_write_ptr, opt_f32_read_ptr, raw_stream, stream_for};
use super::ffi::check_status;

/// `Dsv41SwigluParams` of `kernels/include/dsv41_swiglu.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SwigluParams {
    /// `[rows, inter]` bf16 or f32 (`x_f32`), contiguous.
    gate: *const c_void,
    /// `[rows, inter]` gate's dtype, contiguous.
    up: *const c_void,
    /// `[rows]` f32 or null.
    weight: *const f32,
    /// `[rows, inter]` gate's dtype.
    out: *mut c_void,
    rows: i64,
    inter: i32,
    x_f32: i32,
    clamp: i32,
    limit: f32,
}

extern "C" {
    fn dsv41_swiglu(p: *const SwigluParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// Whether [`swiglu_device`] takes `gate` (`[rows, inter]` bf16 or f32 on a CUDA device).
pub fn swiglu_supported(gate: &Tensor) -> bool {
    gate.device().is_cuda() && matches!(gate.dtype(), DType::BF16 | DType::F32) && gate.dims2().is_ok_and(|(_, i)| (1..=i32::MAX as usize).contains(&i))
}

/// `silu(min(gate, L)) · clamp(up, −L, L) · weight` in f32, rounded to `gate`'s dtype (no clamp
/// when `limit` is `None`, no weight when `weight` is `None`) — bit for bit the Candle ops of
/// [`crate::model::Expert::forward`] between its `w1`/`w3` and `w2` on a CUDA device.
///
/// `gate`, `up`: `[rows, inter]` bf16 or f32 (the same dtype) on a CUDA device; `weight`:
/// `[rows, 1]` (any float dtype, used as f32); `limit` > 0. Returns `[rows, inter]` in
/// `gate`'s dtype.
pub fn swiglu_device(gate: &Tensor, up: &Tensor, weight: Option<&Tensor>, limit: Option<f64>) -> Result<Tensor> {
    let op = "swiglu_device";
    if !swiglu_supported(gate) || up.dims() != gate.dims() || up.dtype() != gate.dtype() || !up.device().same_device(gate.device()) {
        candle_core::bail!(
            "{op}: gate and up must be [rows, inter] bf16 or f32 of one dtype on a CUDA device, got {:?} {:?} on {:?} and {:?} {:?}",
            gate.dtype(),
            gate.shape(),
            gate.device(),
            up.dtype(),
            up.shape()
        )
    }
    let (rows, inter) = gate.dims2()?;
    if let Some(w) = weight {
        if w.dims() != [rows, 1] {
            candle_core::bail!("{op}: weight {:?} does not fit gate {:?} (want [{rows}, 1])", w.shape(), gate.shape())
        }
    }
    if let Some(l) = limit {
        if l.is_nan() || l <= 0.0 {
            candle_core::bail!("{op}: limit must be > 0, got {l}")
        }
    }
    let dev = gate.device();
    if rows == 0 {
        return Ok(gate.clone());
    }
    let (g, u) = (gate.contiguous()?, up.contiguous()?);
    let w = weight.map(|w| w.to_device(dev)?.to_dtype(DType::F32)?.contiguous()).transpose()?;
    let (gs, gl) = g.storage_and_layout();
    let (us, ul) = u.storage_and_layout();
    let ws = w.as_ref().map(|w| w.storage_and_layout());
    let (gc, uc) = (as_cuda(&gs, "gate")?, as_cuda(&us, "up")?);
    let cdev = gc.device.clone();
    let main = stream_for(gc)?;
    let x_f32 = gate.dtype() == DType::F32;
    // The kernel writes every element of the output (rows·inter > 0 here).
    let mut out = float_alloc(&cdev, rows * inter, x_f32)?;
    // Inside a SideStream::run: on the side stream, its inputs kept until the join.
    let side = super::side_stream::side_launch_stream(&main)?;
    if side.is_some() {
        super::side_stream::side_keep(Box::new((g.clone(), u.clone(), w.clone())));
    }
    let stream = side.unwrap_or(main);
    {
        let out_layout = Layout::contiguous((rows, inter));
        let (g_p, _gg) = float_read_ptr(gc, gl, x_f32, &stream)?;
        let (u_p, _gu) = float_read_ptr(uc, ul, x_f32, &stream)?;
        let (w_p, _gw) = opt_f32_read_ptr(ws.as_ref(), "weight", &stream)?;
        let (out_p, _go) = float_write_ptr(&mut out, &out_layout, x_f32, &stream)?;
        let params = SwigluParams {
            gate: g_p,
            up: u_p,
            weight: w_p,
            out: out_p,
            rows: rows as i64,
            inter: inter as i32,
            x_f32: x_f32 as i32,
            clamp: limit.is_some() as i32,
            limit: limit.unwrap_or(0.0) as f32,
        };
        // SAFETY: gate and up are read-locked, contiguous [rows, inter] of the flagged dtype;
        // weight is [rows] f32 or null; out is a fresh allocation of rows·inter elements; the
        // launcher checks counts and pointers; the guards order the launch on the stream (a side
        // stream waits for the device's stream first and keeps the inputs: SideStream).
        let code = unsafe { dsv41_swiglu(&params, std::mem::size_of::<SwigluParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop((gs, us, ws));
    Ok(cuda_tensor(out, (rows, inter)))
}
