//! The routed MXFP4 experts of one MoE layer on the GPU in three grouped launches
//! (`kernels/moe_experts.cu`, spec §8): gate/up with the SwiGLU and the routing weight, down, and
//! the combine with the shared expert's output — whatever the number of tokens, over the packed
//! codes as loaded (no expert dequantized), with the routing of [`super::moe_route_device`] and
//! no host read. The two projections run the weight-streaming kernels (decode) or the
//! tensor-core GEMM of [`super::moe_experts_gemm`] (prefill), [`MoeExpertsKernel`]. The CPU
//! reference is the per-expert loop of [`crate::model::Moe::forward`] (`tests/cuda_moe_experts.rs`,
//! `tests/cuda_moe_experts_gemm.rs`).

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::{DType, Layout, Result, Tensor};
use half::bf16;

use super::device::{as_cuda, cuda_tensor, float_alloc, float_write_ptr, raw_stream, read_ptr, stream_for};
use super::ffi::check_status;
use super::moe_experts_gemm::{gemm_scratch_bytes, launch_gemm, scale_flags, MoeExpertsKernel};
use super::moe_route::DeviceRouting;
use crate::quant::Mxfp4Weight;

/// Largest number of experts the kernels take (`DSV41_MOE_EXPERTS_MAX_E`).
pub const MOE_EXPERTS_MAX_E: usize = 512;
/// Largest `k` the combine takes.
pub const MOE_EXPERTS_MAX_K: usize = 16;
/// Largest input width (`hidden` for gate/up, `inter` for down) the kernels take
/// (`DSV41_MOE_EXPERTS_MAX_KDIM`: a chunk's activations stay in shared memory).
pub const MOE_EXPERTS_MAX_KDIM: usize = 5120;

const MODE_GATE_UP: i32 = 0;
const MODE_DOWN: i32 = 1;

/// `Dsv41MoeExpertsParams` of `kernels/include/dsv41_moe_experts.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct MoeExpertsParams {
    experts: *const u64,
    x: *const c_void,
    counts: *const u32,
    order: *const u32,
    route_w: *const f32,
    out: *mut c_void,
    pos: *mut u32,
    scratch: *mut c_void,
    scratch_bytes: i64,
    num_tokens: i64,
    num_experts: i32,
    k: i32,
    n: i32,
    kdim: i32,
    mode: i32,
    limit: f32,
}

/// `Dsv41MoeCombineParams` of `kernels/include/dsv41_moe_experts.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MoeCombineParams {
    y: *const c_void,
    ids: *const u32,
    pos: *const u32,
    shared: *const c_void,
    out: *mut c_void,
    num_tokens: i64,
    k: i32,
    d: i32,
}

