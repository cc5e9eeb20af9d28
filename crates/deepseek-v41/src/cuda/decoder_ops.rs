//! The decoder's small per-row ops on the GPU (`kernels/decoder_ops.cu`): RMSNorm, the mHC mixes'
//! rsqrt factor, the mHC collapse, the elementwise part of the mHC post, the Engram gate and
//! residual and the MoE's f32 sum, one launch each instead of 9 / 7 / 4 / 4 / ~25 / 2–3 Candle
//! kernels (plus their allocations and stride uploads), with bit-identical results to those
//! Candle op sequences on a CUDA device (`tests/cuda_decoder_ops.rs`). [`crate::nn::RmsNorm`],
//! [`crate::model::HcMix::mixes`], [`crate::model::collapse`], [`crate::model::post`],
//! [`crate::model::engram_mix`] and the MoE call them for CUDA tensors.

use std::ffi::c_void;

use candle_core::{CudaStorage, DType, Layout, Result, Tensor, D};

use super::device::{as_cuda, cuda_tensor, float_alloc, float_read_ptr, float_write_ptr, opt_f32_read_ptr, raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi::check_status;

/// Largest row width of [`rms_norm_device`] / [`rms_scale_device`] (`DSV41_ROW_NORM_MAX_N`).
pub const ROW_NORM_MAX_N: usize = 1 << 20;
/// Largest `hc` of [`collapse_device`] (`DSV41_COLLAPSE_MAX_HC`).
pub const COLLAPSE_MAX_HC: usize = 32;

/// `Dsv41RowNormParams` of `kernels/include/dsv41_decoder_ops.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RowNormParams {
    /// `[rows, n]` bf16 or f32 (`x_f32`), contiguous.
    x: *const c_void,
    /// `[n]` f32 (rms_norm only).
    weight: *const f32,
    /// rms_norm: `[rows, n]` in x's dtype; rms_scale: `[rows, n]` f32.
    out: *mut c_void,
    /// rms_scale: `[rows]` f32.
    scale: *mut f32,
    rows: i64,
    n: i32,
    x_f32: i32,
    mean_mul: f32,
    eps: f32,
}

/// `Dsv41CollapseParams` of `kernels/include/dsv41_decoder_ops.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CollapseParams {
    /// `[tokens, hc, d]` bf16 or f32 (`x_f32`), contiguous.
    x: *const c_void,
    /// `[tokens, hc]` f32, contiguous.
    pre: *const f32,
    /// `[tokens, d]` in x's dtype.
    out: *mut c_void,
    tokens: i64,
    hc: i32,
    d: i32,
    x_f32: i32,
    pad: i32,
}

/// `Dsv41MhcPostParams` of `kernels/include/dsv41_decoder_ops.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MhcPostParams {
    /// `[tokens, hc, d]` bf16 or f32 (`x_f32`), contiguous.
    x: *const c_void,
    /// `[tokens, hc, hc]` f32, contiguous.
    comb: *const f32,
    /// `[tokens, d]` bf16 or f32 (`y_f32`), contiguous.
    y: *const c_void,
    /// `[tokens, hc]` f32, contiguous.
    post: *const f32,
    /// `[tokens, hc, d]` bf16 or f32 (`out_f32`).
    out: *mut c_void,
    tokens: i64,
    hc: i32,
    d: i32,
    x_f32: i32,
    y_f32: i32,
    out_f32: i32,
    pad: i32,
}

/// `Dsv41AccumulateParams` of `kernels/include/dsv41_decoder_ops.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AccumulateParams {
    /// `[n]` f32, contiguous, or null.
    acc: *const f32,
    /// `[n]` bf16 or f32 (`v_f32`), contiguous.
    v: *const c_void,
    /// `[n]` bf16 or f32 (`out_f32`).
    out: *mut c_void,
    n: i64,
    v_f32: i32,
    out_f32: i32,
}

