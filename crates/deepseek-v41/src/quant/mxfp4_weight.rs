//! An MXFP4 weight (the routed experts of the release, spec §2.4) kept in its release format, and
//! the reference of its linear (spec §2.5).
//!
//! * [`Mxfp4Weight`]: packed e2m1 codes `[N, K/2]` (`out`, `in/2`; byte `j` of a row holds input
//!   `2j` in its low nibble and `2j+1` in its high nibble) and one e8m0 scale byte per row per 32
//!   inputs, `[N, K/32]`; `W[n, k] = e2m1(code(n, k)) · 2^(scales[n, k/32] − 127)` (scale byte
//!   255 is NaN, code 8 — "−0" — is `+0`). Both are `u8` tensors on one device; K is a multiple
//!   of 32 (every release expert's is).
//! * [`mxfp4_linear_ref`]: the reference linear over it — the dense [`Linear`](crate::nn::Linear) of kind
//!   [`LinearKind::Quantized`](crate::nn::LinearKind::Quantized) over the dequantized weight (activation quantization per 1×32
//!   block when on, f32 accumulation, output rounded to the input's dtype), as
//!   [`crate::quant::fp8_linear_ref`] is for FP8 weights. On CUDA the MXFP4 linear dequantizes
//!   the weight on the device (`cuda::mxfp4_dequantize_device`, bit for bit [`Mxfp4Weight::dequantize`])
//!   and runs the dense path's matmul (`tests/cuda_mxfp4.rs`).

use candle_core::{DType, Device, Result, Tensor};

use crate::loader::dequant::{dequant_mxfp4, BLOCK};

/// An MXFP4 weight `[N, K]` kept as stored (see the module docs).
#[derive(Debug, Clone)]
pub struct Mxfp4Weight {
    /// `[N, K/2]` u8: two e2m1 codes per byte (low nibble = even input), contiguous.
    codes: Tensor,
    /// `[N, K/32]` u8: e8m0 bits, contiguous.
    scales: Tensor,
}

impl Mxfp4Weight {
    /// Wraps packed e2m1 `codes` `[N, K/2]` and e8m0 `scales` `[N, K/32]` (both `u8`, on one
    /// device; made contiguous). Errors, naming the values, on another rank, dtype, shape or
    /// device, an empty dimension, or a K (= 2 × the codes' columns) that is not a multiple of 32.
    pub fn new(codes: Tensor, scales: Tensor) -> Result<Self> {
        let op = "Mxfp4Weight::new";
        if codes.dtype() != DType::U8 || scales.dtype() != DType::U8 {
            candle_core::bail!("{op}: codes and scales must be u8 (packed e2m1 / e8m0 bits), got {:?} and {:?}", codes.dtype(), scales.dtype())
        }
        let (n, half) = match codes.dims() {
            &[n, half] if n > 0 && half > 0 => (n, half),
            d => candle_core::bail!("{op}: codes must be [out, in/2] with both > 0, got shape {d:?}"),
        };
        let k = 2 * half;
        if !k.is_multiple_of(BLOCK) {
            candle_core::bail!(
                "{op}: codes [{n}, {half}] hold K = {k} inputs per row, not a multiple of {BLOCK} (one e8m0 scale per {BLOCK} inputs); \
                 load such a weight dequantized"
            )
        }
        let want = [n, k / BLOCK];
        if scales.dims() != want {
            candle_core::bail!("{op}: scales of codes [{n}, {half}] (K = {k}) must be {want:?} (one per row per 32 inputs), got {:?}", scales.dims())
        }
        if !codes.device().same_device(scales.device()) {
            candle_core::bail!("{op}: codes on {:?} and scales on {:?} must share a device", codes.device(), scales.device())
        }
        if n > i32::MAX as usize || k > i32::MAX as usize {
            candle_core::bail!("{op}: weight [{n}, {k}] too large (each dimension must fit in i32)")
        }
        Ok(Self { codes: codes.contiguous()?, scales: scales.contiguous()? })
    }

