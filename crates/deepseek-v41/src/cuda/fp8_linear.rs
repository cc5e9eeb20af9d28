//! The block-scaled FP8 linear on the GPU (`kernels/fp8_linear.cu`, issue 21): `x · Wᵀ` with
//! the weight kept as e4m3 codes and e8m0 32×32 block scales ([`Fp8Weight`]), the reference's
//! numerics ([`crate::quant::fp8_linear_ref`]: FP8 activation quantization per 1×32 block when
//! on, f32 accumulation, bf16 output) up to the order of the f32 summation
//! (`tests/cuda_fp8_linear.rs`).
//!
//! Three paths ([`Fp8LinearPath`]):
//! * `Stream` (m <= [`FP8_STREAM_MAX_M`], [`Fp8StreamVariant`]): the weight-streaming kernel — every weight byte read
//!   once from HBM into registers, tensor-core products with the block scales applied in f32
//!   (design in the kernel's header comment). Decode and small prefills.
//! * `Dequant`: the weight dequantized into a bf16 scratch by one kernel, then Candle's cuBLAS
//!   bf16 matmul over the activation-quantized input (today's [`crate::nn::Linear`] on CUDA,
//!   with the weight at rest in FP8). Large prefills.
//! * `Gemm` (`kernels/fp8_gemm.cu`): an FP8 `wgmma` GEMM over the activation-quantized input
//!   with the block scales applied per k32 block in f32; needs the activation quantization and K
//!   a multiple of 128 (else `Dequant`). Large prefills; explicit only until measured.
//!
//! [`fp8_linear`] picks the path by m; [`fp8_linear_with`] forces one (tests, benchmarks).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::sys::CUstreamCaptureStatus;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::{DType, Layout, Result, Tensor};
use half::bf16;

use super::device::{as_cuda, cuda_tensor, dequant_launch, float_alloc, float_write_ptr, raw_stream, read_ptr, stream_for};
use super::ffi::{self, check_status, Fp8DequantParams, Fp8LinearParams};
use crate::quant::{fp8_activation_quant, Fp8Weight};

/// `DSV41_FP8_FUSED_AUTO_MAX_BYTES`: the largest weight (code bytes, N·K) for which
/// [`Fp8Prep::Auto`] fuses the activation into the streaming kernel.
pub const FP8_FUSED_AUTO_MAX_BYTES: usize = 4 << 20;

/// The largest m the weight-streaming kernel takes (tokens in chunks of 64).
pub const FP8_STREAM_MAX_M: usize = ffi::FP8_STREAM_MAX_M;

/// The largest m for which [`fp8_linear`] streams the weight (above: dequantize + cuBLAS, faster
/// there on the H100 / H200 until the FP8 `wgmma` kernel; `docs/perf.md` "FP8 linear").
pub const FP8_AUTO_STREAM_MAX_M: usize = 64;

/// The largest m of the `Warp` variant ([`Fp8StreamVariant::Warp`]; above it runs what `Auto` picks).
pub const FP8_WARP_MAX_M: usize = ffi::FP8_WARP_MAX_M;

/// The weight-streaming kernel's variants (`DSV41_FP8_VARIANT_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8StreamVariant {
    /// `Pipeline` for m > 16 where its copies are possible (K a multiple of 128, aligned codes and
    /// scales) and the weight fills a quarter of the GPU's SMs with its stream-K CTAs, else
    /// `Registers` (the faster one at m <= 16 and for small weights, `docs/perf.md` "FP8 linear").
    #[default]
    Auto,
    /// 8-byte loads (byte loads for K not a multiple of 8) into a register ring.
    Registers,
    /// Stream-K: a persistent grid whose CTAs stream equal runs of 128-row x 128-byte units
    /// through `cp.async` stages in shared memory (falls back to `Registers` where K % 128 != 0).
    Pipeline,
    /// Warp-owned streaming (`kernels/fp8_linear_warp.cu`): each unit of 16 weight rows x a split
    /// of K is streamed by one warp straight into registers, a persistent grid of 16-warp CTAs,
    /// deterministic split-K. Any K and alignment, m <= [`FP8_WARP_MAX_M`] (above: what `Auto`
    /// picks). The split factor is raised where the CTA's activation slice needs it to fit shared
    /// memory.
    Warp,
    /// `Auto` with `Warp` for m <= 16. Explicit: on an H100 `Warp` is faster where N is large
    /// and one K split fills the GPU (wq_b 1280 -> 32768) and slower on the other released shapes
    /// (`docs/perf.md` "FP8 linear").
    AutoWarp,
}