/// `Dsv41ScaleRoundParams` of `kernels/include/dsv41_decoder_ops.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ScaleRoundParams {
    /// `[n]` bf16 or f32 (`v_f32`), contiguous.
    v: *const c_void,
    /// `[n]` f32.
    out: *mut f32,
    n: i64,
    v_f32: i32,
    mul: f32,
}

/// `Dsv41EngramMixParams` of `kernels/include/dsv41_decoder_ops.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct EngramMixParams {
    /// `[tokens, hc, d]` bf16 or f32 (`x_f32`), contiguous.
    x: *const c_void,
    /// `[tokens, (hc+1)·d]` f32, contiguous.
    kv: *const f32,
    /// `[hc, d]` f32, contiguous.
    qk: *const f32,
    /// `[tokens, hc, d]` in x's dtype.
    out: *mut c_void,
    tokens: i64,
    hc: i32,
    d: i32,
    x_f32: i32,
    mean_mul: f32,
    eps: f32,
    dot_mul: f32,
    clamp: f32,
    pad: i32,
}

extern "C" {
    fn dsv41_engram_mix(p: *const EngramMixParams, params_size: usize, stream: *mut c_void) -> i32;
    fn dsv41_accumulate(p: *const AccumulateParams, params_size: usize, stream: *mut c_void) -> i32;
    fn dsv41_scale_round(p: *const ScaleRoundParams, params_size: usize, stream: *mut c_void) -> i32;
    fn dsv41_mhc_post(p: *const MhcPostParams, params_size: usize, stream: *mut c_void) -> i32;
    fn dsv41_rms_norm(p: *const RowNormParams, params_size: usize, stream: *mut c_void) -> i32;
    fn dsv41_rms_scale(p: *const RowNormParams, params_size: usize, stream: *mut c_void) -> i32;
    fn dsv41_mhc_collapse(p: *const CollapseParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// Whether the kernels take `x` (bf16 or f32) and rows of width `n`.
fn norm_supported(x: &Tensor, n: usize) -> bool {
    matches!(x.dtype(), DType::BF16 | DType::F32) && (1..=ROW_NORM_MAX_N).contains(&n)
}

/// Whether [`rms_norm_device`] / [`rms_scale_device`] take `x` (`[..., n]` bf16 or f32 on a
/// CUDA device, `1 ≤ n ≤ ROW_NORM_MAX_N`).
pub fn row_norm_supported(x: &Tensor) -> bool {
    x.device().is_cuda() && x.rank() > 0 && x.dim(D::Minus1).is_ok_and(|n| norm_supported(x, n))
}

/// Checked `[rows, n]` view of `x` (contiguous) for the norm kernels.
fn norm_rows(op: &str, x: &Tensor) -> Result<(Tensor, usize, usize)> {
    if x.rank() == 0 {
        candle_core::bail!("{op}: expected a tensor with a last dim, got a scalar")
    }
    let n = x.dim(D::Minus1)?;
    if !norm_supported(x, n) {
        candle_core::bail!("{op}: x must be bf16 or f32 with a last dim in 1..={ROW_NORM_MAX_N}, got {:?} {:?}", x.dtype(), x.shape())
    }
    let rows = x.elem_count() / n;
    Ok((x.contiguous()?, rows, n))
}

/// Which row-norm kernel [`launch_norm`] runs.
enum NormKernel<'a> {
    /// RMSNorm with `weight` `[n]` (any float dtype, used in f32), output in `out_dtype`.
    RmsNorm { weight: &'a Tensor, out_dtype: DType },
    /// `f32(x)` and the per-row `1 / sqrt(mean(x²) + eps)` `[rows]` f32.
    RmsScale,
}

/// Launches a norm kernel on `x` `[rows, n]` (contiguous) into `out` (rows·n elements: the
/// RMSNorm's `out_dtype`, f32 for the scale kernel) and, for [`NormKernel::RmsScale`], `scale`
/// (`[rows]` f32).
fn launch_norm(op: &str, x: &Tensor, rows: usize, n: usize, kernel: NormKernel, eps: f64) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let (weight, out_dtype, scale) = match kernel {
        NormKernel::RmsNorm { weight, out_dtype } => (Some(weight), out_dtype, false),
        NormKernel::RmsScale => (None, DType::F32, true),
    };
    let (xs, xl) = x.storage_and_layout();
    let xc = as_cuda(&xs, "x")?;
    let dev = xc.device.clone();
    let stream = stream_for(xc)?;
    // The kernels write every element of the outputs (rows·n > 0 here).
    let mut out = float_alloc(&dev, rows * n, out_dtype == DType::F32)?;
    let mut sc = if scale { Some(float_alloc(&dev, rows, true)?) } else { None };
    let w = weight.map(|w| w.to_dtype(DType::F32)?.contiguous()).transpose()?;
    let ws = w.as_ref().map(|w| w.storage_and_layout());
    {
        let out_layout = Layout::contiguous((rows, n));
        let x_f32 = x.dtype() == DType::F32;
        let (x_p, _gx) = float_read_ptr(xc, xl, x_f32, &stream)?;
        let (w_p, _gw) = opt_f32_read_ptr(ws.as_ref(), "weight", &stream)?;
        let (out_p, _go) = float_write_ptr(&mut out, &out_layout, out_dtype == DType::F32, &stream)?;
        let (s_p, _gs) = match sc.as_mut() {
            Some(s) => {
                let (p, g) = write_ptr::<f32>(s, &Layout::contiguous(rows), &stream)?;
                (p, Some(g))
            }
            None => (std::ptr::null_mut(), None),
        };
        let params = RowNormParams {
            x: x_p,
            weight: w_p,
            out: out_p,
            scale: s_p,
            rows: rows as i64,
            n: n as i32,
            x_f32: x_f32 as i32,
            mean_mul: (1.0 / n as f64) as f32,
            eps: eps as f32,
        };
        let size = std::mem::size_of::<RowNormParams>();
        // SAFETY: x is read-locked, contiguous [rows, n] of the flagged dtype; weight is [n] f32
        // (rms_norm); outputs are fresh allocations of rows·n / rows elements; the launcher
        // checks counts and pointers; the guards order the launch on the storages' stream.
        let code = unsafe {
            if scale {
                dsv41_rms_scale(&params, size, raw_stream(&stream))
            } else {
                dsv41_rms_norm(&params, size, raw_stream(&stream))
            }
        };
        check_status(op, code)?;
    }
    Ok((out, sc))
}

/// RMSNorm on the GPU: `x / sqrt(mean(x²) + eps) · weight` over the last dim, in f32, rounded to
/// `x`'s dtype — bit for bit [`crate::nn::RmsNorm`]'s Candle ops on a CUDA device.
///
/// `x`: `[..., n]` bf16 or f32 on a CUDA device (`1 ≤ n ≤` [`ROW_NORM_MAX_N`]); `weight`: `[n]`
/// (any float dtype, used as f32). Returns `x`'s shape and dtype.
pub fn rms_norm_device(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let op = "rms_norm_device";
    let (xc, rows, n) = norm_rows(op, x)?;
    if weight.dims() != [n] {
        candle_core::bail!("{op}: weight {:?} does not fit x {:?}", weight.shape(), x.shape())
    }
    if rows == 0 {
        return Ok(x.clone());
    }
    let weight = weight.to_device(x.device())?;
    let (out, _) = launch_norm(op, &xc, rows, n, NormKernel::RmsNorm { weight: &weight, out_dtype: x.dtype() }, eps)?;
    Ok(cuda_tensor(out, x.shape().clone()))
}

/// The mHC mixes' normalization on the GPU: `(f32(x), 1 / sqrt(mean(x²) + eps))` per row — bit
/// for bit `x.to_dtype(F32)` and the Candle ops `(x² mean + eps).sqrt().recip()` on a CUDA device.
///
/// `x`: `[rows, n]` bf16 or f32 on a CUDA device (`1 ≤ n ≤` [`ROW_NORM_MAX_N`]). Returns
/// `([rows, n] f32, [rows, 1] f32)`.
pub fn rms_scale_device(x: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let op = "rms_scale_device";
    let (rows, n) = x.dims2()?;
    let (xc, _, _) = norm_rows(op, x)?;
    if rows == 0 {
        let dev = x.device();
        return Ok((Tensor::zeros((0, n), DType::F32, dev)?, Tensor::zeros((0, 1), DType::F32, dev)?));
    }
    let (out, scale) = launch_norm(op, &xc, rows, n, NormKernel::RmsScale, eps)?;
    let scale = scale.ok_or_else(|| candle_core::Error::Msg(format!("{op}: no scale output")))?;
    Ok((cuda_tensor(out, (rows, n)), cuda_tensor(scale, (rows, 1))))
}

/// Whether [`collapse_device`] takes `x` (`[T, hc, d]` bf16 or f32 on a CUDA device,
/// `hc ≤` [`COLLAPSE_MAX_HC`]).
pub fn collapse_supported(x: &Tensor) -> bool {
    x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F32)
        && x.dims3().is_ok_and(|(_, hc, d)| (1..=COLLAPSE_MAX_HC).contains(&hc) && d >= 1 && d <= i32::MAX as usize)
}

