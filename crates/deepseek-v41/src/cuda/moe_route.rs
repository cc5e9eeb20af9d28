//! The MoE router's decision and the token sort for a grouped expert kernel on the GPU
//! (`kernels/moe_route.cu`, spec §8 steps 1–4): from the router logits `[T, E]` to the chosen
//! experts, their weights and the slots grouped by expert, all on the device, no host read. The
//! CPU reference is [`crate::model::moe_route_ref`] (`tests/cuda_moe_route.rs`);
//! [`crate::model::Gate::route`] calls it inside [`super::with_device_routing`].

use std::ffi::c_void;

use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor};

use super::device::{as_cuda, cuda_tensor, raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi::check_status;

/// Largest number of experts `E` the kernel takes (`DSV41_MOE_ROUTE_MAX_EXPERTS`).
pub const MOE_ROUTE_MAX_EXPERTS: usize = 512;
/// Largest `k` the kernel takes (`DSV41_MOE_ROUTE_MAX_K`).
pub const MOE_ROUTE_MAX_K: usize = 16;

/// `Dsv41MoeRouteParams` of `kernels/include/dsv41_moe_route.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MoeRouteParams {
    /// `[T, E]` f32, contiguous.
    logits: *const f32,
    /// `[E]` f32.
    bias: *const f32,
    /// `[T, k]` u32 out.
    ids: *mut u32,
    /// `[T, k]` f32 out.
    weights: *mut f32,
    /// `[E]` u32 out.
    counts: *mut u32,
    /// `[E + 1]` u32 out.
    offsets: *mut u32,
    /// `[T·k]` u32 out.
    order: *mut u32,
    num_tokens: i64,
    num_experts: i32,
    k: i32,
    temp_scale: f32,
    route_scale: f32,
    apply_temp: i32,
    _pad: i32,
}

