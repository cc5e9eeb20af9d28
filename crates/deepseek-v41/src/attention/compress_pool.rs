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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The kernel's per-element formula (`kernels/compress_pool.cu`, with the CPU's `exp`) gives
    /// the reference's bits on the CPU: the op order, and the pooled sum started from +0 (a −0
    /// product — a weight underflowed to 0 times a negative value — gives +0 as candle's sum).
    #[test]
    fn the_kernel_formula_equals_the_reference() -> Result<()> {
        let (b, d) = (16, 64);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut value = |zeros: bool| -> f32 {
            let r = next();
            match (zeros, r % 8) {
                (true, 0) => 0.0,
                (true, 1) => -0.0,
                _ => ((r >> 11) as f32 / (1u64 << 53) as f32 - 0.5) * 8.0,
            }
        };
        let (ck, kv): (Vec<f32>, Vec<f32>) = (0..b * d).map(|_| (value(true), value(true))).unzip();
        let s0: Vec<f32> = (0..b * d).map(|_| value(false)).collect();
        // Far apart every third element: one weight underflows to exactly 0.
        let s1: Vec<f32> = s0.iter().enumerate().map(|(i, &x)| if i % 3 == 0 { x - 120.0 } else { x + 0.25 }).collect();
        let closing: Vec<u8> = (0..b).map(|i| (i % 2) as u8).collect();
        let dev = Device::Cpu;
        let t = |v: &[f32]| Tensor::from_slice(v, (b, d), &dev);
        let (pooled, new_kv, new_score) = compress_pool_ref(&t(&ck)?, &t(&s0)?, &t(&kv)?, &t(&s1)?, &Tensor::from_slice(&closing, (b, 1), &dev)?, DType::BF16)?;
        let pooled: Vec<half::bf16> = pooled.flatten_all()?.to_vec1()?;
        let (new_kv, new_score): (Vec<f32>, Vec<f32>) = (new_kv.flatten_all()?.to_vec1()?, new_score.flatten_all()?.to_vec1()?);
        let mut negative_zero_products = 0;
        for e in 0..b * d {
            let m = s0[e].max(s1[e]);
            let (e0, e1) = ((s0[e] - m).exp(), (s1[e] - m).exp());
            let den = e0 + e1;
            let (p0, p1) = ((e0 / den) * ck[e], (e1 / den) * kv[e]);
            negative_zero_products += usize::from(p0.to_bits() == (-0.0f32).to_bits());
            let want = half::bf16::from_f32((0.0 + p0) + p1);
            assert_eq!(pooled[e].to_bits(), want.to_bits(), "element {e}");
            let keep = closing[e / d] != 0;
            assert_eq!((new_kv[e], new_score[e]), if keep { (ck[e], s0[e]) } else { (kv[e], s1[e]) });
        }
        assert!(negative_zero_products > 0, "no −0 product: the case the +0 start decides is not exercised");
        Ok(())
    }
}