/// Which kernel computes an FP8 linear.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8LinearPath {
    /// By m: `Stream` up to [`FP8_AUTO_STREAM_MAX_M`], else `Dequant`.
    #[default]
    Auto,
    /// The weight-streaming kernel (m <= [`FP8_STREAM_MAX_M`]).
    Stream,
    /// Dequantize into a bf16 scratch, then cuBLAS.
    Dequant,
    /// The FP8 `wgmma` GEMM (any m); `Dequant` where it does not apply (activation quantization
    /// off, or K not a multiple of 128).
    Gemm,
}

/// How the weight-streaming kernel gets its activation (`DSV41_FP8_PREP_*`); both give the same
/// bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Prep {
    /// `Fused` for weights of at most [`FP8_FUSED_AUTO_MAX_BYTES`] code bytes (launch-bound
    /// sizes), `Kernel` above.
    #[default]
    Auto,
    /// `Registers` at m <= 16 quantizes (or reads) x itself per k32 block — one launch — where
    /// K % 8 == 0 and x is 16-byte aligned (with several K splits: on the device's arrival
    /// counters, [`arrival_counters`]); else `Kernel`.
    Fused,
    /// A prep kernel writes the activation panel (Q1 codes and block scales, or the bf16 x,
    /// padded) and zeroes the counters; the streaming kernel starts its weight loads meanwhile.
    Kernel,
}

/// Options of [`fp8_linear_with`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Fp8LinearOptions {
    /// The path: streaming kernel or dequantize + cuBLAS (default: by m).
    pub path: Fp8LinearPath,
    /// Split-K factor of the streaming kernel; 0 = the launcher's choice (clamped to the k32
    /// blocks; `Warp`: to its groups of 4 blocks, and raised to what its shared memory needs).
    pub splits: usize,
    /// The streaming kernel's variant.
    pub variant: Fp8StreamVariant,
    /// Where the streaming kernel's activation comes from.
    pub prep: Fp8Prep,
}

/// `x · Wᵀ`: `x` `[M, K]` bf16 on a CUDA device, `w` `[N, K]` on the same device; returns
/// `[M, N]` bf16. With `act_quant` the input is quantized per 1×32 block first (the reference's
/// FP8 activation quantization; K must then be a multiple of 32). Errors (never panics) on
/// another dtype, device or shape.
pub fn fp8_linear(x: &Tensor, w: &Fp8Weight, act_quant: bool) -> Result<Tensor> {
    fp8_linear_with(x, w, act_quant, Fp8LinearOptions::default())
}

/// [`fp8_linear`] with a chosen path and split-K factor.
pub fn fp8_linear_with(x: &Tensor, w: &Fp8Weight, act_quant: bool, opts: Fp8LinearOptions) -> Result<Tensor> {
    Ok(product("fp8_linear", x, w, act_quant, opts, 0)?.0)
}

/// [`fp8_linear_with`] of a weight that stacks two linears of one input along N (rows
/// `0..n_first`, then the rest; [`Fp8Weight::stack`]): the two products, `[M, n_first]` and
/// `[M, N − n_first]`, as two tensors. On the streaming path one launch writes both, bit for bit
/// the stacked product's columns — each its linear's own product up to the f32 summation order
/// (every output feature is a dot product of its own weight row; the split-K factor follows the
/// stacked N). The other paths (larger M) run one call per row view of the weight
/// ([`Fp8Weight::rows`]), bit for bit the two linears' own calls. `n_first` must be a multiple of
/// 32 in `32..N` (a whole row of scale blocks).
pub fn fp8_linear_split(x: &Tensor, w: &Fp8Weight, act_quant: bool, opts: Fp8LinearOptions, n_first: usize) -> Result<(Tensor, Tensor)> {
    let op = "fp8_linear_split";
    let n = w.dims().0;
    if n_first == 0 || !n_first.is_multiple_of(32) || n_first >= n {
        candle_core::bail!("{op}: the first output's width must be a multiple of 32 in 32..{n} (the weight's N), got {n_first}")
    }
    match product(op, x, w, act_quant, opts, n_first)? {
        (a, Some(b)) => Ok((a, b)),
        (y, None) => candle_core::bail!("{op}: one output {:?} for a split product (an internal error)", y.shape()),
    }
}

