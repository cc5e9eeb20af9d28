//! A CUDA device set up for a decode loop: thousands of small tensors a second, all on one
//! stream, with a few device-to-host reads per step (the MoE routing, the sampled logits).
//!
//! Two cudarc / driver defaults cost host time per tensor there and order nothing for this
//! crate's single-stream use:
//!
//! * **Event tracking.** cudarc creates (and later destroys) two CUDA events for every buffer,
//!   to order its uses across streams. Everything here runs on the device's one stream.
//! * **Memory-pool release threshold.** Candle allocates from the device's stream-ordered pool;
//!   with the default threshold of 0 the pool hands its free memory back to the driver at every
//!   synchronization, so the allocations after each host read map memory anew. A maximal
//!   threshold keeps what the pool has reserved (the pool still frees it to satisfy other
//!   allocations of the process when memory runs short).
//!
//! Results do not change (same kernels, same stream order).

use candle_core::cuda_backend::cudarc::driver::sys as cu;
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUmemPool_attribute};
use candle_core::cuda_backend::WrapErr;
use candle_core::{Device, Result};

/// CUDA device `ordinal` set up for decoding (see the module doc): cudarc's per-buffer event
/// tracking off and the device's memory pool keeping the memory it has reserved. Create it
/// before loading the model: the setting applies to buffers allocated afterwards.
///
/// Only for single-stream use of the returned device (as this crate's modules do): work queued
/// by the caller on other streams of the same context is not ordered against its tensors.
pub fn decode_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    let cuda = device.as_cuda_device()?;
    // SAFETY: every tensor of this device is used on its one stream (the crate's kernels launch
    // on `cuda_stream()`), so the cross-stream events order nothing.
    unsafe { cuda.disable_event_tracking() };
    let stream = cuda.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().w()?;
    if ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED).w()? != 0 {
        let mut pool = std::ptr::null_mut();
        let mut threshold = u64::MAX;
        // SAFETY: `pool` is a valid out-pointer and `cu_device` the context's device handle; the
        // release threshold is a cuuint64_t attribute and `threshold` outlives the call.
        unsafe {
            cu::cuDeviceGetMemPool(&mut pool, ctx.cu_device()).result().w()?;
            cu::cuMemPoolSetAttribute(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )
            .result()
            .w()?;
        }
    }
    Ok(device)
}
