//! An mHC collapse and the sublayer's RMSNorm after it in one launch, optionally with the mHC post
//! that produces the stream (`kernels/mhc_norm.cu`): bit for bit [`super::collapse_device`] then
//! [`super::rms_norm_device`] (and [`super::mhc_post_device`] before them), one launch instead of
//! two or three. [`crate::model::collapse_norm`] and [`crate::model::post_collapse_norm`] call
//! them for CUDA tensors.

use std::ffi::c_void;

use candle_core::{DType, Layout, Result, Tensor};

use super::device::{as_cuda, cuda_tensor, float_alloc, float_read_ptr, float_write_ptr, raw_stream, read_ptr, stream_for};
use super::ffi::check_status;

/// Largest `hc` of the fused kernels (`DSV41_MHC_NORM_MAX_HC`).
pub const MHC_NORM_MAX_HC: usize = 32;
/// Largest row width `d` (`DSV41_MHC_NORM_MAX_D`: the collapsed row lives in shared memory).
pub const MHC_NORM_MAX_D: usize = 8192;

/// `Dsv41MhcNormParams` of `kernels/include/dsv41_mhc_norm.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MhcNormParams {
    x: *const c_void,
    pre: *const f32,
    weight: *const f32,
    out: *mut c_void,
    comb: *const f32,
    y: *const c_void,
    post: *const f32,
    stream_out: *mut c_void,
    tokens: i64,
    hc: i32,
    d: i32,
    x_f32: i32,
    y_f32: i32,
    mean_mul: f32,
    eps: f32,
}

