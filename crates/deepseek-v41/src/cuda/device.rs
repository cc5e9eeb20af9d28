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
use candle_core::{CudaStorage, Layout, Result, Storage};

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
