//! The tensor-core path of the routed MXFP4 experts (`kernels/moe_experts_gemm.cu`): the same two
//! grouped projections as the weight-streaming kernels behind [`super::moe_experts_device`]
//! (gate/up with the SwiGLU and the routing weight, down; same outputs, same combine) for many
//! slots per expert (prefill): bf16 `wgmma` over the weights decoded on chip and the Q1-quantized
//! activations, f32 accumulation over the whole input — the numerics of the dequantize + cuBLAS
//! path (only the f32 summation order differs from the CPU reference). [`MoeExpertsKernel`]
//! picks the kernel of a call; the host knows the token count, so the choice needs no read.

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{CudaStorage, Layout, Result, Tensor};

use super::device::{as_cuda, cuda_tensor, raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi::check_status;
use super::moe_experts::MoeExpertsParams;

/// [`MoeExpertsKernel::Auto`] takes the GEMM above this many slots per expert on average
/// (`T·k > 8·E`): the streaming kernels read an expert's weights once per 8 of its slots, the
/// GEMM once per 128.
pub const MOE_GEMM_MIN_AVG_SLOTS: usize = 8;

/// Which kernels run the two grouped projections of [`super::moe_experts_device_with`] (same
/// inputs, outputs and combine; the f32 summation order differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeExpertsKernel {
    /// By the load: [`MoeExpertsKernel::Gemm`] when `T·k > 8·E` (more than
    /// [`MOE_GEMM_MIN_AVG_SLOTS`] slots per expert on average: prefill), else
    /// [`MoeExpertsKernel::Stream`] (decode, small batches).
    #[default]
    Auto,
    /// The weight-streaming kernels (`kernels/moe_experts.cu`): chunks of up to 8 slots of an
    /// expert, `mma.sync` on the packed codes.
    Stream,
    /// The grouped GEMM (`kernels/moe_experts_gemm.cu`): tiles of up to 128 slots of an expert by
    /// 128 weight rows, `wgmma` over bf16 weights decoded in registers.
    Gemm,
}

impl MoeExpertsKernel {
    /// Whether this choice runs the GEMM for `tokens` tokens routed to `k` of `experts` experts.
    pub fn uses_gemm(self, tokens: usize, k: usize, experts: usize) -> bool {
        match self {
            MoeExpertsKernel::Auto => tokens.saturating_mul(k) > MOE_GEMM_MIN_AVG_SLOTS.saturating_mul(experts),
            MoeExpertsKernel::Stream => false,
            MoeExpertsKernel::Gemm => true,
        }
    }
}

/// `Dsv41MoeGemmFlagsParams` of `kernels/include/dsv41_moe_experts_gemm.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MoeGemmFlagsParams {
    gate_up: *const u64,
    down: *const u64,
    flags: *mut u32,
    num_experts: i32,
    hidden: i32,
    inter: i32,
    _pad: i32,
}

extern "C" {
    fn dsv41_moe_gemm_scratch_bytes(p: *const MoeExpertsParams, params_size: usize, bytes: *mut i64) -> i32;
    fn dsv41_moe_gemm(p: *const MoeExpertsParams, params_size: usize, flags: *const u32, stream: *mut c_void) -> i32;
    fn dsv41_moe_gemm_flags(p: *const MoeGemmFlagsParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// Scratch bytes of the GEMM launch of `p`.
pub(super) fn gemm_scratch_bytes(op: &str, p: &MoeExpertsParams) -> Result<i64> {
    let mut bytes = 0i64;
    // SAFETY: the launcher reads the parameter block (its size is passed) and writes `bytes`.
    check_status(op, unsafe { dsv41_moe_gemm_scratch_bytes(p, std::mem::size_of::<MoeExpertsParams>(), &mut bytes) })?;
    Ok(bytes)
}

/// Launches the GEMM form of the projection `p` on `stream` with the experts' `flags`
/// ([`scale_flags`], `[E]` u32 on the device).
///
/// # Safety
/// The pointers of `p` must be valid for the launch as for `dsv41_moe_experts` (the experts'
/// table, x, counts, order, weights, out, pos and a scratch of [`gemm_scratch_bytes`] bytes, all
/// on `stream`'s device and ordered on it) and `flags` must point to `E` u32 on that device.
pub(super) unsafe fn launch_gemm(op: &str, p: &MoeExpertsParams, flags: *const u32, stream: &CudaStream) -> Result<()> {
    // SAFETY: the caller's contract above; the launcher checks sizes, nulls and alignment.
    check_status(op, unsafe { dsv41_moe_gemm(p, std::mem::size_of::<MoeExpertsParams>(), flags, raw_stream(stream)) })
}

/// The GEMM path's per-expert flags (`[E]` u32 on the tables' device): bit 0 when `w1` or `w3`,
/// bit 1 when `w2` holds a 32-input block the bf16 tensor-core products would not multiply
/// exactly (scale byte 255, or nonzero codes under a scale byte outside 33..=128: a scale above
/// 2^1 or below 2^-94); those projections run the kernel's exact f32 path. `gate_up` / `down`: the
/// `[E, 4]` i64 address tables of [`super::GroupedExperts`]; `hidden`, `inter`: the experts'
/// dims. One launch over the scale bytes (codes read only under an out-of-range byte).
pub(super) fn scale_flags(gate_up: &Tensor, down: &Tensor, hidden: usize, inter: usize) -> Result<Tensor> {
    let op = "GroupedExperts::new (GEMM flags)";
    let e = gate_up.dim(0)?;
    let (gs, gl) = gate_up.storage_and_layout();
    let (ds, dl) = down.storage_and_layout();
    let gc = as_cuda(&gs, "gate_up table")?;
    let cdev = gc.device.clone();
    let stream = stream_for(gc)?;
    let mut flags = CudaStorage::wrap_cuda_slice(cdev.alloc_zeros::<u32>(e)?, cdev.clone());
    {
        let (g_p, _gg) = read_ptr::<i64>(gc, gl, &stream)?;
        let (d_p, _gd) = read_ptr::<i64>(as_cuda(&ds, "down table")?, dl, &stream)?;
        let (f_p, _gf) = write_ptr::<u32>(&mut flags, &Layout::contiguous(e), &stream)?;
        let params = MoeGemmFlagsParams {
            gate_up: g_p as *const u64,
            down: d_p as *const u64,
            flags: f_p,
            num_experts: e as i32,
            hidden: hidden as i32,
            inter: inter as i32,
            _pad: 0,
        };
        // SAFETY: the tables are contiguous [E, 4] i64 holding the addresses of each expert's
        // codes [rows, K/2] and scales [rows, K/32] (checked shapes, alive while the tables'
        // owner lives: the caller holds the weights); flags is a fresh zeroed [E] u32; the
        // launcher checks E and the dims; all ordered on the tables' stream.
        check_status(op, unsafe { dsv41_moe_gemm_flags(&params, std::mem::size_of::<MoeGemmFlagsParams>(), raw_stream(&stream)) })?;
    }
    Ok(cuda_tensor(flags, e))
}