extern "C" {
    fn dsv41_mhc_collapse_norm(p: *const MhcNormParams, params_size: usize, stream: *mut c_void) -> i32;
    fn dsv41_mhc_post_norm(p: *const MhcNormParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// Whether the fused kernels take the stream `x` (`[T, hc, d]` bf16 or f32 on a CUDA device,
/// `hc ≤` [`MHC_NORM_MAX_HC`], `d ≤` [`MHC_NORM_MAX_D`]) and `y` (bf16 or f32; post only).
pub fn mhc_norm_supported(x: &Tensor, y: Option<&Tensor>) -> bool {
    let float = |t: &Tensor| matches!(t.dtype(), DType::BF16 | DType::F32);
    x.device().is_cuda()
        && float(x)
        && y.is_none_or(float)
        && x.dims3().is_ok_and(|(t, hc, d)| (1..=MHC_NORM_MAX_HC).contains(&hc) && (1..=MHC_NORM_MAX_D).contains(&d) && t < (1 << 31))
}

/// The post's inputs of [`mhc_post_norm_device`].
struct PostInputs<'a> {
    comb: &'a Tensor,
    y: &'a Tensor,
    post: &'a Tensor,
}

/// `rms_norm(collapse(x, pre))` on the GPU in one launch: bit for bit
/// `rms_norm_device(&collapse_device(x, pre)?, weight, eps)`.
///
/// `x`: `[T, hc, d]` bf16 or f32 on a CUDA device ([`mhc_norm_supported`]); `pre`: `[T, hc]` and
/// `weight`: `[d]` (any float dtype, used as f32). Returns `[T, d]` in `x`'s dtype.
pub fn collapse_norm_device(x: &Tensor, pre: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(launch("collapse_norm_device", x, pre, weight, eps, None)?.0)
}

/// The mHC post and the next collapse and RMSNorm on the GPU in one launch: `(x1, h)` with
/// `x1 = post(y, x, post, comb)` and `h = rms_norm(collapse(x1, pre))` — bit for bit
/// [`super::mhc_post_device`] (output in `x`'s dtype), [`super::collapse_device`] and
/// [`super::rms_norm_device`].
///
/// `x`: `[T, hc, d]` bf16 or f32 on a CUDA device ([`mhc_norm_supported`]); `comb`: `[T, hc,
/// hc]`; `y`: `[T, d]` bf16 or f32; `post`, `pre`: `[T, hc]`; `weight`: `[d]` (floats used as
/// f32). Returns `([T, hc, d], [T, d])`, both in `x`'s dtype.
#[allow(clippy::too_many_arguments)]
pub fn mhc_post_norm_device(x: &Tensor, comb: &Tensor, y: &Tensor, post: &Tensor, pre: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let (h, x1) = launch("mhc_post_norm_device", x, pre, weight, eps, Some(PostInputs { comb, y, post }))?;
    let x1 = x1.ok_or_else(|| candle_core::Error::Msg("mhc_post_norm_device: no stream output".into()))?;
    Ok((x1, h))
}

fn launch(op: &str, x: &Tensor, pre: &Tensor, weight: &Tensor, eps: f64, post: Option<PostInputs>) -> Result<(Tensor, Option<Tensor>)> {
    if !mhc_norm_supported(x, post.as_ref().map(|p| p.y)) {
        candle_core::bail!(
            "{op}: x must be [T, hc <= {MHC_NORM_MAX_HC}, d <= {MHC_NORM_MAX_D}] bf16 or f32 on a CUDA device (y bf16 or f32), got {:?} {:?} on {:?}",
            x.dtype(),
            x.shape(),
            x.device()
        )
    }
    let (t, hc, d) = x.dims3()?;
    if pre.dims() != [t, hc] || weight.dims() != [d] {
        candle_core::bail!("{op}: pre {:?} / weight {:?} do not fit x {:?}", pre.shape(), weight.shape(), x.shape())
    }
    if let Some(p) = &post {
        if p.y.dims() != [t, d] || p.post.dims() != [t, hc] || p.comb.dims() != [t, hc, hc] {
            candle_core::bail!("{op}: y {:?}, post {:?} and comb {:?} do not fit the stream {:?}", p.y.shape(), p.post.shape(), p.comb.shape(), x.shape())
        }
    }
    let dev = x.device();
    if t == 0 {
        let x1 = post.as_ref().map(|_| Tensor::zeros((0, hc, d), x.dtype(), dev)).transpose()?;
        return Ok((Tensor::zeros((0, d), x.dtype(), dev)?, x1));
    }
    let f32c = |v: &Tensor| -> Result<Tensor> { v.to_device(dev)?.to_dtype(DType::F32)?.contiguous() };
    let (xc, prec, wc) = (x.contiguous()?, f32c(pre)?, f32c(weight)?);
    let postc = post.as_ref().map(|p| -> Result<_> { Ok((f32c(p.comb)?, p.y.to_device(dev)?.contiguous()?, f32c(p.post)?)) }).transpose()?;
    let (xs, xl) = xc.storage_and_layout();
    let (ps, pl) = prec.storage_and_layout();
    let (ws, wl) = wc.storage_and_layout();
    let post_st = postc.as_ref().map(|(c, y, p)| (c.storage_and_layout(), y.storage_and_layout(), p.storage_and_layout()));
    let xcu = as_cuda(&xs, "x")?;
    let cdev = xcu.device.clone();
    let stream = stream_for(xcu)?;
    let x_f32 = x.dtype() == DType::F32;
    let y_f32 = post.as_ref().is_some_and(|p| p.y.dtype() == DType::F32);
    // The kernels write every element of both outputs (T·d, T·hc·d > 0 here).
    let mut out = float_alloc(&cdev, t * d, x_f32)?;
    let mut x1 = post.as_ref().map(|_| float_alloc(&cdev, t * hc * d, x_f32)).transpose()?;
    {
        let (x_p, _gx) = float_read_ptr(xcu, xl, x_f32, &stream)?;
        let (pre_p, _gp) = read_ptr::<f32>(as_cuda(&ps, "pre")?, pl, &stream)?;
        let (w_p, _gw) = read_ptr::<f32>(as_cuda(&ws, "weight")?, wl, &stream)?;
        let (out_p, _go) = float_write_ptr(&mut out, &Layout::contiguous((t, d)), x_f32, &stream)?;
        let mut params = MhcNormParams {
            x: x_p,
            pre: pre_p,
            weight: w_p,
            out: out_p,
            comb: std::ptr::null(),
            y: std::ptr::null(),
            post: std::ptr::null(),
            stream_out: std::ptr::null_mut(),
            tokens: t as i64,
            hc: hc as i32,
            d: d as i32,
            x_f32: x_f32 as i32,
            y_f32: y_f32 as i32,
            mean_mul: (1.0 / d as f64) as f32,
            eps: eps as f32,
        };
        let size = std::mem::size_of::<MhcNormParams>();
        let code = match (&post_st, x1.as_mut()) {
            (Some(((cs, cl), (ys, yl), (qs, ql))), Some(x1)) => {
                let (c_p, _gc) = read_ptr::<f32>(as_cuda(cs, "comb")?, cl, &stream)?;
                let (y_p, _gy) = float_read_ptr(as_cuda(ys, "y")?, yl, y_f32, &stream)?;
                let (q_p, _gq) = read_ptr::<f32>(as_cuda(qs, "post")?, ql, &stream)?;
                let (s_p, _gs) = float_write_ptr(x1, &Layout::contiguous((t, hc, d)), x_f32, &stream)?;
                (params.comb, params.y, params.post, params.stream_out) = (c_p, y_p, q_p, s_p);
                // SAFETY: the inputs are read-locked, contiguous of the checked shapes and flagged
                // dtypes; both outputs are fresh allocations of T·d / T·hc·d elements; the launcher
                // checks counts and pointers; the guards order the launch on the storages' stream.
                unsafe { dsv41_mhc_post_norm(&params, size, raw_stream(&stream)) }
            }
            // SAFETY: as above, without the post's inputs and stream output.
            _ => unsafe { dsv41_mhc_collapse_norm(&params, size, raw_stream(&stream)) },
        };
        check_status(op, code)?;
    }
    drop((xs, ps, ws, post_st));
    Ok((cuda_tensor(out, (t, d)), x1.map(|s| cuda_tensor(s, (t, hc, d)))))
}