extern "C" {
    fn dsv41_moe_experts_scratch_bytes(p: *const MoeExpertsParams, params_size: usize, bytes: *mut i64) -> i32;
    fn dsv41_moe_experts(p: *const MoeExpertsParams, params_size: usize, stream: *mut c_void) -> i32;
    fn dsv41_moe_combine(p: *const MoeCombineParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// The routed experts of one layer as the grouped kernels read them: device tables of the
/// addresses of every expert's packed `w1`, `w3` and `w2` (codes and scales). Holds clones of
/// the weights, so the addresses stay valid as long as this lives.
#[derive(Debug, Clone)]
pub struct GroupedExperts {
    /// `[E, 4]` i64: w1 codes, w1 scales, w3 codes, w3 scales.
    gate_up: Tensor,
    /// `[E, 4]` i64: w2 codes, w2 scales, 0, 0.
    down: Tensor,
    /// `[E]` u32: the experts whose projections the GEMM runs on its exact path
    /// ([`super::moe_experts_gemm`]).
    gemm_flags: Tensor,
    /// The weights behind the addresses.
    weights: Vec<[Mxfp4Weight; 3]>,
    hidden: usize,
    inter: usize,
}

impl GroupedExperts {
    /// From each expert's `[w1, w3, w2]` (`w1`, `w3` `[inter, hidden]`, `w2` `[hidden, inter]`,
    /// all MXFP4 on one CUDA device). Errors, naming the expert, on other shapes or devices, on
    /// more than [`MOE_EXPERTS_MAX_E`] experts, or when a tensor is not where the kernels' copies
    /// can read it (codes 16-byte aligned, scales 4-byte aligned when `K / 32` is a multiple of 4).
    pub fn new(experts: Vec<[Mxfp4Weight; 3]>) -> Result<Self> {
        let op = "GroupedExperts::new";
        let Some(first) = experts.first() else { candle_core::bail!("{op}: no experts") };
        if experts.len() > MOE_EXPERTS_MAX_E {
            candle_core::bail!("{op}: {} experts, the kernels take at most {MOE_EXPERTS_MAX_E}", experts.len())
        }
        let (inter, hidden) = first[0].dims();
        if inter > MOE_EXPERTS_MAX_KDIM || hidden > MOE_EXPERTS_MAX_KDIM {
            candle_core::bail!("{op}: expert dims [{inter}, {hidden}]: the kernels take widths up to {MOE_EXPERTS_MAX_KDIM}")
        }
        let dev = first[0].device().clone();
        if !dev.is_cuda() {
            candle_core::bail!("{op}: the experts must be on a CUDA device, got {dev:?}")
        }
        let mut gate_up = Vec::with_capacity(experts.len() * 4);
        let mut down = Vec::with_capacity(experts.len() * 4);
        for (e, [w1, w3, w2]) in experts.iter().enumerate() {
            let want = [(inter, hidden), (inter, hidden), (hidden, inter)];
            for (w, (name, want)) in [w1, w3, w2].into_iter().zip(["w1", "w3", "w2"].into_iter().zip(want)) {
                if w.dims() != want {
                    candle_core::bail!("{op}: expert {e} {name} is {:?}, expected {want:?} like expert 0", w.dims())
                }
                if !w.device().same_device(&dev) {
                    candle_core::bail!("{op}: expert {e} {name} is on {:?}, expert 0 on {dev:?}", w.device())
                }
            }
            for (i, w) in [w1, w3, w2].into_iter().enumerate() {
                let (c, s) = (address(w.codes())?, address(w.scales())?);
                let k = w.dims().1;
                if c % 16 != 0 || ((k / 32) % 4 == 0 && s % 4 != 0) {
                    candle_core::bail!("{op}: expert {e}: codes at {c:#x} / scales at {s:#x} are not 16- / 4-byte aligned; load the experts unsliced")
                }
                if i < 2 { &mut gate_up } else { &mut down }.extend([c as i64, s as i64]);
            }
            down.extend([0i64, 0]);
        }
        let n = experts.len();
        let (gate_up, down) = (Tensor::from_vec(gate_up, (n, 4), &dev)?, Tensor::from_vec(down, (n, 4), &dev)?);
        Ok(Self {
            gemm_flags: scale_flags(&gate_up, &down, hidden, inter)?,
            gate_up,
            down,
            weights: experts,
            hidden,
            inter,
        })
    }

    /// Number of experts.
    pub fn len(&self) -> usize {
        self.weights.len()
    }

    /// Whether there are no experts (never: [`GroupedExperts::new`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.weights.is_empty()
    }

    /// `(hidden, inter)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.hidden, self.inter)
    }
}

/// The device address of a contiguous u8 tensor's first element.
fn address(t: &Tensor) -> Result<u64> {
    let (s, l) = t.storage_and_layout();
    let c = as_cuda(&s, "expert weight")?;
    let stream = stream_for(c)?;
    let slice = c.as_cuda_slice::<u8>()?;
    let (base, _guard) = slice.device_ptr(&stream);
    Ok(base + l.start_offset() as u64)
}