    /// From raw bytes on `device`: `codes` of `[n, k/2]` and `scales` of `[n, k/32]` for the
    /// logical weight `[n, k]` (k a multiple of 32).
    pub fn from_bytes(codes: Vec<u8>, scales: Vec<u8>, n: usize, k: usize, device: &Device) -> Result<Self> {
        if !k.is_multiple_of(BLOCK) || n == 0 || k == 0 {
            candle_core::bail!("Mxfp4Weight::from_bytes: the weight [{n}, {k}] must have n > 0 and k a positive multiple of {BLOCK}")
        }
        if codes.len() != n * k / 2 || scales.len() != n * (k / BLOCK) {
            candle_core::bail!(
                "Mxfp4Weight::from_bytes: [{n}, {k}] needs {} code and {} scale bytes, got {} and {}",
                n * k / 2,
                n * (k / BLOCK),
                codes.len(),
                scales.len()
            )
        }
        let c = Tensor::from_vec(codes, (n, k / 2), device)?;
        let s = Tensor::from_vec(scales, (n, k / BLOCK), device)?;
        Self::new(c, s)
    }

    /// `(N, K)` = (out, in), the logical shape (the codes hold `K/2` bytes per row).
    pub fn dims(&self) -> (usize, usize) {
        let d = self.codes.dims();
        (d[0], 2 * d[1])
    }

    /// The packed e2m1 codes `[N, K/2]` (u8, contiguous).
    pub fn codes(&self) -> &Tensor {
        &self.codes
    }

    /// The e8m0 scale bytes `[N, K/32]` (u8, contiguous).
    pub fn scales(&self) -> &Tensor {
        &self.scales
    }

    /// The device both tensors live on.
    pub fn device(&self) -> &Device {
        self.codes.device()
    }

    /// Bytes held: codes plus scales (`N·K/2 + N·K/32`, about a quarter of bf16).
    pub fn bytes(&self) -> usize {
        self.codes.elem_count() + self.scales.elem_count()
    }

    /// The weight `[N, K]` in `dtype` on the weight's device, as
    /// [`crate::loader::dequant::dequant_mxfp4`] computes it (code 8, "−0", as `+0`; scale byte
    /// 255 NaN; `±inf` where e2m1 × 2^(s − 127) overflows f32, i.e. for scale bytes 253 and 254)
    /// and then cast. Every value is exact in f32 and in bf16 (at most two significant bits, and
    /// bf16 has f32's exponent range: the smallest magnitude 2^-128 is a bf16 subnormal, the
    /// largest finite 1.5 · 2^127 a bf16 normal), so the bf16 weight is the f32 weight. On a CUDA
    /// device (feature `cuda`) f32 and bf16 come from one kernel (`cuda::mxfp4_dequantize_device`),
    /// bit for bit this computation.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() && matches!(dtype, DType::F32 | DType::BF16) {
            return crate::cuda::mxfp4_dequantize_device(self, dtype);
        }
        super::fp8_weight::host_dequantize(&self.codes, &self.scales, self.dims(), dtype, dequant_mxfp4)
    }
}

