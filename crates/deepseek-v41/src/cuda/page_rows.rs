//! The batched decode step's top-k entries mapped to page-pool rows on the GPU
//! (`kernels/page_rows.cu`): [`crate::attention::page_rows`] in one launch instead of ten Candle
//! kernels, bit for bit those ops ([`crate::attention::page_rows_ref`], `tests/cuda_decoder_ops.rs`).

use std::ffi::c_void;

use candle_core::{DType, Result, Tensor};

use super::device::{as_cuda, cuda_tensor, raw_stream, read_ptr, stream_for};
use super::ffi::check_status;

/// `Dsv41PageRowsParams` of `kernels/include/dsv41_page_rows.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PageRowsParams {
    topk: *const i64,
    page_table: *const i64,
    out: *mut i64,
    rows: i64,
    k: i32,
    max_pages: i32,
    page: i32,
    _pad: i32,
}

extern "C" {
    fn dsv41_page_rows(p: *const PageRowsParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// `[B, k]` i64 pool rows of the entries `topk` (`[B, k]` i64, < 0: none) through `page_table`
/// (`[B, max_pages]` i64) with pages of `page` entries; see [`crate::attention::page_rows`].
pub fn page_rows_device(topk: &Tensor, page_table: &Tensor, page: usize) -> Result<Tensor> {
    let op = "page_rows_device";
    let (b, k) = topk.dims2()?;
    let (tb, max_pages) = page_table.dims2()?;
    if topk.dtype() != DType::I64 || page_table.dtype() != DType::I64 || tb != b || !topk.device().is_cuda() || !page_table.device().same_device(topk.device()) {
        candle_core::bail!(
            "{op}: topk [B, k] and page_table [B, max_pages] must be i64 on one CUDA device, got {:?} {:?} and {:?} {:?}",
            topk.dtype(),
            topk.shape(),
            page_table.dtype(),
            page_table.shape()
        )
    }
    if k == 0 || max_pages == 0 || k > i32::MAX as usize || max_pages > i32::MAX as usize || page == 0 || page > i32::MAX as usize {
        candle_core::bail!("{op}: k {k}, max_pages {max_pages}, page {page} out of range")
    }
    if b == 0 {
        return topk.clone().contiguous();
    }
    let (t, tab) = (topk.contiguous()?, page_table.contiguous()?);
    let (ts, tl) = t.storage_and_layout();
    let (ps, pl) = tab.storage_and_layout();
    let (tc, pc) = (as_cuda(&ts, "topk")?, as_cuda(&ps, "page_table")?);
    let stream = stream_for(tc)?;
    let dev = tc.device.clone();
    // SAFETY: the kernel writes every element of the output.
    let mut out = unsafe { tc.device.alloc::<i64>(b * k)? };
    {
        let (t_p, _g0) = read_ptr::<i64>(tc, tl, &stream)?;
        let (p_p, _g1) = read_ptr::<i64>(pc, pl, &stream)?;
        let (o_p, _g2) = candle_core::cuda_backend::cudarc::driver::DevicePtrMut::device_ptr_mut(&mut out, &stream);
        let params = PageRowsParams { topk: t_p, page_table: p_p, out: o_p as *mut i64, rows: b as i64, k: k as i32, max_pages: max_pages as i32, page: page as i32, _pad: 0 };
        // SAFETY: the inputs are read-locked contiguous i64 tensors of the checked shapes; the
        // output holds rows·k elements; the launcher checks counts and pointers.
        let code = unsafe { dsv41_page_rows(&params, std::mem::size_of::<PageRowsParams>(), raw_stream(&stream)) };
        check_status(op, code)?;
    }
    drop((ts, ps));
    Ok(cuda_tensor(candle_core::CudaStorage::wrap_cuda_slice(out, dev), (b, k)))
}