/// What [`moe_experts_device`] computes, with its intermediates (for tests).
#[derive(Debug, Clone)]
pub struct MoeExpertsOutput {
    /// `[T, D]` bf16: the MoE output (routed experts plus the shared expert's output).
    pub out: Tensor,
    /// `[T·k, inter]` bf16: the SwiGLU activations (times the routing weight) of the slots in
    /// expert order (`routing.order`).
    pub act: Tensor,
    /// `[T·k, D]` bf16: each slot's expert output, in expert order.
    pub y: Tensor,
}

/// The routed experts of one layer for `x` `[T, D]` bf16 (contiguous, on the experts' device)
/// with the routing of [`super::moe_route_device`] (k experts per token): per slot the clamped
/// SwiGLU of `w1`/`w3` (limit `L`, none when `None`) times its weight, `w2`, and the f32 sum per
/// token in expert-id order plus `shared` (`[T, D]` bf16, the shared expert's output, or none),
/// rounded to bf16 — [`crate::model::Moe::forward`]'s sequence with the FP8 activation
/// quantization of every expert linear. Up to 8 slots per expert on average an expert's slots
/// run in chunks of 8 (each chunk streams the expert's weights once: decode, small batches),
/// above in tiles of up to 128 on the tensor cores (prefill; [`MoeExpertsKernel::Auto`]). Five
/// launches, no host read.
pub fn moe_experts_device(
    x: &Tensor,
    routing: &DeviceRouting,
    experts: &GroupedExperts,
    limit: Option<f32>,
    shared: Option<&Tensor>,
) -> Result<MoeExpertsOutput> {
    moe_experts_device_with(x, routing, experts, limit, shared, MoeExpertsKernel::Auto)
}

/// [`moe_experts_device`] with the kernels of the two projections chosen by `kernel` (tests and
/// benchmarks compare them on the same routing).
pub fn moe_experts_device_with(
    x: &Tensor,
    routing: &DeviceRouting,
    experts: &GroupedExperts,
    limit: Option<f32>,
    shared: Option<&Tensor>,
    kernel: MoeExpertsKernel,
) -> Result<MoeExpertsOutput> {
    moe_experts_device_joined(x, routing, experts, limit, shared, kernel, &mut || Ok(()))
}

