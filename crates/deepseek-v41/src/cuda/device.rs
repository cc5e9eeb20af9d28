//! Raw device pointers of candle CUDA storages, for the C launchers.
//!
//! Every pointer is taken through cudarc's `device_ptr` / `device_ptr_mut` on the stream the
//! kernel will run on: cudarc makes that stream wait for pending writes (and, for outputs,
//! reads) of the buffer, and the returned [`SyncOnDrop`] records the kernel's use when dropped,
//! so callers keep the guards alive until the launch has been enqueued.

use std::ffi::c_void;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::bf16;

/// The stream candle enqueues this storage's work on, with its context bound to the calling
/// thread (the runtime-API launches of the kernels library use the thread's current context).
pub(crate) fn stream_for(storage: &CudaStorage) -> Result<Arc<CudaStream>> {
    let stream = storage.device.cuda_stream();
    stream.context().bind_to_thread().w()?;
    Ok(stream)
}

/// The CUDA storage behind a locked tensor storage, or an error naming the argument.
pub(crate) fn as_cuda<'a>(storage: &'a Storage, what: &str) -> Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        other => candle_core::bail!("{what}: expected a tensor on a CUDA device, got one on {:?}", other.device()),
    }
}

/// Read pointer to the first element of `layout` in `storage` (element type `T`).
pub(crate) fn read_ptr<'a, T: CudaDType + 'a>(
    storage: &'a CudaStorage,
    layout: &Layout,
    stream: &'a CudaStream,
) -> Result<(*const T, SyncOnDrop<'a>)> {
    let slice: &CudaSlice<T> = storage.as_cuda_slice::<T>()?;
    let (base, guard) = slice.device_ptr(stream);
    let ptr = base as usize + layout.start_offset() * std::mem::size_of::<T>();
    Ok((ptr as *const T, guard))
}

/// Write pointer to the first element of `layout` in `storage` (element type `T`).
pub(crate) fn write_ptr<'a, T: CudaDType + 'a>(
    storage: &'a mut CudaStorage,
    layout: &Layout,
    stream: &'a CudaStream,
) -> Result<(*mut T, SyncOnDrop<'a>)> {
    let slice: &mut CudaSlice<T> = storage.as_cuda_slice_mut::<T>()?;
    let (base, guard) = slice.device_ptr_mut(stream);
    let ptr = base as usize + layout.start_offset() * std::mem::size_of::<T>();
    Ok((ptr as *mut T, guard))
}

/// Read pointer of an optional f32 input (null and no guard when absent); `what` names it in
/// the error when its storage is not on a CUDA device.
/// (`input`: a locked storage as [`candle_core::Tensor::storage_and_layout`] returns it.)
pub(crate) fn opt_f32_read_ptr<'a, S: std::ops::Deref<Target = Storage>>(
    input: Option<&'a (S, &'a Layout)>,
    what: &str,
    stream: &'a CudaStream,
) -> Result<(*const f32, Option<SyncOnDrop<'a>>)> {
    Ok(match input {
        Some((s, l)) => {
            let (p, g) = read_ptr::<f32>(as_cuda(s, what)?, l, stream)?;
            (p, Some(g))
        }
        None => (std::ptr::null(), None),
    })
}

/// An uninitialized f32 (`is_f32`) or bf16 buffer of `n` elements on `dev`; the caller's kernel
/// writes every element.
pub(crate) fn float_alloc(dev: &CudaDevice, n: usize, is_f32: bool) -> Result<CudaStorage> {
    // SAFETY: uninitialized memory, written in full by the kernel that follows (callers' contract).
    Ok(if is_f32 {
        CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(n)? }, dev.clone())
    } else {
        CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<bf16>(n)? }, dev.clone())
    })
}