/// The product of [`fp8_linear_with`]; with `n_first > 0` the two outputs of
/// [`fp8_linear_split`] (the second returned as `Some`).
fn product(op: &str, x: &Tensor, w: &Fp8Weight, act_quant: bool, opts: Fp8LinearOptions, n_first: usize) -> Result<(Tensor, Option<Tensor>)> {
    let (n, k) = w.dims();
    let m = match x.dims() {
        &[m, xk] if xk == k => m,
        d => candle_core::bail!("{op}: x must be [M, {k}] for a weight [{n}, {k}] (out, in), got {d:?}"),
    };
    if x.dtype() != DType::BF16 {
        candle_core::bail!("{op}: x must be bf16, got {:?}", x.dtype())
    }
    if !x.device().is_cuda() || !x.device().same_device(w.device()) {
        candle_core::bail!("{op}: x ({:?}) and the weight ({:?}) must be on one CUDA device", x.device(), w.device())
    }
    if act_quant && !k.is_multiple_of(32) {
        candle_core::bail!("{op}: the activation quantization needs K (= {k}) to be a multiple of 32")
    }
    let kernel = match opts.path {
        Fp8LinearPath::Auto if auto_streams(m) => Kernel::Stream,
        Fp8LinearPath::Stream => Kernel::Stream,
        Fp8LinearPath::Gemm if act_quant && k.is_multiple_of(128) => Kernel::Gemm,
        Fp8LinearPath::Auto | Fp8LinearPath::Dequant | Fp8LinearPath::Gemm => Kernel::Dequant,
    };
    if n_first > 0 && (m == 0 || kernel != Kernel::Stream) {
        // Each linear's own call over its rows of the stacked weight (views, no copy).
        let (a, b) = (w.rows(0, n_first)?, w.rows(n_first, n - n_first)?);
        return Ok((product(op, x, &a, act_quant, opts, 0)?.0, Some(product(op, x, &b, act_quant, opts, 0)?.0)));
    }
    if m == 0 {
        return Ok((Tensor::zeros((0, n), DType::BF16, x.device())?, None));
    }
    if kernel == Kernel::Gemm {
        return Ok((launch(op, &x.contiguous()?, w, m, act_quant, opts, Kernel::Gemm, 0)?.0, None));
    }
    if kernel == Kernel::Dequant {
        let xq = if act_quant { fp8_activation_quant(x)? } else { x.clone() };
        let wd = fp8_dequantize_device(w, DType::BF16)?;
        return Ok((xq.matmul(&wd.t()?)?, None));
    }
    if m > FP8_STREAM_MAX_M {
        candle_core::bail!("{op}: the streaming kernel takes M <= {FP8_STREAM_MAX_M}, got {m}")
    }
    launch(op, &x.contiguous()?, w, m, act_quant, opts, Kernel::Stream, n_first)
}

/// Whether [`Fp8LinearPath::Auto`] streams the weight for `m` rows (else dequantize + cuBLAS).
pub(crate) fn auto_streams(m: usize) -> bool {
    m <= FP8_AUTO_STREAM_MAX_M
}

/// The kernel a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Stream,
    Gemm,
    Dequant,
}

