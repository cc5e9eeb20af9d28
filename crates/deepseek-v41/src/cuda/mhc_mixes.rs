//! One mHC sublayer's coefficients on the GPU in one launch (`kernels/mhc_mixes.cu`, spec §3.2
//! steps 1–8): the raw mixes `(x·fnᵀ)·rsqrt(mean(x²) + norm_eps)` and the pre / post / comb split
//! of [`super::split_sinkhorn_device`], instead of rms_scale, a cuBLAS product, a multiply and
//! the split (five to six launches and their allocations). [`crate::model::HcMix::mixes`] calls
//! it for CUDA streams that [`mhc_mixes_supported`] takes; the op sequence is its reference.
//!
//! Numerics: the split is bit for bit the op sequence's; the raw mixes' f32 sums run in the
//! kernel's own order (like cuBLAS's, not the CPU's), so results match the CPU reference within
//! the golden tolerance. A token's result depends on its row and `n` only, not on the batch.

use candle_core::{DType, Result, Tensor};

use super::device::{as_cuda, float_read_ptr, raw_stream, read_ptr, stream_for};
use super::mhc_sinkhorn::SplitOutputs;
use super::ffi;

/// Largest `hc` the kernel takes (`DSV41_MHC_MIXES_MAX_HC`).
pub const MHC_MIXES_MAX_HC: usize = 4;

/// Most bytes of `fn` the kernel re-reads over a call (`fn`'s bytes once per tile of four tokens)
/// before [`mhc_mixes_supported`] leaves the call to the op sequence (a cuBLAS product reads it
/// once): 64 MiB — every decode bucket and the embedded model's prefills; V4.1-Flash prefills of
/// more than 170 tokens go to cuBLAS.
pub const MHC_MIXES_MAX_FN_TRAFFIC: usize = 64 << 20;

/// Whether [`mhc_mixes_device`] takes the stream rows `x` `[T, n]` with `hc` copies: bf16 or f32
/// on a CUDA device, `1 ≤ hc ≤` [`MHC_MIXES_MAX_HC`], `n < 2³¹`, and `fn` re-read at most
/// [`MHC_MIXES_MAX_FN_TRAFFIC`] bytes.
pub fn mhc_mixes_supported(x: &Tensor, hc: usize) -> bool {
    let Ok((t, n)) = x.dims2() else { return false };
    let fn_bytes = (2 + hc) * hc * n * 4;
    x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F32)
        && (1..=MHC_MIXES_MAX_HC).contains(&hc)
        && (1..=i32::MAX as usize).contains(&n)
        && t.div_ceil(4).saturating_mul(fn_bytes) <= MHC_MIXES_MAX_FN_TRAFFIC
}