/// The mHC collapse on the GPU: `out[t, c] = Σ_k x[t, k, c] · pre[t, k]` accumulated in f32 (k
/// ascending from 0), rounded to `x`'s dtype — bit for bit [`crate::model::collapse`]'s Candle
/// ops on a CUDA device.
///
/// `x`: `[T, hc, d]` bf16 or f32 on a CUDA device (`hc ≤` [`COLLAPSE_MAX_HC`]); `pre`:
/// `[T, hc]` (any float dtype, used as f32). Returns `[T, d]` in `x`'s dtype.
pub fn collapse_device(x: &Tensor, pre: &Tensor) -> Result<Tensor> {
    let op = "collapse_device";
    let (t, hc, d) = x.dims3()?;
    if !collapse_supported(x) {
        candle_core::bail!("{op}: x must be [T, hc <= {COLLAPSE_MAX_HC}, d] bf16 or f32 on a CUDA device, got {:?} {:?} on {:?}", x.dtype(), x.shape(), x.device())
    }
    if pre.dims() != [t, hc] {
        candle_core::bail!("{op}: pre {:?} does not fit x {:?}", pre.shape(), x.shape())
    }
    let dev = x.device();
    if t == 0 {
        return Tensor::zeros((0, d), x.dtype(), dev);
    }
    let xc = x.contiguous()?;
    let pre = pre.to_device(dev)?.to_dtype(DType::F32)?.contiguous()?;
    let (xs, xl) = xc.storage_and_layout();
    let (ps, pl) = pre.storage_and_layout();
    let (xcu, pcu) = (as_cuda(&xs, "x")?, as_cuda(&ps, "pre")?);
    let cdev = xcu.device.clone();
    let stream = stream_for(xcu)?;
    let x_f32 = x.dtype() == DType::F32;
    // The kernel writes every element of the output (T·d > 0 here).
    let mut out = float_alloc(&cdev, t * d, x_f32)?;
    {
        let out_layout = Layout::contiguous((t, d));
        let (x_p, _gx) = float_read_ptr(xcu, xl, x_f32, &stream)?;
        let (pre_p, _gp) = read_ptr::<f32>(pcu, pl, &stream)?;
        let (out_p, _go) = float_write_ptr(&mut out, &out_layout, x_f32, &stream)?;
        let params = CollapseParams { x: x_p, pre: pre_p, out: out_p, tokens: t as i64, hc: hc as i32, d: d as i32, x_f32: x_f32 as i32, pad: 0 };
        // SAFETY: x and pre are read-locked, contiguous [T, hc, d] / [T, hc] of the flagged
        // dtypes; out is a fresh allocation of T·d elements; the launcher checks counts and
        // pointers; the guards order the launch on the storages' stream.
        let code = unsafe { dsv41_mhc_collapse(&params, std::mem::size_of::<CollapseParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop((xs, ps));
    Ok(cuda_tensor(out, (t, d)))
}

/// bf16 or f32: the element types the decoder-op kernels read and write.
fn float_io(dt: DType) -> bool {
    matches!(dt, DType::BF16 | DType::F32)
}

/// The largest hc [`mhc_post_device`] takes.
pub const MHC_POST_MAX_HC: usize = 32;

/// Whether [`mhc_post_device`] takes these tensors: `x` (the stream) on a CUDA device with
/// hc ≤ [`MHC_POST_MAX_HC`], `x`, `y` and `out_dtype` bf16 or f32.
pub fn mhc_post_supported(x: &Tensor, y: &Tensor, out_dtype: DType) -> bool {
    x.device().is_cuda() && x.dims().get(1).is_some_and(|&hc| hc <= MHC_POST_MAX_HC) && float_io(x.dtype()) && float_io(y.dtype()) && float_io(out_dtype)
}

/// The mHC post on the GPU in one launch: `out[t, j, c] = post[t, j] · y[t, c] + Σ_i comb[t, i,
/// j] · x[t, i, c]` in f32, rounded to `out_dtype` — bit for bit [`crate::model::post`] on the
/// CPU (the comb product one FMA chain over the copies in ascending order, `kernels/decoder_ops.cu`).
/// The same Candle ops on a CUDA device call cuBLAS, which sums K = hc in that order at the
/// released widths (d ≥ 4096) but in pairs at small ones (hidden 192): the kernel is the
/// reference's order at every width.
///
/// `x`: `[T, hc, d]` bf16 or f32; `comb`: `[T, hc, hc]` (any float dtype, used as f32); `y`:
/// `[T, d]` bf16 or f32; `post`: `[T, hc]` (used as f32); all on one CUDA device. `out_dtype`:
/// bf16 or f32. Returns `[T, hc, d]`.
pub fn mhc_post_device(x: &Tensor, comb: &Tensor, y: &Tensor, post: &Tensor, out_dtype: DType) -> Result<Tensor> {
    let op = "mhc_post_device";
    let (t, hc, d) = x.dims3()?;
    if !mhc_post_supported(x, y, out_dtype) {
        candle_core::bail!(
            "{op}: x must be bf16 or f32 on a CUDA device with hc <= {MHC_POST_MAX_HC}, y / out bf16 or f32; got x {:?} {:?} on {:?}, y {:?}, out {out_dtype:?}",
            x.shape(),
            x.dtype(),
            x.device(),
            y.dtype()
        )
    }
    if y.dims() != [t, d] || post.dims() != [t, hc] || comb.dims() != [t, hc, hc] || d > i32::MAX as usize {
        candle_core::bail!("{op}: y {:?}, post {:?} and comb {:?} do not fit the stream {:?}", y.shape(), post.shape(), comb.shape(), x.shape())
    }
    let dev = x.device();
    if t == 0 {
        return Tensor::zeros((0, hc, d), out_dtype, dev);
    }
    let (xc, yc) = (x.contiguous()?, y.to_device(dev)?.contiguous()?);
    let pc = post.to_device(dev)?.to_dtype(DType::F32)?.contiguous()?;
    let cc = comb.to_device(dev)?.to_dtype(DType::F32)?.contiguous()?;
    let (xs, xl) = xc.storage_and_layout();
    let (cs, cl) = cc.storage_and_layout();
    let (ys, yl) = yc.storage_and_layout();
    let (ps, pl) = pc.storage_and_layout();
    let (xcu, ccu, ycu, pcu) = (as_cuda(&xs, "x")?, as_cuda(&cs, "comb")?, as_cuda(&ys, "y")?, as_cuda(&ps, "post")?);
    let cdev = xcu.device.clone();
    let stream = stream_for(xcu)?;
    let (x_f32, y_f32, out_f32) = (x.dtype() == DType::F32, y.dtype() == DType::F32, out_dtype == DType::F32);
    let n = t * hc * d;
    // The kernel writes every element of the output (n > 0 here).
    let mut out = float_alloc(&cdev, n, out_f32)?;
    {
        let out_layout = Layout::contiguous((t, hc, d));
        let (x_p, _gx) = float_read_ptr(xcu, xl, x_f32, &stream)?;
        let (c_p, _gc) = read_ptr::<f32>(ccu, cl, &stream)?;
        let (y_p, _gy) = float_read_ptr(ycu, yl, y_f32, &stream)?;
        let (p_p, _gp) = read_ptr::<f32>(pcu, pl, &stream)?;
        let (out_p, _go) = float_write_ptr(&mut out, &out_layout, out_f32, &stream)?;
        let params = MhcPostParams {
            x: x_p,
            comb: c_p,
            y: y_p,
            post: p_p,
            out: out_p,
            tokens: t as i64,
            hc: hc as i32,
            d: d as i32,
            x_f32: x_f32 as i32,
            y_f32: y_f32 as i32,
            out_f32: out_f32 as i32,
            pad: 0,
        };
        // SAFETY: inputs are read-locked, contiguous of the checked shapes and flagged dtypes;
        // out is a fresh allocation of T·hc·d elements; the launcher checks counts and pointers;
        // the guards order the launch on the storages' stream.
        let code = unsafe { dsv41_mhc_post(&params, std::mem::size_of::<MhcPostParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop((xs, cs, ys, ps));
    Ok(cuda_tensor(out, (t, hc, d)))
}

/// Whether [`accumulate_device`] takes `v` (bf16 or f32 on a CUDA device) and `out_dtype` (bf16 or
/// f32).
pub fn accumulate_supported(v: &Tensor, out_dtype: DType) -> bool {
    v.device().is_cuda() && float_io(v.dtype()) && float_io(out_dtype)
}

/// `cast(acc + f32(v))` on the GPU, with `acc = +0` when `None` — bit for bit the Candle ops
/// `(acc or zeros) + v.to_dtype(F32)` then `.to_dtype(out_dtype)` on a CUDA device (the MoE's
/// f32 sum of its experts' outputs).
///
/// `acc`: f32 of `v`'s shape; `v`: bf16 or f32 on a CUDA device; `out_dtype`: bf16 or f32.
/// Returns `v`'s shape in `out_dtype`.
pub fn accumulate_device(acc: Option<&Tensor>, v: &Tensor, out_dtype: DType) -> Result<Tensor> {
    let op = "accumulate_device";
    if !accumulate_supported(v, out_dtype) {
        candle_core::bail!("{op}: v must be bf16 or f32 on a CUDA device and out bf16 or f32, got {:?} on {:?}, {out_dtype:?}", v.dtype(), v.device())
    }
    if let Some(a) = acc {
        if a.dims() != v.dims() || a.dtype() != DType::F32 || !a.device().same_device(v.device()) {
            candle_core::bail!("{op}: acc {:?} {:?} must be f32 of v's shape {:?} on its device", a.dtype(), a.shape(), v.shape())
        }
    }
    let n = v.elem_count();
    let dev = v.device();
    if n == 0 {
        return Tensor::zeros(v.shape(), out_dtype, dev);
    }
    let vc = v.contiguous()?;
    let ac = acc.map(|a| a.contiguous()).transpose()?;
    let (vs, vl) = vc.storage_and_layout();
    let as_ = ac.as_ref().map(|a| a.storage_and_layout());
    let vcu = as_cuda(&vs, "v")?;
    let cdev = vcu.device.clone();
    let stream = stream_for(vcu)?;
    let (v_f32, out_f32) = (v.dtype() == DType::F32, out_dtype == DType::F32);
    // The kernel writes every element of the output (n > 0 here).
    let mut out = float_alloc(&cdev, n, out_f32)?;
    {
        let (v_p, _gv) = float_read_ptr(vcu, vl, v_f32, &stream)?;
        let (a_p, _ga) = opt_f32_read_ptr(as_.as_ref(), "acc", &stream)?;
        let (out_p, _go) = float_write_ptr(&mut out, &Layout::contiguous(n), out_f32, &stream)?;
        let params = AccumulateParams { acc: a_p, v: v_p, out: out_p, n: n as i64, v_f32: v_f32 as i32, out_f32: out_f32 as i32 };
        // SAFETY: v (and acc) are read-locked, contiguous of n elements of the flagged dtypes;
        // out is a fresh allocation of n elements; the launcher checks counts and pointers; the
        // guards order the launch on the storages' stream.
        let code = unsafe { dsv41_accumulate(&params, std::mem::size_of::<AccumulateParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop((vs, as_));
    Ok(cuda_tensor(out, v.shape().clone()))
}

/// `f32(bf16(f32(v)·mul))` on the GPU — bit for bit the Candle ops `(v.to_dtype(F32) · mul)`
/// (an affine) `.to_dtype(BF16).to_dtype(F32)` on a CUDA device (the indexer's head weights,
/// [`crate::attention::Indexer::head_weights`]). `v`: bf16 or f32 on a CUDA device; returns f32
/// of `v`'s shape.
pub fn scale_round_device(v: &Tensor, mul: f64) -> Result<Tensor> {
    let op = "scale_round_device";
    if !v.device().is_cuda() || !float_io(v.dtype()) {
        candle_core::bail!("{op}: v must be bf16 or f32 on a CUDA device, got {:?} on {:?}", v.dtype(), v.device())
    }
    let n = v.elem_count();
    if n == 0 {
        return Tensor::zeros(v.shape(), DType::F32, v.device());
    }
    let vc = v.contiguous()?;
    let (vs, vl) = vc.storage_and_layout();
    let vcu = as_cuda(&vs, "v")?;
    let cdev = vcu.device.clone();
    let stream = stream_for(vcu)?;
    let v_f32 = v.dtype() == DType::F32;
    // The kernel writes every element of the output (n > 0 here).
    let mut out = float_alloc(&cdev, n, true)?;
    {
        let (v_p, _gv) = float_read_ptr(vcu, vl, v_f32, &stream)?;
        let (out_p, _go) = float_write_ptr(&mut out, &Layout::contiguous(n), true, &stream)?;
        let params = ScaleRoundParams { v: v_p, out: out_p as *mut f32, n: n as i64, v_f32: v_f32 as i32, mul: mul as f32 };
        // SAFETY: v is read-locked, contiguous of n elements of the flagged dtype; out is a fresh
        // allocation of n f32; the launcher checks counts and pointers.
        let code = unsafe { dsv41_scale_round(&params, std::mem::size_of::<ScaleRoundParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop(vs);
    Ok(cuda_tensor(out, v.shape().clone()))
}

/// Whether [`engram_mix_device`] takes these dtypes and widths: `x` `[T, hc, d]` bf16 or f32 on a
/// CUDA device with `d ≤` [`ROW_NORM_MAX_N`], `kv` and `qk` f32 (their shapes are checked by the
/// call).
pub fn engram_mix_supported(x: &Tensor, kv: &Tensor, qk: &Tensor) -> bool {
    x.device().is_cuda()
        && float_io(x.dtype())
        && x.dims3().is_ok_and(|(_, _, d)| d <= ROW_NORM_MAX_N)
        && kv.dtype() == DType::F32
        && qk.dtype() == DType::F32
}

/// The Engram gate and residual on the GPU (`crate::model::engram::engram_mix`'s op sequence in
/// one launch, bit for bit on a CUDA device): per token and stream copy k, with `h = f32(x[t, k])`,
/// `key = kv[t, k·d ..][..d]`, `value = kv[t, hc·d ..][..d]`:
/// `dot = Σ h·qk[k]·key · rsqrt(mean(h²)+eps) · rsqrt(mean(key²)+eps) · (float)(1/√d)`,
/// `out = cast(h + σ(sign(dot)·√max(|dot|, clamp))·value)`.
///
/// `x`: `[T, hc, d]` bf16 or f32; `kv`: `[T, (hc+1)·d]` f32; `qk`: `[hc, d]` f32; all on one CUDA
/// device. Returns `[T, hc, d]` in `x`'s dtype.
pub fn engram_mix_device(x: &Tensor, kv: &Tensor, qk: &Tensor, eps: f64, clamp: f64) -> Result<Tensor> {
    let op = "engram_mix_device";
    let (t, hc, d) = x.dims3()?;
    if !engram_mix_supported(x, kv, qk) {
        candle_core::bail!(
            "{op}: x must be bf16 or f32 on a CUDA device with d <= {ROW_NORM_MAX_N} and kv / qk f32, got x {:?} {:?} on {:?}, kv {:?}, qk {:?}",
            x.dtype(),
            x.shape(),
            x.device(),
            kv.dtype(),
            qk.dtype()
        )
    }
    if kv.dims() != [t, (hc + 1) * d] || qk.dims() != [hc, d] {
        candle_core::bail!("{op}: kv {:?} / qk {:?} do not fit x {:?} (want [T, (hc+1)·d] and [hc, d])", kv.shape(), qk.shape(), x.shape())
    }
    let dev = x.device();
    if t == 0 {
        return Ok(x.clone());
    }
    let (xc, kc, qc) = (x.contiguous()?, kv.to_device(dev)?.contiguous()?, qk.to_device(dev)?.contiguous()?);
    let (xs, xl) = xc.storage_and_layout();
    let (ks, kl) = kc.storage_and_layout();
    let (qs, ql) = qc.storage_and_layout();
    let (xcu, kcu, qcu) = (as_cuda(&xs, "x")?, as_cuda(&ks, "kv")?, as_cuda(&qs, "qk")?);
    let cdev = xcu.device.clone();
    let stream = stream_for(xcu)?;
    let x_f32 = x.dtype() == DType::F32;
    // The kernel writes every element of the output (T > 0 here).
    let mut out = float_alloc(&cdev, t * hc * d, x_f32)?;
    {
        let (x_p, _gx) = float_read_ptr(xcu, xl, x_f32, &stream)?;
        let (k_p, _gk) = read_ptr::<f32>(kcu, kl, &stream)?;
        let (q_p, _gq) = read_ptr::<f32>(qcu, ql, &stream)?;
        let (out_p, _go) = float_write_ptr(&mut out, &Layout::contiguous((t, hc, d)), x_f32, &stream)?;
        let params = EngramMixParams {
            x: x_p,
            kv: k_p,
            qk: q_p,
            out: out_p,
            tokens: t as i64,
            hc: hc as i32,
            d: d as i32,
            x_f32: x_f32 as i32,
            mean_mul: (1.0 / d as f64) as f32,
            eps: eps as f32,
            dot_mul: (1.0 / (d as f64).sqrt()) as f32,
            clamp: clamp as f32,
            pad: 0,
        };
        // SAFETY: inputs are read-locked, contiguous of the checked shapes and dtypes; out is a
        // fresh allocation of T·hc·d elements; the launcher checks counts and pointers; the
        // guards order the launch on the storages' stream.
        let code = unsafe { dsv41_engram_mix(&params, std::mem::size_of::<EngramMixParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop((xs, ks, qs));
    Ok(cuda_tensor(out, (t, hc, d)))
}