extern "C" {
    fn dsv41_moe_route(p: *const MoeRouteParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// The routing decision of `T` tokens and its sort by expert, on the device of the logits.
#[derive(Debug, Clone)]
pub struct DeviceRouting {
    /// `[T, k]` u32: each token's experts in descending `score + bias` order, equal values by the
    /// lower expert id (the order of [`crate::model::Routing::ids`]).
    pub ids: Tensor,
    /// `[T, k]` f32: `score_e / (Σ_selected score + 1e-20) · route_scale`, from the unbiased
    /// scores.
    pub weights: Tensor,
    /// `[E]` u32: how many slots chose each expert.
    pub counts: Tensor,
    /// `[E + 1]` u32: exclusive prefix sum of `counts` (`offsets[E]` = `T·k`).
    pub offsets: Tensor,
    /// `[T·k]` u32: the slots `t·k + j` grouped by expert ascending, ascending within an expert
    /// (expert `e`'s slots are `order[offsets[e]..offsets[e + 1]]`).
    pub order: Tensor,
}

/// Whether [`moe_route_device`] takes `n_experts` experts and `k` per token.
pub fn moe_route_supported(n_experts: usize, k: usize) -> bool {
    (1..=MOE_ROUTE_MAX_EXPERTS).contains(&n_experts) && (1..=n_experts.min(MOE_ROUTE_MAX_K)).contains(&k)
}

/// The MoE router of spec §8 on the device: scores `s = sqrt(softplus(l · f32(1 / temp) + 0))`
/// (the scaling only when `temp != 1`, as `model::Gate` divides), top-`k` of `s + bias` (ties:
/// lower expert id), weights from the unbiased scores, and the slots sorted by expert — what
/// [`crate::model::moe_route_ref`] computes on the host (`kernels/moe_route.cu` for the numerics:
/// the softplus is correctly rounded where the host's libm may differ by an ulp).
///
/// `logits`: `[T, E]` f32 on a CUDA device, `E` in `1..=`[`MOE_ROUTE_MAX_EXPERTS`]; `bias`: `[E]`
/// f32 on the same device (both made contiguous); `k` in
/// `1..=min(E, `[`MOE_ROUTE_MAX_K`]`)`; `temp` finite and > 0 with a finite non-zero `1 / temp`;
/// `route_scale` finite; `T·k < 2^31`. One kernel launch for up to 8 tokens, two beyond.
pub fn moe_route_device(logits: &Tensor, bias: &Tensor, k: usize, temp: f32, route_scale: f32) -> Result<DeviceRouting> {
    let op = "moe_route_device";
    if logits.rank() != 2 || logits.dtype() != DType::F32 || !logits.device().is_cuda() {
        candle_core::bail!(
            "{op}: logits must be [T, E] f32 on a CUDA device, got {:?} {:?} on {:?}",
            logits.dtype(),
            logits.shape(),
            logits.device()
        )
    }
    let (t, e) = logits.dims2()?;
    if !(1..=MOE_ROUTE_MAX_EXPERTS).contains(&e) {
        candle_core::bail!("{op}: logits have E = {e} experts; the kernel takes 1..={MOE_ROUTE_MAX_EXPERTS}")
    }
    if bias.dims() != [e] || bias.dtype() != DType::F32 || !bias.device().same_device(logits.device()) {
        candle_core::bail!(
            "{op}: bias must be [{e}] f32 on the logits' device, got {:?} {:?} on {:?}",
            bias.dtype(),
            bias.shape(),
            bias.device()
        )
    }
    if !moe_route_supported(e, k) {
        candle_core::bail!("{op}: k = {k} not in 1..={} (E = {e}, at most {MOE_ROUTE_MAX_K})", e.min(MOE_ROUTE_MAX_K))
    }
    let temp_scale = (1.0 / temp as f64) as f32;
    if !temp.is_finite() || temp <= 0.0 || !temp_scale.is_finite() || temp_scale == 0.0 {
        candle_core::bail!("{op}: temp must be finite and > 0 with a finite, non-zero 1 / temp, got {temp}")
    }
    if !route_scale.is_finite() {
        candle_core::bail!("{op}: route_scale must be finite, got {route_scale}")
    }
    if t.checked_mul(k).is_none_or(|n| n >= 1 << 31) {
        candle_core::bail!("{op}: T·k = {t}·{k} slots must be below 2^31 (u32 slot indices); route fewer tokens per call")
    }
    let dev = logits.device();
    if t == 0 {
        let z = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, dev);
        return Ok(DeviceRouting {
            ids: z(&[0, k], DType::U32)?,
            weights: z(&[0, k], DType::F32)?,
            counts: z(&[e], DType::U32)?,
            offsets: z(&[e + 1], DType::U32)?,
            order: z(&[0], DType::U32)?,
        });
    }
    let (logits, bias) = (logits.contiguous()?, bias.contiguous()?);
    let (ls, ll) = logits.storage_and_layout();
    let (bs, bl) = bias.storage_and_layout();
    let (lc, bc) = (as_cuda(&ls, "logits")?, as_cuda(&bs, "bias")?);
    let cdev = lc.device.clone();
    let stream = stream_for(lc)?;
    // SAFETY (both): the kernel writes every element of the outputs (T >= 1 here).
    let alloc_u32 = |n: usize| -> Result<CudaStorage> { Ok(CudaStorage::wrap_cuda_slice(unsafe { cdev.alloc::<u32>(n)? }, cdev.clone())) };
    let alloc_f32 = |n: usize| -> Result<CudaStorage> { Ok(CudaStorage::wrap_cuda_slice(unsafe { cdev.alloc::<f32>(n)? }, cdev.clone())) };
    let (s_tk, s_e, s_e1, s_n): (Shape, Shape, Shape, Shape) = ((t, k).into(), e.into(), (e + 1).into(), (t * k).into());
    let (mut ids, mut weights) = (alloc_u32(t * k)?, alloc_f32(t * k)?);
    let (mut counts, mut offsets, mut order) = (alloc_u32(e)?, alloc_u32(e + 1)?, alloc_u32(t * k)?);
    {
        let (l_p, _g0) = read_ptr::<f32>(lc, ll, &stream)?;
        let (b_p, _g1) = read_ptr::<f32>(bc, bl, &stream)?;
        let (ids_p, _g2) = write_ptr::<u32>(&mut ids, &Layout::contiguous(&s_tk), &stream)?;
        let (w_p, _g3) = write_ptr::<f32>(&mut weights, &Layout::contiguous(&s_tk), &stream)?;
        let (c_p, _g4) = write_ptr::<u32>(&mut counts, &Layout::contiguous(&s_e), &stream)?;
        let (o_p, _g5) = write_ptr::<u32>(&mut offsets, &Layout::contiguous(&s_e1), &stream)?;
        let (ord_p, _g6) = write_ptr::<u32>(&mut order, &Layout::contiguous(&s_n), &stream)?;
        let params = MoeRouteParams {
            logits: l_p,
            bias: b_p,
            ids: ids_p,
            weights: w_p,
            counts: c_p,
            offsets: o_p,
            order: ord_p,
            num_tokens: t as i64,
            num_experts: e as i32,
            k: k as i32,
            temp_scale,
            route_scale,
            apply_temp: (temp != 1.0) as i32,
            _pad: 0,
        };
        // SAFETY: logits and bias are read-locked, contiguous f32 of the checked shapes; the
        // outputs are fresh allocations of the sizes above; the launcher checks the counts and
        // pointers; the guards order the launches on the storages' stream.
        let code = unsafe { dsv41_moe_route(&params, std::mem::size_of::<MoeRouteParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop((ls, bs));
    Ok(DeviceRouting {
        ids: cuda_tensor(ids, s_tk.clone()),
        weights: cuda_tensor(weights, s_tk),
        counts: cuda_tensor(counts, s_e),
        offsets: cuda_tensor(offsets, s_e1),
        order: cuda_tensor(order, s_n),
    })
}