/// [`moe_experts_device_with`] calling `before_combine` after the experts' launches, right before
/// the combine reads `shared`: where the shared expert runs on a [`super::SideStream`], the join.
pub(crate) fn moe_experts_device_joined(
    x: &Tensor,
    routing: &DeviceRouting,
    experts: &GroupedExperts,
    limit: Option<f32>,
    shared: Option<&Tensor>,
    kernel: MoeExpertsKernel,
    before_combine: &mut dyn FnMut() -> Result<()>,
) -> Result<MoeExpertsOutput> {
    let op = "moe_experts_device";
    let (t, d) = x.dims2()?;
    let (hidden, inter) = experts.dims();
    if x.dtype() != DType::BF16 || d != hidden || !x.device().same_device(experts.gate_up.device()) {
        candle_core::bail!("{op}: x must be [T, {hidden}] bf16 on the experts' device, got {:?} {:?} on {:?}", x.dtype(), x.shape(), x.device())
    }
    let (rt, k) = routing.ids.dims2()?;
    let e = experts.len();
    if rt != t || routing.counts.dims() != [e] || routing.order.dims() != [t * k] || routing.weights.dims() != [t, k] {
        candle_core::bail!(
            "{op}: routing of {rt} tokens x {k} over {:?} experts does not match x [{t}, {d}] and {e} experts",
            routing.counts.dims()
        )
    }
    if !(1..=MOE_EXPERTS_MAX_K).contains(&k) {
        candle_core::bail!("{op}: k = {k} not in 1..={MOE_EXPERTS_MAX_K}")
    }
    if let Some(s) = shared {
        if s.dims() != [t, d] || s.dtype() != DType::BF16 {
            candle_core::bail!("{op}: shared must be [{t}, {d}] bf16, got {:?} {:?}", s.dtype(), s.shape())
        }
    }
    let limit = limit.unwrap_or(0.0);
    if limit.is_nan() {
        candle_core::bail!("{op}: the SwiGLU limit is NaN")
    }
    let s = t * k;
    if t == 0 {
        let z = |shape: (usize, usize)| Tensor::zeros(shape, DType::BF16, x.device());
        return Ok(MoeExpertsOutput { out: z((0, d))?, act: z((0, inter))?, y: z((0, d))? });
    }
    let x = x.contiguous()?;
    let (ids, weights, counts, order) =
        (routing.ids.contiguous()?, routing.weights.contiguous()?, routing.counts.contiguous()?, routing.order.contiguous()?);
    let shared = shared.map(|s| s.contiguous()).transpose()?;

    let (xs, xl) = x.storage_and_layout();
    let xc = as_cuda(&xs, "x")?;
    let cdev = xc.device.clone();
    let stream = stream_for(xc)?;
    let base = MoeExpertsParams {
        experts: std::ptr::null(),
        x: std::ptr::null(),
        counts: std::ptr::null(),
        order: std::ptr::null(),
        route_w: std::ptr::null(),
        out: std::ptr::null_mut(),
        pos: std::ptr::null_mut(),
        scratch: std::ptr::null_mut(),
        scratch_bytes: 0,
        num_tokens: t as i64,
        num_experts: e as i32,
        k: k as i32,
        n: 0,
        kdim: 0,
        mode: 0,
        limit,
    };
    let size = std::mem::size_of::<MoeExpertsParams>();
    let gemm = kernel.uses_gemm(t, k, e);
    let scratch_for = |p: &MoeExpertsParams| -> Result<i64> {
        if gemm {
            return gemm_scratch_bytes(op, p);
        }
        let mut bytes = 0i64;
        // SAFETY: the launcher reads the parameter block (its size is passed) and writes `bytes`.
        check_status(op, unsafe { dsv41_moe_experts_scratch_bytes(p, size, &mut bytes) })?;
        Ok(bytes)
    };
    let gu_params = MoeExpertsParams { n: inter as i32, kdim: hidden as i32, mode: MODE_GATE_UP, ..base };
    let dn_params = MoeExpertsParams { n: hidden as i32, kdim: inter as i32, mode: MODE_DOWN, ..base };
    let bytes = scratch_for(&gu_params)?.max(scratch_for(&dn_params)?);
    // Per-call buffers: cudarc allocates stream-ordered (`cuMemAllocAsync`, freed by `cuMemFreeAsync`,
    // on devices with memory pools such as the H100 / H200), so no host synchronization and a call
    // can be captured into a CUDA graph (`examples/bench_moe_experts.rs` times it that way).
    // SAFETY (all allocations): written by the kernels before they are read — act, y, pos and out
    // in full (every slot belongs to one expert), the scratch by each launch's prep kernel.
    let mut act = float_alloc(&cdev, s * inter, false)?;
    let mut y = float_alloc(&cdev, s * d, false)?;
    let mut out = float_alloc(&cdev, t * d, false)?;
    let mut pos = unsafe { cdev.alloc::<u32>(s)? };
    let mut scratch = unsafe { cdev.alloc::<u8>(bytes.max(1) as usize)? };
    {
        let (gs, gl) = experts.gate_up.storage_and_layout();
        let (ds, dl) = experts.down.storage_and_layout();
        let (is_, il) = ids.storage_and_layout();
        let (ws, wl) = weights.storage_and_layout();
        let (cs, cl) = counts.storage_and_layout();
        let (os, ol) = order.storage_and_layout();
        let (fs, fl) = experts.gemm_flags.storage_and_layout();
        let (x_p, _gx) = read_ptr::<bf16>(xc, xl, &stream)?;
        let (g_p, _gg) = read_ptr::<i64>(as_cuda(&gs, "gate_up table")?, gl, &stream)?;
        let (d_p, _gd) = read_ptr::<i64>(as_cuda(&ds, "down table")?, dl, &stream)?;
        let (i_p, _gi) = read_ptr::<u32>(as_cuda(&is_, "ids")?, il, &stream)?;
        let (w_p, _gw) = read_ptr::<f32>(as_cuda(&ws, "weights")?, wl, &stream)?;
        let (c_p, _gc) = read_ptr::<u32>(as_cuda(&cs, "counts")?, cl, &stream)?;
        let (o_p, _go) = read_ptr::<u32>(as_cuda(&os, "order")?, ol, &stream)?;
        let (f_p, _gf) = read_ptr::<u32>(as_cuda(&fs, "GEMM flags")?, fl, &stream)?;
        let (act_p, _ga) = float_write_ptr(&mut act, &Layout::contiguous((s, inter)), false, &stream)?;
        let (y_p, _gy) = float_write_ptr(&mut y, &Layout::contiguous((s, d)), false, &stream)?;
        let (out_p, _gout) = float_write_ptr(&mut out, &Layout::contiguous((t, d)), false, &stream)?;
        let (pos_p, _gp) = pos.device_ptr_mut(&stream);
        let (scr_p, _gs) = scratch.device_ptr_mut(&stream);
        let shared_lock = shared.as_ref().map(|s| s.storage_and_layout());
        let (sh_p, _gsh) = match &shared_lock {
            Some((ss, sl)) => {
                let (p, g) = read_ptr::<bf16>(as_cuda(ss, "shared")?, sl, &stream)?;
                (p as *const c_void, Some(g))
            }
            None => (std::ptr::null(), None),
        };
        let common = |p: MoeExpertsParams| MoeExpertsParams {
            counts: c_p,
            order: o_p,
            scratch: scr_p as *mut c_void,
            scratch_bytes: bytes,
            ..p
        };
        let gu = MoeExpertsParams {
            experts: g_p as *const u64,
            x: x_p as *const c_void,
            route_w: w_p,
            out: act_p,
            pos: pos_p as *mut u32,
            ..common(gu_params)
        };
        let dn = MoeExpertsParams { experts: d_p as *const u64, x: act_p as *const c_void, out: y_p, ..common(dn_params) };
        let comb = MoeCombineParams {
            y: y_p as *const c_void,
            ids: i_p,
            pos: pos_p as *const u32,
            shared: sh_p,
            out: out_p,
            num_tokens: t as i64,
            k: k as i32,
            d: d as i32,
        };
        // SAFETY: every input is read-locked and contiguous with the checked shapes (x [T, D],
        // ids / weights [T, k], counts [E], order [T·k], shared [T, D]); the tables hold the
        // addresses of the experts' codes and scales with the checked shapes, alive as long as
        // `experts`; act, y, pos, out and the scratch are fresh buffers of the sizes the
        // launchers ask for; the GEMM flags are the experts' [E] u32; the launchers check sizes
        // and alignment; all run in order on the storages' stream.
        unsafe {
            if gemm {
                launch_gemm(op, &gu, f_p, &stream)?;
                launch_gemm(op, &dn, f_p, &stream)?;
            } else {
                check_status(op, dsv41_moe_experts(&gu, size, raw_stream(&stream)))?;
                check_status(op, dsv41_moe_experts(&dn, size, raw_stream(&stream)))?;
            }
            before_combine()?;
            check_status(op, dsv41_moe_combine(&comb, std::mem::size_of::<MoeCombineParams>(), raw_stream(&stream)))?;
        }
    }
    drop(xs);
    Ok(MoeExpertsOutput {
        out: cuda_tensor(out, (t, d)),
        act: cuda_tensor(act, (s, inter)),
        y: cuda_tensor(y, (s, d)),
    })
}