/// Launches the streaming kernel or the GEMM (same parameter block and scratch protocol); with
/// `n_first > 0` (the streaming kernel) into two outputs, `[m, n_first]` and `[m, n − n_first]`.
#[allow(clippy::too_many_arguments)]
fn launch(op: &str, x: &Tensor, w: &Fp8Weight, m: usize, act_quant: bool, opts: Fp8LinearOptions, kernel: Kernel, n_first: usize) -> Result<(Tensor, Option<Tensor>)> {
    let gemm = kernel == Kernel::Gemm;
    let (n, k) = w.dims();
    if [m, n, k].iter().any(|&d| d > i32::MAX as usize - 128) {
        candle_core::bail!("{op}: dimensions must stay below 2^31 - 128, got m {m}, n {n}, k {k}")
    }
    let mut params = Fp8LinearParams {
        x: std::ptr::null(),
        codes: std::ptr::null(),
        scales: std::ptr::null(),
        out: std::ptr::null_mut(),
        out2: std::ptr::null_mut(),
        scratch: std::ptr::null_mut(),
        scratch_bytes: 0,
        counters: std::ptr::null_mut(),
        m: m as i32,
        n: n as i32,
        k: k as i32,
        act_quant: act_quant as i32,
        splits: if gemm { 0 } else { opts.splits.min(i32::MAX as usize) as i32 },
        variant: match opts.variant {
            _ if gemm => 0,
            Fp8StreamVariant::Auto => 0,
            Fp8StreamVariant::Registers => 1,
            Fp8StreamVariant::Pipeline => 2,
            Fp8StreamVariant::Warp => 3,
            Fp8StreamVariant::AutoWarp if m <= 16 => 3,
            Fp8StreamVariant::AutoWarp => 0,
        },
        prep: match opts.prep {
            _ if gemm => 0,
            Fp8Prep::Auto if super::policy::unfused("fp8_fused") => 1,
            Fp8Prep::Auto => 0,
            Fp8Prep::Kernel => 1,
            Fp8Prep::Fused => 2,
        },
        n_first: n_first as i32,
    };
    let mut bytes = 0i64;
    let size = std::mem::size_of::<Fp8LinearParams>();
    // SAFETY: the launcher reads the parameter block (its size is passed) and writes `bytes`.
    let code = unsafe {
        if gemm {
            ffi::dsv41_fp8_gemm_scratch_bytes(&params, size, &mut bytes)
        } else {
            ffi::dsv41_fp8_linear_scratch_bytes(&params, size, &mut bytes)
        }
    };
    check_status(op, code)?;

    let (xs, xl) = x.storage_and_layout();
    let (cs, cl) = w.codes().storage_and_layout();
    let (ss, sl) = w.scales().storage_and_layout();
    let (xc, cc, sc) = (as_cuda(&xs, "x")?, as_cuda(&cs, "codes")?, as_cuda(&ss, "scales")?);
    let cdev = xc.device.clone();
    let main = stream_for(xc)?;
    // SAFETY (both allocations): written by the kernels before they are read (every output
    // element; the scratch's panel, scales and counters by the prep kernel, partials before the
    // last CTA reads them).
    let n_out = if n_first > 0 { n_first } else { n };
    let mut out = float_alloc(&cdev, m * n_out, false)?;
    let mut out2 = if n_first > 0 { Some(float_alloc(&cdev, m * (n - n_first), false)?) } else { None };
    let mut scratch = unsafe { cdev.alloc::<u8>(bytes.max(1) as usize)? };
    // Inside a SideStream::run: on the side stream (what the kernels read kept until the join).
    let side = super::side_stream::side_launch_stream(&main)?;
    let stream = side.clone().unwrap_or(main);
    {
        let out_layout = Layout::contiguous((m, n_out));
        let (x_p, _gx) = read_ptr::<bf16>(xc, xl, &stream)?;
        let (c_p, _gc) = read_ptr::<u8>(cc, cl, &stream)?;
        let (s_p, _gs) = read_ptr::<u8>(sc, sl, &stream)?;
        let (o_p, _go) = float_write_ptr(&mut out, &out_layout, false, &stream)?;
        let out2_layout = Layout::contiguous((m, n - n_out));
        let (o2_p, _go2) = match out2.as_mut() {
            Some(o2) => {
                let (p, g) = float_write_ptr(o2, &out2_layout, false, &stream)?;
                (p, Some(g))
            }
            None => (std::ptr::null_mut(), None),
        };
        let (scr_p, _gscr) = scratch.device_ptr_mut(&stream);
        params.x = x_p as *const std::ffi::c_void;
        params.codes = c_p;
        params.scales = s_p;
        params.out = o_p;
        params.out2 = o2_p;
        params.scratch = scr_p as *mut std::ffi::c_void;
        params.scratch_bytes = bytes;
        // Only the register ring of m <= 16 can fuse the activation (and use the counters).
        if !gemm && opts.prep != Fp8Prep::Kernel && m <= 16 {
            params.counters = arrival_counters(&cdev, &stream)?.map_or(std::ptr::null_mut(), |p| p as *mut u32);
        }
        // SAFETY: x is read-locked, contiguous [m, k] bf16; codes / scales are read-locked and
        // contiguous with the weight's shapes; out is a fresh [m, n] bf16 buffer; the scratch
        // holds the bytes the launcher asked for; the launcher checks sizes and alignment; the
        // guards order the launches on the stream.
        let code = unsafe {
            if gemm {
                ffi::dsv41_fp8_gemm(&params, size, raw_stream(&stream))
            } else {
                ffi::dsv41_fp8_linear(&params, size, raw_stream(&stream))
            }
        };
        check_status(op, code)?;
    }
    drop((xs, cs, ss));
    if side.is_some() {
        super::side_stream::side_keep(Box::new((x.clone(), w.codes().clone(), w.scales().clone(), scratch)));
    }
    Ok((cuda_tensor(out, (m, n_out)), out2.map(|o| cuda_tensor(o, (m, n - n_out)))))
}

