//! The ratio-2 compressor's pooling and carry update of the batched decode step on the GPU
//! (`kernels/compress_pool.cu`, spec §5): one launch instead of Candle's stack, softmax, product,
//! sum, cast and two selects (about twenty kernels and their allocations per kv source and step),
//! bit for bit those Candle ops on a CUDA device (`tests/cuda_decoder_ops.rs`).
//! [`crate::attention::compress_pool`] calls it for CUDA tensors.

use std::ffi::c_void;

use candle_core::{DType, Layout, Result, Tensor};

use super::device::{as_cuda, cuda_tensor, float_alloc, float_write_ptr, raw_stream, read_ptr, stream_for};
use super::ffi::check_status;

/// `Dsv41CompressPoolParams` of `kernels/include/dsv41_compress_pool.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CompressPoolParams {
    carry_kv: *const f32,
    carry_score: *const f32,
    kv: *const f32,
    score: *const f32,
    closing: *const u8,
    pooled: *mut c_void,
    new_kv: *mut c_void,
    new_score: *mut c_void,
    rows: i64,
    dim: i32,
    _pad: i32,
}

extern "C" {
    fn dsv41_compress_pool(p: *const CompressPoolParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// The pooled rows `[rows, dim]` bf16 and the carry after this token (`[rows, dim]` f32 kv and
/// score) — see [`crate::attention::compress_pool`] for the arguments and the math. Every tensor
/// on one CUDA device: the four f32 `[rows, dim]`, `closing` `[rows, 1]` (or `[rows]`) u8.
pub fn compress_pool_device(carry_kv: &Tensor, carry_score: &Tensor, kv: &Tensor, score: &Tensor, closing: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "compress_pool_device";
    let (rows, dim) = carry_kv.dims2()?;
    for (what, t) in [("carry_kv", carry_kv), ("carry_score", carry_score), ("kv", kv), ("score", score)] {
        if t.dtype() != DType::F32 || t.dims() != [rows, dim] || !t.device().is_cuda() || !t.device().same_device(carry_kv.device()) {
            candle_core::bail!("{op}: {what} must be [{rows}, {dim}] f32 on carry_kv's CUDA device, got {:?} {:?} on {:?}", t.dtype(), t.shape(), t.device())
        }
    }
    if closing.dtype() != DType::U8 || closing.elem_count() != rows || !closing.device().same_device(carry_kv.device()) {
        candle_core::bail!("{op}: closing must be {rows} u8 flags on carry_kv's device, got {:?} {:?}", closing.dtype(), closing.shape())
    }
    if dim > i32::MAX as usize {
        candle_core::bail!("{op}: dim {dim} is past the kernel's 32-bit count")
    }
    let c = |t: &Tensor| t.contiguous();
    let (ck, cs, k, s, cl) = (c(carry_kv)?, c(carry_score)?, c(kv)?, c(score)?, closing.flatten_all()?.contiguous()?);
    if rows == 0 {
        return Ok((ck.to_dtype(DType::BF16)?, ck, cs));
    }
    let guards = [ck.storage_and_layout(), cs.storage_and_layout(), k.storage_and_layout(), s.storage_and_layout(), cl.storage_and_layout()];
    let cuda = guards.iter().zip(["carry_kv", "carry_score", "kv", "score", "closing"]).map(|((st, _), w)| as_cuda(st, w)).collect::<Result<Vec<_>>>()?;
    let cdev = cuda[0].device.clone();
    let stream = stream_for(cuda[0])?;
    let n = rows * dim;
    // The kernel writes every element of the three outputs.
    let (mut pooled, mut new_kv, mut new_score) = (float_alloc(&cdev, n, false)?, float_alloc(&cdev, n, true)?, float_alloc(&cdev, n, true)?);
    {
        let out_layout = Layout::contiguous((rows, dim));
        let mut reads = Vec::with_capacity(4);
        for (i, st) in cuda.iter().take(4).enumerate() {
            reads.push(read_ptr::<f32>(st, guards[i].1, &stream)?);
        }
        let (cl_p, _g) = read_ptr::<u8>(cuda[4], guards[4].1, &stream)?;
        let (p_p, _gp) = float_write_ptr(&mut pooled, &out_layout, false, &stream)?;
        let (k_p, _gk) = float_write_ptr(&mut new_kv, &out_layout, true, &stream)?;
        let (s_p, _gs) = float_write_ptr(&mut new_score, &out_layout, true, &stream)?;
        let params = CompressPoolParams {
            carry_kv: reads[0].0,
            carry_score: reads[1].0,
            kv: reads[2].0,
            score: reads[3].0,
            closing: cl_p,
            pooled: p_p,
            new_kv: k_p,
            new_score: s_p,
            rows: rows as i64,
            dim: dim as i32,
            _pad: 0,
        };
        // SAFETY: the inputs are read-locked contiguous [rows, dim] f32 (closing: rows u8); the
        // outputs are fresh allocations of rows·dim elements; the launcher checks counts and
        // pointers; the guards order the launch on the stream.
        let code = unsafe { dsv41_compress_pool(&params, std::mem::size_of::<CompressPoolParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop(guards);
    Ok((cuda_tensor(pooled, (rows, dim)), cuda_tensor(new_kv, (rows, dim)), cuda_tensor(new_score, (rows, dim))))
}