/// Read pointer of a bf16 / f32 storage (`is_f32` picks the element type).
pub(crate) fn float_read_ptr<'a>(s: &'a CudaStorage, l: &Layout, is_f32: bool, stream: &'a CudaStream) -> Result<(*const c_void, SyncOnDrop<'a>)> {
    Ok(if is_f32 {
        let (p, g) = read_ptr::<f32>(s, l, stream)?;
        (p as *const c_void, g)
    } else {
        let (p, g) = read_ptr::<bf16>(s, l, stream)?;
        (p as *const c_void, g)
    })
}

/// Write pointer of a bf16 / f32 storage (`is_f32` picks the element type).
pub(crate) fn float_write_ptr<'a>(s: &'a mut CudaStorage, l: &Layout, is_f32: bool, stream: &'a CudaStream) -> Result<(*mut c_void, SyncOnDrop<'a>)> {
    Ok(if is_f32 {
        let (p, g) = write_ptr::<f32>(s, l, stream)?;
        (p as *mut c_void, g)
    } else {
        let (p, g) = write_ptr::<bf16>(s, l, stream)?;
        (p as *mut c_void, g)
    })
}

/// A kernel's output storage as a tensor of `shape` (no gradient).
pub(crate) fn cuda_tensor(s: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
}

/// The stream as the C launchers take it (`cudaStream_t`).
pub(crate) fn raw_stream(stream: &CudaStream) -> *mut c_void {
    stream.cu_stream() as *mut c_void
}

/// `x` itself when its rows (last dim contiguous) start on 16-byte boundaries (bf16: every 8
/// elements), else a contiguous copy whose rows do — what the kernels' 16-byte loads need.
pub(crate) fn aligned_rows(x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    let ok = |x: &candle_core::Tensor| {
        let s = x.stride();
        s[s.len() - 1] == 1
            && x.layout().start_offset().is_multiple_of(8)
            && s[..s.len() - 1].iter().zip(x.dims()).all(|(&st, &n)| n <= 1 || st.is_multiple_of(8))
    };
    if ok(x) {
        return Ok(x.clone());
    }
    let c = x.contiguous()?;
    if ok(&c) {
        Ok(c)
    } else {
        c.copy()
    }
}

/// Runs a packed-weight dequantization kernel: `codes` and `scales` (u8, contiguous, on one CUDA
/// device) into a fresh `[n, k]` f32 or bf16 tensor. `launch(codes, scales, out, out_f32, stream)`
/// fills the kernel's parameter block and returns its status; it must write every output element.
/// Shared by the FP8 and MXFP4 weights (`fp8_dequantize_device`, `mxfp4_dequantize_device`).
pub(crate) fn dequant_launch(
    op: &str,
    codes: &Tensor,
    scales: &Tensor,
    (n, k): (usize, usize),
    dtype: DType,
    launch: impl FnOnce(*const u8, *const u8, *mut c_void, bool, *mut c_void) -> i32,
) -> Result<Tensor> {
    if !matches!(dtype, DType::F32 | DType::BF16) {
        candle_core::bail!("{op}: dtype must be f32 or bf16, got {dtype:?}")
    }
    let (cs, cl) = codes.storage_and_layout();
    let (ss, sl) = scales.storage_and_layout();
    let (cc, sc) = (as_cuda(&cs, "codes")?, as_cuda(&ss, "scales")?);
    let cdev = cc.device.clone();
    let stream = stream_for(cc)?;
    let is_f32 = dtype == DType::F32;
    let mut out = float_alloc(&cdev, n * k, is_f32)?;
    {
        let out_layout = Layout::contiguous((n, k));
        let (c_p, _gc) = read_ptr::<u8>(cc, cl, &stream)?;
        let (s_p, _gs) = read_ptr::<u8>(sc, sl, &stream)?;
        let (o_p, _go) = float_write_ptr(&mut out, &out_layout, is_f32, &stream)?;
        super::ffi::check_status(op, launch(c_p, s_p, o_p, is_f32, raw_stream(&stream)))?;
    }
    drop((cs, ss));
    Ok(cuda_tensor(out, (n, k)))
}