/// The arrival counters of the streaming kernel's split-K with the fused activation
/// ([`Fp8Prep::Auto`]): `DSV41_FP8_COUNTERS` u32 per stream of a candle CUDA device (its own
/// stream, a [`super::SideStream`]), zeroed once on that stream and left zero by every call (the
/// last CTA of a tile to arrive resets its counter), so no launch zeroes them. Kernels on one
/// stream run one after another, which is what makes one set per stream enough. The buffer lives as long as the process (a
/// captured graph keeps its address); it is never created inside a stream capture (`None`
/// there: that call takes the prep kernel when it splits K).
pub fn arrival_counters(cdev: &CudaDevice, stream: &Arc<CudaStream>) -> Result<Option<u64>> {
    /// A device's counters and their address.
    type CounterSet = (CudaSlice<u32>, u64);
    static SETS: OnceLock<Mutex<HashMap<(DeviceId, usize), CounterSet>>> = OnceLock::new();
    let mut sets = SETS.get_or_init(Default::default).lock().map_err(|_| candle_core::Error::Msg("fp8_linear: the counter sets' lock is poisoned".into()))?;
    let key = (cdev.id(), stream.cu_stream() as usize);
    if let Some((_, p)) = sets.get(&key) {
        return Ok(Some(*p));
    }
    let capturing = stream.capture_status().map_err(candle_core::Error::wrap)?;
    if capturing != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Ok(None);
    }
    let slice = stream.alloc_zeros::<u32>(ffi::FP8_COUNTERS).map_err(candle_core::Error::wrap)?;
    let p = {
        let (p, _guard) = slice.device_ptr(stream);
        p
    };
    sets.insert(key, (slice, p));
    Ok(Some(p))
}

/// The weight `[N, K]` dequantized on its CUDA device into f32 or bf16 (one kernel; bit for bit
/// [`Fp8Weight::dequantize`]'s host computation, see there for bf16 exactness).
pub fn fp8_dequantize_device(w: &Fp8Weight, dtype: DType) -> Result<Tensor> {
    let (n, k) = w.dims();
    dequant_launch("fp8_dequantize_device", w.codes(), w.scales(), (n, k), dtype, |codes, scales, out, out_f32, stream| {
        let params = Fp8DequantParams { codes, scales, out, n: n as i32, k: k as i32, out_f32: out_f32 as i32, reserved: 0 };
        // SAFETY: codes / scales are read-locked and contiguous with the weight's shapes; out is
        // a fresh [n, k] buffer of the flagged dtype, written in full; the launcher checks counts.
        unsafe { ffi::dsv41_fp8_dequant(&params, std::mem::size_of::<Fp8DequantParams>(), stream) }
    })
}