/// The reference MXFP4 linear: `x` `[M, K]` (bf16 or f32) times the dequantized `w` transposed,
/// with the FP8 activation quantization of `x` (1×32 blocks, e8m0 scale, e4m3 values;
/// [`crate::quant::fp8_activation_quant`]) when `act_quant` is on, accumulated in f32, returned
/// `[M, N]` in `x`'s dtype — exactly what a [`Linear`](crate::nn::Linear) of kind [`LinearKind::Quantized`](crate::nn::LinearKind::Quantized)
/// computes over the f32 dequantized weight (it is that linear). Any device.
pub fn mxfp4_linear_ref(x: &Tensor, w: &Mxfp4Weight, act_quant: bool) -> Result<Tensor> {
    super::quantized_linear_ref("mxfp4_linear_ref", x, w.dims(), w.device(), || w.dequantize(DType::F32), act_quant)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Module, Tensor};

    use super::*;
    use crate::test_util::{x_rows, xorshift_bytes as bytes};
    use crate::nn::{Linear, LinearKind};
    use crate::numerics::Numerics;
    use crate::quant::formats::{e2m1_to_f32, e8m0_to_f32};

    fn weight(n: usize, k: usize, seed: u64) -> Mxfp4Weight {
        let codes = bytes(seed, n * k / 2, |b| b);
        let scales = bytes(seed + 1, n * k / 32, |b| 118 + b % 12);
        Mxfp4Weight::from_bytes(codes, scales, n, k, &Device::Cpu).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
    }

    /// Every byte value (both nibbles: all 16 codes in both positions) against every scale byte,
    /// 0..=255 (the extremes 0 = 2^-127, 254 = 2^127, 255 = NaN included): the weight is
    /// `dequant_mxfp4` bit for bit and the independent product `e2m1 · 2^(s − 127)`, with
    /// code 8 as `+0`; bf16 is the f32 weight exactly.
    #[test]
    fn every_code_and_scale() -> anyhow::Result<()> {
        // Row s: the 256 byte values (512 inputs, 16 blocks), every block scaled by byte s.
        let (n, k) = (256usize, 512usize);
        let codes: Vec<u8> = (0..n).flat_map(|_| 0..=255u8).collect();
        let scales: Vec<u8> = (0..n).flat_map(|s| std::iter::repeat_n(s as u8, k / 32)).collect();
        let w = Mxfp4Weight::from_bytes(codes.clone(), scales.clone(), n, k, &Device::Cpu)?;
        assert_eq!((w.dims(), w.bytes()), ((n, k), n * k / 2 + n * k / 32));
        let f32w = w.dequantize(DType::F32)?;
        let got = bits(&f32w);
        let loader: Vec<u32> = dequant_mxfp4(&codes, &scales, n, k)?.into_iter().map(f32::to_bits).collect();
        assert_eq!(got, loader);
        for r in 0..n {
            let s = e8m0_to_f32(r as u8);
            for c in 0..k {
                let byte = (c / 2) as u8;
                let code = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                let g = f32::from_bits(got[r * k + c]);
                if r == 255 {
                    assert!(g.is_nan(), "scale 255 must give NaN at c={c}, got {g}");
                    continue;
                }
                let want = if code == 8 { 0.0 } else { e2m1_to_f32(code) * s };
                assert_eq!(g.to_bits(), want.to_bits(), "scale {r} code {code}: got {g:e}, want {want:e}");
            }
        }
        // The extremes by hand: 2^-127 x 0.5 = 2^-128 (an f32 subnormal), 2^127 x 6 = +inf,
        // 2^127 x 1.5 finite, -0 as +0 under every finite scale.
        let at = |r: usize, byte: usize, hi: bool| f32::from_bits(got[r * k + 2 * byte + hi as usize]);
        assert_eq!(at(0, 0x01, false), 2f32.powi(-128));
        assert_eq!(at(254, 0x07, false), f32::INFINITY);
        assert_eq!(at(254, 0x0f, false), f32::NEG_INFINITY);
        assert_eq!(at(254, 0x03, false), 1.5 * 2f32.powi(127));
        assert!((0..255).all(|r| at(r, 0x88, false).to_bits() == 0 && at(r, 0x88, true).to_bits() == 0));
        // bf16 holds every value exactly (NaN stays NaN).
        let bf = bits(&w.dequantize(DType::BF16)?);
        for (i, (&a, &b)) in bf.iter().zip(&got).enumerate() {
            let (a, b) = (f32::from_bits(a), f32::from_bits(b));
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "element {i}: bf16 {a:e} vs f32 {b:e}");
        }
        Ok(())
    }

    /// Spec §2.4 test vector (`layers.0.ffn.experts.0.w1.weight` row 0, scale 0x78 = 2^-7),
    /// padded to one 32-input block.
    #[test]
    fn spec_vector() -> anyhow::Result<()> {
        let mut codes = vec![0xa0u8, 0xa8, 0xec, 0x4a, 0xad, 0xaf, 0x42, 0xaa];
        codes.resize(16, 0x11);
        let w = Mxfp4Weight::from_bytes(codes, vec![0x78], 1, 32, &Device::Cpu)?;
        let got = w.dequantize(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let want = [
            0.0f32, -0.0078125, 0.0, -0.0078125, -0.015625, -0.03125, -0.0078125, 0.015625, -0.0234375, -0.0078125, -0.046875,
            -0.0078125, 0.0078125, 0.015625, -0.0078125, -0.0078125,
        ];
        assert_eq!(&got[..16], want);
        assert!(got[16..].iter().all(|&v| v == 0.5 * 2f32.powi(-7)));
        // Code 8 ("-0") is +0.0 bit for bit, as the loader returns it.
        assert_eq!(got[2].to_bits(), 0);
        Ok(())
    }

    /// Per-row, per-32-input scales: row r block b uses scales[r, b] (a 32x32-block reading
    /// would not), and the nibble order (low = even input).
    #[test]
    fn scale_addressing_and_nibble_order() -> anyhow::Result<()> {
        let (n, k) = (3, 96);
        // 0x71: low nibble 1 (0.5) at even inputs, high nibble 7 (6.0) at odd ones.
        let scales: Vec<u8> = (0..n * 3).map(|i| 120 + i as u8).collect();
        let w = Mxfp4Weight::from_bytes(vec![0x71; n * k / 2], scales, n, k, &Device::Cpu)?;
        let d = w.dequantize(DType::F32)?.to_vec2::<f32>()?;
        for (r, row) in d.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                let s = 2f32.powi(120 + (r * 3 + c / 32) as i32 - 127);
                assert_eq!(v, if c % 2 == 0 { 0.5 } else { 6.0 } * s, "r={r} c={c}");
            }
        }
        Ok(())
    }

    /// The reference equals `Linear::from_weight(dequantized)` bit for bit, with and without the
    /// activation quantization, for bf16 and f32 inputs; and the activation quantization matters.
    #[test]
    fn ref_is_the_dense_linear() -> anyhow::Result<()> {
        let (m, n, k) = (5, 40, 96);
        let w = weight(n, k, 7);
        let dense = w.dequantize(DType::F32)?;
        for dtype in [DType::F32, DType::BF16] {
            let x = x_rows(m, k, 11).to_dtype(dtype)?;
            for aq in [true, false] {
                let numerics = Numerics { activation_quant: aq, ..Numerics::PLAIN };
                let want = Linear::from_weight(dense.clone(), LinearKind::Quantized, numerics).forward(&x)?;
                let got = mxfp4_linear_ref(&x, &w, aq)?;
                assert_eq!((got.dtype(), got.dims()), (dtype, &[m, n][..]));
                assert_eq!(bits(&got), bits(&want), "{dtype:?} aq={aq}");
            }
            assert_ne!(bits(&mxfp4_linear_ref(&x, &w, true)?), bits(&mxfp4_linear_ref(&x, &w, false)?), "act quant had no effect ({dtype:?})");
        }
        Ok(())
    }

    /// Bad inputs are errors naming the values, never panics.
    #[test]
    fn errors() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let c = Tensor::zeros((3, 32), DType::U8, &dev)?;
        let s = Tensor::zeros((3, 2), DType::U8, &dev)?;
        assert_eq!(Mxfp4Weight::new(c.clone(), s.clone())?.dims(), (3, 64));
        let e = Mxfp4Weight::new(c.clone(), Tensor::zeros((3, 4), DType::U8, &dev)?).unwrap_err().to_string();
        assert!(e.contains("[3, 2]") && e.contains("[3, 4]"), "{e}");
        // K = 40: not a multiple of 32.
        let e = Mxfp4Weight::new(Tensor::zeros((3, 20), DType::U8, &dev)?, Tensor::zeros((3, 2), DType::U8, &dev)?).unwrap_err().to_string();
        assert!(e.contains("K = 40") && e.contains("multiple of 32"), "{e}");
        let e = Mxfp4Weight::new(c.to_dtype(DType::F32)?, s.clone()).unwrap_err().to_string();
        assert!(e.contains("F32"), "{e}");
        let e = Mxfp4Weight::new(Tensor::zeros((0, 32), DType::U8, &dev)?, s.clone()).unwrap_err().to_string();
        assert!(e.contains("[0, 32]"), "{e}");
        let e = Mxfp4Weight::new(Tensor::zeros(32, DType::U8, &dev)?, s.clone()).unwrap_err().to_string();
        assert!(e.contains("[32]"), "{e}");
        let e = Mxfp4Weight::from_bytes(vec![0; 10], vec![0], 1, 20, &dev).unwrap_err().to_string();
        assert!(e.contains("[1, 20]"), "{e}");
        assert!(Mxfp4Weight::from_bytes(vec![0; 16], vec![0; 2], 1, 32, &dev).is_err());
        let w = Mxfp4Weight::new(c, s)?;
        let e = mxfp4_linear_ref(&Tensor::zeros((2, 63), DType::F32, &dev)?, &w, false).unwrap_err().to_string();
        assert!(e.contains("[2, 63]") && e.contains("64"), "{e}");
        let e = mxfp4_linear_ref(&Tensor::zeros((2, 64), DType::U8, &dev)?, &w, false).unwrap_err().to_string();
        assert!(e.contains("U8"), "{e}");
        Ok(())
    }
}
