//! FP8 activation quantization of the reference's linear operator (spec §0.1b.8, §2.5): the
//! input of every FP8/FP4-weight linear is quantized per 1x32 block of the last dim to e4m3 with
//! a UE8M0 (power-of-two) scale, amax floored at 1e-4.
//!
//! This is the same function as the window-KV fake quant Q1 ([`QatFormat::Fp8Ue8m0B32`]).
//! The quantized values `q·s` are exactly representable in bf16 and f32, so the emulation
//! returns the dequantized activation; an f32 GEMM of it with the dequantized weight equals the
//! reference's blockwise FP8 GEMM up to summation order.

use candle_core::{Result, Tensor};

use super::fake_quant::{fake_quant_block, map_blocks, QatFormat};

/// Block size of the activation quantization.
pub const ACT_BLOCK: usize = 32;

/// Quantizes one block in place: `s = 2^ceil(log2(max(amax, 1e-4)/448))`, `x = e4m3(x/s)·s`.
pub fn fp8_act_quant_block(block: &mut [f32]) {
    fake_quant_block(QatFormat::Fp8Ue8m0B32, block)
}

/// Emulates the activation quantization of `x` (`[..., K]`, K a multiple of 32, any float
/// dtype); returns the dequantized values `[..., K]` in `x`'s dtype and device. On the host in
/// f32, except for bf16 / f32 tensors on a CUDA device (with the `cuda` feature): one kernel on
/// the device, bit for bit equal (`cuda::fake_quant_device`).
pub fn fp8_activation_quant(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::cuda::fused_kernels(x.device()) {
        return crate::cuda::fake_quant_device(x, QatFormat::Fp8Ue8m0B32);
    }
    map_blocks(x, ACT_BLOCK, "fp8_activation_quant", fp8_act_quant_block)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::super::formats::{pow2, round_to_e4m3};
    use super::*;

    /// Straightforward f64 computation: scale by search over powers of two, e4m3 by nearest of
    /// all decoded bytes (ties to the even byte), saturating.
    fn reference(x: &[f32]) -> Vec<f32> {
        let values: Vec<f64> = (0u8..=0x7e).map(|b| super::super::formats::e4m3_to_f32(b) as f64).collect();
        x.chunks(32)
            .flat_map(|blk| {
                let amax = blk.iter().map(|v| v.abs() as f64).fold(0.0, f64::max).max(1e-4f32 as f64);
                let target = (amax as f32 / 448.0) as f64; // the reference divides in f32
                let mut k = -160;
                while 2f64.powi(k) < target {
                    k += 1;
                }
                let s = 2f64.powi(k);
                blk.iter()
                    .map(|&v| {
                        let y = (v as f64 / s).abs().min(448.0);
                        let mut best = 0usize;
                        for (i, &c) in values.iter().enumerate() {
                            let (d, db) = ((y - c).abs(), (y - values[best]).abs());
                            if d < db || (d == db && i % 2 == 0) {
                                best = i;
                            }
                        }
                        ((values[best] * s) as f32).copysign(v)
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    fn crafted() -> Vec<f32> {
        let mut v = Vec::new();
        // Block 0: powers of two across the e4m3 range under a 256 amax (s = 1).
        v.extend((0..32).map(|i| 2f32.powi(8 - i)));
        // Block 1: saturation at the top: amax 448·2^k exactly and values just above.
        v.extend((0..32).map(|i| if i == 0 { 448.0 * 4.0 } else { (i as f32) * 57.3 - 900.0 }));
        // Block 2: all below the amax floor (s = 2^ceil(log2(1e-4/448)) = 2^-22).
        v.extend((0..32).map(|i| (i as f32 - 16.0) * 7e-9));
        // Block 3: zeros and negative zero.
        v.extend((0..32).map(|i| if i % 2 == 0 { 0.0 } else { -0.0 }));
        // Block 4: ties of e4m3 at scale 1 (amax 448): 1 + 1/16, 1 + 3/16, 17, 19 ...
        v.extend([448.0, 1.0625, 1.1875, 17.0, 19.0, 2.125, 2.375, -1.0625, -17.0, 0.0009765625, 0.0029296875]);
        v.extend((11..32).map(|i| (i as f32).sqrt()));
        // Block 5: amax just above a power of two times 448 (scale doubles), block boundary values.
        v.extend((0..32).map(|i| if i == 31 { 448.0 * 1.001 } else { (i as f32) * 0.77 }));
        v
    }

    #[test]
    fn matches_straightforward_computation() -> anyhow::Result<()> {
        let x = crafted();
        let want = reference(&x);
        let t = Tensor::from_vec(x.clone(), (2, x.len() / 2), &Device::Cpu)?;
        let got = fp8_activation_quant(&t)?.flatten_all()?.to_vec1::<f32>()?;
        for (i, ((g, w), xi)) in got.iter().zip(&want).zip(&x).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "element {i} (block {}): x = {xi:e}, got {g:e}, want {w:e}", i / 32);
        }
        // The floor is on amax (s = 2^-22 for block 2), not on amax/448 (which would give
        // s = 2^-13, spec §0.1b.8): negative control.
        let tiny = &x[64..96];
        let on_amax: Vec<f32> = tiny.iter().map(|v| round_to_e4m3(v / pow2(-22)) * pow2(-22)).collect();
        let on_ratio: Vec<f32> = tiny.iter().map(|v| round_to_e4m3(v / pow2(-13)) * pow2(-13)).collect();
        assert_eq!(&got[64..96], &on_amax[..]);
        assert_ne!(&got[64..96], &on_ratio[..]);
        Ok(())
    }

    #[test]
    fn bf16_in_bf16_out_exact() -> anyhow::Result<()> {
        let x = crafted();
        let t = Tensor::from_vec(x, (6, 32), &Device::Cpu)?.to_dtype(DType::BF16)?;
        let xs = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let got = fp8_activation_quant(&t)?;
        assert_eq!(got.dtype(), DType::BF16);
        let got = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let want = reference(&xs);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        Ok(())
    }

    #[test]
    fn rejects_last_dim_not_multiple_of_32() -> anyhow::Result<()> {
        let t = Tensor::zeros((2, 48), DType::F32, &Device::Cpu)?;
        let err = fp8_activation_quant(&t).unwrap_err().to_string();
        assert!(err.contains("48") && err.contains("32"), "{err}");
        assert!(fp8_activation_quant(&Tensor::new(1f32, &Device::Cpu)?).is_err());
        assert!(fp8_activation_quant(&Tensor::zeros((3, 64), DType::U8, &Device::Cpu)?).is_err());
        Ok(())
    }
}