/// `(pre [T, hc], post [T, hc], comb [T, hc, hc])` f32 of the stream rows `x` `[T, n]` (bf16 or
/// f32 on a CUDA device, `n = hc·D`) with the mixing weights `func` `[(2+hc)·hc, n]`, `scale`
/// `[3]` and `base` `[(2+hc)·hc]` (any float dtype, used as f32), `iters` Sinkhorn iterations,
/// `eps` (hc_eps) inside every division and `norm_eps` (rms_norm_eps) in the rsqrt — the
/// semantics of [`crate::model::HcMix::mixes`]. `splits`: CTAs sharing one row (`None`: the
/// kernel's choice, `ceil(n / 2048)` at most 8; `Some(s)`, `1 ≤ s ≤ min(8, n)`, for tests).
#[allow(clippy::too_many_arguments)]
pub fn mhc_mixes_device(
    x: &Tensor,
    func: &Tensor,
    scale: &Tensor,
    base: &Tensor,
    hc: usize,
    iters: usize,
    eps: f64,
    norm_eps: f64,
    splits: Option<usize>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "mhc_mixes_device";
    let (t, n) = x.dims2()?;
    let width = (2 + hc) * hc;
    if !x.device().is_cuda() || !matches!(x.dtype(), DType::BF16 | DType::F32) {
        candle_core::bail!("{op}: x must be bf16 or f32 on a CUDA device, got {:?} on {:?}", x.dtype(), x.device())
    }
    if !(1..=MHC_MIXES_MAX_HC).contains(&hc) || n == 0 || n > i32::MAX as usize || iters == 0 || iters > i32::MAX as usize {
        candle_core::bail!("{op}: x {:?} with hc {hc} (1..={MHC_MIXES_MAX_HC}) and iters {iters} (>= 1)", x.shape())
    }
    if func.dims() != [width, n] || scale.dims() != [3] || base.dims() != [width] {
        candle_core::bail!(
            "{op}: fn {:?} (want [{width}, {n}]), scale {:?} (want [3]), base {:?} (want [{width}])",
            func.shape(),
            scale.shape(),
            base.shape()
        )
    }
    let splits = match splits {
        None => 0,
        Some(s) if (1..=8.min(n)).contains(&s) => s as i32,
        Some(s) => candle_core::bail!("{op}: splits {s} must be 1..={}", 8.min(n)),
    };
    let dev = x.device();
    if t == 0 {
        return SplitOutputs::empty(dev, hc);
    }
    let f32c = |v: &Tensor| -> Result<Tensor> { v.to_device(dev)?.to_dtype(DType::F32)?.contiguous() };
    let (xc, func, scale, base) = (x.contiguous()?, f32c(func)?, f32c(scale)?, f32c(base)?);
    let (xs, xl) = xc.storage_and_layout();
    let (fs, fl) = func.storage_and_layout();
    let (ss, sl) = scale.storage_and_layout();
    let (bs, bl) = base.storage_and_layout();
    let (xcu, fc, sc, bc) = (as_cuda(&xs, "x")?, as_cuda(&fs, "fn")?, as_cuda(&ss, "scale")?, as_cuda(&bs, "base")?);
    let main = stream_for(xcu)?;
    let mut outs = SplitOutputs::new(&xcu.device, t, hc)?;
    // Inside a SideStream::run: on the side stream, after everything enqueued so far (the
    // outputs' allocations included).
    let side = super::side_stream::side_launch_stream(&main)?;
    if side.is_some() {
        // What the side kernel reads stays allocated until the join.
        super::side_stream::side_keep(Box::new((xc.clone(), func.clone(), scale.clone(), base.clone())));
    }
    let stream = side.unwrap_or(main);
    {
        let is_f32 = x.dtype() == DType::F32;
        let (x_p, _gx) = float_read_ptr(xcu, xl, is_f32, &stream)?;
        let (f_p, _g1) = read_ptr::<f32>(fc, fl, &stream)?;
        let (s_p, _g2) = read_ptr::<f32>(sc, sl, &stream)?;
        let (b_p, _g3) = read_ptr::<f32>(bc, bl, &stream)?;
        let ([pre_p, post_p, comb_p], _gw) = outs.write_ptrs(&stream)?;
        let params = ffi::MhcMixesParams {
            x: x_p,
            func: f_p,
            scale: s_p,
            base: b_p,
            pre: pre_p,
            post: post_p,
            comb: comb_p,
            tokens: t as i64,
            n: n as i32,
            hc: hc as i32,
            iters: iters as i32,
            x_f32: is_f32 as i32,
            splits,
            eps: eps as f32,
            norm_eps: norm_eps as f32,
            reserved: 0,
        };
        // SAFETY: inputs are read-locked and contiguous in the checked shapes and dtypes; outputs
        // are fresh allocations of T·hc / T·hc² f32; the launcher checks counts and pointers; the
        // guards order the launch on the storages' stream (a side stream waits for that stream
        // first, and its caller joins before reading the outputs: SideStream).
        let code = unsafe { ffi::dsv41_mhc_mixes(&params, std::mem::size_of::<ffi::MhcMixesParams>(), raw_stream(&stream)) };
        ffi::check_status(op, code)?;
    }
    drop((xs, fs, ss, bs));
    Ok(outs.tensors())
}
