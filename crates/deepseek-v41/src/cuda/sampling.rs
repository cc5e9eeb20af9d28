//! Token sampling on the GPU (`kernels/sampling.cu`): one token per sequence of a batch from its
//! logits row — greedy, temperature, top-k, top-p, seeded — with the algorithm of
//! [`crate::sampling`], whose CPU reference [`crate::sampling::sample_row_ref`] picks the same ids
//! (`tests/cuda_sampling.rs`). [`crate::sampling::sample_batch`] calls it for CUDA tensors.

use std::ffi::c_void;

use candle_core::{CudaStorage, DType, Layout, Result, Tensor};

use super::device::{as_cuda, cuda_tensor, float_read_ptr, raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi::check_status;
use crate::sampling::{SamplingBatch, SAMPLING_TABLE_WORDS};

/// `Dsv41SamplingParams` of `kernels/include/dsv41_sampling.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SamplingKernelParams {
    /// `[B, V]` f32 or bf16 (`x_f32`), row b at `logits + b · row_stride`.
    logits: *const c_void,
    /// `[B, 8]` u32: the batch's table.
    table: *const u32,
    /// `[B]` u32 out.
    ids: *mut u32,
    row_stride: i64,
    batch: i32,
    vocab: i32,
    x_f32: i32,
    _pad: i32,
}

extern "C" {
    fn dsv41_sampling(p: *const SamplingKernelParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// One token per sequence on the device: `logits` `[B, V]` (f32 or bf16; other float dtypes are
/// converted to f32) on a CUDA device, `batch` of B sequences whose table is on the same device;
/// returns `[B]` u32 there, the ids [`crate::sampling::sample_batch_ref`] picks. One kernel
/// launch, no host read, no synchronisation: the caller reads the ids (`to_vec1`) when it needs
/// them.
///
/// Errors on invalid settings for rows of V logits, a row count other than B, or tensors on
/// other devices ([`crate::sampling::SamplingError`]).
pub fn sample_device(logits: &Tensor, batch: &SamplingBatch) -> Result<Tensor> {
    let op = "sample_device";
    if !logits.device().is_cuda() {
        candle_core::bail!("{op}: logits must be on a CUDA device, got {:?}", logits.device())
    }
    let (b, v) = batch.check_logits(op, logits)?;
    if b == 0 {
        return Err(crate::sampling::SamplingError::EmptyOnCuda.into());
    }
    let table = batch.table();
    if !table.device().same_device(logits.device()) {
        candle_core::bail!(
            "{op}: the batch's table is on {:?}, the logits on {:?}: build the SamplingBatch on the logits' device",
            table.device(),
            logits.device()
        )
    }
    if b > i32::MAX as usize {
        candle_core::bail!("{op}: {b} rows: the kernel takes at most {} per call", i32::MAX)
    }
    let logits = match logits.dtype() {
        DType::F32 | DType::BF16 => logits.clone(),
        _ => logits.to_dtype(DType::F32)?,
    };
    // Entries contiguous within a row; rows at any stride that keeps them apart.
    let logits = if logits.stride()[1] == 1 && (b == 1 || logits.stride()[0] >= v) { logits } else { logits.contiguous()? };
    let table = table.contiguous()?;
    let x_f32 = logits.dtype() == DType::F32;
    let row_stride = logits.stride()[0] as i64;
    let (ls, ll) = logits.storage_and_layout();
    let (ts, tl) = table.storage_and_layout();
    let (lc, tc) = (as_cuda(&ls, "logits")?, as_cuda(&ts, "table")?);
    let cdev = lc.device.clone();
    let stream = stream_for(lc)?;
    // SAFETY: the kernel writes every element of ids (B >= 1 here).
    let mut ids = CudaStorage::wrap_cuda_slice(unsafe { cdev.alloc::<u32>(b)? }, cdev.clone());
    {
        let (l_p, _gl) = float_read_ptr(lc, ll, x_f32, &stream)?;
        let (t_p, _gt) = read_ptr::<u32>(tc, tl, &stream)?;
        let (ids_p, _gi) = write_ptr::<u32>(&mut ids, &Layout::contiguous(b), &stream)?;
        let params = SamplingKernelParams {
            logits: l_p,
            table: t_p,
            ids: ids_p,
            row_stride,
            batch: b as i32,
            vocab: v as i32,
            x_f32: x_f32 as i32,
            _pad: 0,
        };
        // SAFETY: logits are read-locked [B, V] rows of the flagged dtype at row_stride (entries
        // contiguous); the table is read-locked, contiguous [B, SAMPLING_TABLE_WORDS] u32; ids is
        // a fresh allocation of B u32; the launcher checks counts and pointers; the guards order
        // the launch on the storages' stream.
        let code = unsafe { dsv41_sampling(&params, std::mem::size_of::<SamplingKernelParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop((ls, ts));
    debug_assert_eq!(table.dims(), &[b, SAMPLING_TABLE_WORDS]);
    Ok(cuda_tensor(ids, b))
}
