//! The MXFP4 weights of the routed experts on the GPU (`kernels/mxfp4.cu`): the exact
//! dequantization of an [`Mxfp4Weight`] kept packed on the device (spec §2.4), bit for bit
//! [`Mxfp4Weight::dequantize`]'s host computation (`tests/cuda_mxfp4.rs`).
//!
//! An MXFP4 linear on CUDA (`nn::LinearWeight::Mxfp4`) calls it for every product and runs the
//! dense path's cuBLAS matmul over the bf16 scratch, until a grouped expert kernel computes with
//! the packed codes.

use candle_core::{DType, Result, Tensor};

use super::device::dequant_launch;
use super::ffi::{self, Mxfp4DequantParams};
use crate::quant::Mxfp4Weight;

/// The weight `[N, K]` dequantized on its CUDA device into f32 or bf16 (one kernel; bit for bit
/// [`Mxfp4Weight::dequantize`]'s host computation — exact in both dtypes, code 8 as `+0`, scale
/// byte 255 as the host's NaN). Errors (never panics) on another dtype or a weight off CUDA.
pub fn mxfp4_dequantize_device(w: &Mxfp4Weight, dtype: DType) -> Result<Tensor> {
    let (n, k) = w.dims();
    dequant_launch("mxfp4_dequantize_device", w.codes(), w.scales(), (n, k), dtype, |codes, scales, out, out_f32, stream| {
        // `Mxfp4Weight::new` checked n, k >= 1, k % 32 == 0 and both within i32.
        let params = Mxfp4DequantParams { codes, scales, out, n: n as i32, k: k as i32, out_f32: out_f32 as i32, reserved: 0 };
        // SAFETY: codes / scales are read-locked and contiguous with the weight's shapes ([n, k/2],
        // [n, k/32]); out is a fresh [n, k] buffer of the flagged dtype, written in full; the
        // launcher checks the counts and picks vector accesses only for aligned pointers.
        unsafe { ffi::dsv41_mxfp4_dequant(&params, std::mem::size_of::<Mxfp4DequantParams>(), stream) }
    })
}
