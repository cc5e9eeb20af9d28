//! The ratio-2 compressor's pooling and carry update of the batched decode step (spec §5;
//! [`super::decode_batch`]): a group is two tokens, the one carried from the previous step
//! (`carry_kv`, `carry_score`) and this one (`kv`, `score`, the `compressor.wkv` / `wgate`
//! projections, f32). Per sequence b and dimension d:
//!
//! ```text
//! a = softmax over the two of (carry_score, score)
//! pooled = a0·carry_kv + a1·kv                      (f32, then the activations' dtype)
//! carry' = closing[b] ? (carry_kv, carry_score) : (kv, score)
//! ```
//!
//! (the pooled row feeds the closing entry; where the token opens a group it becomes the carry).
//! [`compress_pool`] is one kernel on CUDA ([`crate::cuda::compress_pool_device`], bit for bit
//! [`compress_pool_ref`] there), the reference's Candle ops elsewhere.

use candle_core::{DType, Result, Tensor};

/// The pooled rows `[B, D]` in `dtype` and the carry after this token (`[B, D]` f32 kv and
/// score); see the module docs. `carry_kv`, `carry_score`, `kv`, `score`: `[B, D]` f32;
/// `closing`: `[B, 1]` u8, 1 where this token closes its group.
pub fn compress_pool(carry_kv: &Tensor, carry_score: &Tensor, kv: &Tensor, score: &Tensor, closing: &Tensor, dtype: DType) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if dtype == DType::BF16 && crate::cuda::fused_kernels(kv.device()) {
        return crate::cuda::compress_pool_device(carry_kv, carry_score, kv, score, closing);
    }
    compress_pool_ref(carry_kv, carry_score, kv, score, closing, dtype)
}

/// [`compress_pool`] as Candle ops (the reference, on any device).
pub fn compress_pool_ref(carry_kv: &Tensor, carry_score: &Tensor, kv: &Tensor, score: &Tensor, closing: &Tensor, dtype: DType) -> Result<(Tensor, Tensor, Tensor)> {
    let alpha = candle_nn::ops::softmax(&Tensor::stack(&[carry_score, score], 1)?, 1)?;
    let pooled = (alpha * Tensor::stack(&[carry_kv, kv], 1)?)?.sum(1)?.to_dtype(dtype)?;
    let keep = closing.broadcast_as(kv.shape())?;
    Ok((pooled, keep.where_cond(carry_kv, kv)?, keep.where_cond(carry_score, score)?))
}
