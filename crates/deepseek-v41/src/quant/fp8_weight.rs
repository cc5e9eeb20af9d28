//! A dense FP8 weight kept in its release format (spec §2.4, issue 21) and the reference of its
//! linear (spec §2.5).
//!
//! * [`Fp8Weight`]: e4m3fn codes `[N, K]` (`out`, `in`) and one e8m0 scale byte per 32×32 block,
//!   `[ceil(N/32), ceil(K/32)]`; `W[n, k] = e4m3(codes[n, k]) · 2^(scales[n/32, k/32] − 127)`
//!   (scale byte 255 is NaN). Both are `u8` tensors on one device.
//! * [`fp8_linear_ref`]: the reference linear over it — today's [`Linear`](crate::nn::Linear) of kind
//!   [`LinearKind::Quantized`](crate::nn::LinearKind::Quantized) over the dequantized weight (activation quantization per 1×32
//!   block when on, f32 accumulation, output rounded to the input's dtype). The CUDA kernels of
//!   `cuda::fp8_linear` (feature `cuda`) are checked against it (`tests/cuda_fp8_linear.rs`).

use candle_core::{DType, Device, Result, Tensor};

use crate::loader::dequant::{blocks, dequant_fp8_block32, BLOCK as BLOCK32};

/// A block-scaled FP8 weight `[N, K]` (see the module docs).
#[derive(Debug, Clone)]
pub struct Fp8Weight {
    /// `[N, K]` u8: e4m3fn bits, contiguous.
    codes: Tensor,
    /// `[ceil(N/32), ceil(K/32)]` u8: e8m0 bits, contiguous.
    scales: Tensor,
}

impl Fp8Weight {
    /// Wraps e4m3 `codes` `[N, K]` and e8m0 `scales` `[ceil(N/32), ceil(K/32)]` (both `u8`, on
    /// one device; made contiguous). Errors, naming the values, on another rank, dtype, shape or
    /// device, or an empty dimension.
    pub fn new(codes: Tensor, scales: Tensor) -> Result<Self> {
        let op = "Fp8Weight::new";
        if codes.dtype() != DType::U8 || scales.dtype() != DType::U8 {
            candle_core::bail!("{op}: codes and scales must be u8 (e4m3 / e8m0 bits), got {:?} and {:?}", codes.dtype(), scales.dtype())
        }
        let (n, k) = match codes.dims() {
            &[n, k] if n > 0 && k > 0 => (n, k),
            d => candle_core::bail!("{op}: codes must be [out, in] with both > 0, got shape {d:?}"),
        };
        let want = [blocks(n), blocks(k)];
        if scales.dims() != want {
            candle_core::bail!("{op}: scales of codes [{n}, {k}] must be {want:?} (one per 32x32 block), got {:?}", scales.dims())
        }
        if !codes.device().same_device(scales.device()) {
            candle_core::bail!("{op}: codes on {:?} and scales on {:?} must share a device", codes.device(), scales.device())
        }
        if n > i32::MAX as usize || k > i32::MAX as usize {
            candle_core::bail!("{op}: codes [{n}, {k}] too large (each dimension must fit in i32)")
        }
        Ok(Self { codes: codes.contiguous()?, scales: scales.contiguous()? })
    }

    /// From raw bytes on `device`: `codes` of `[n, k]` and `scales` of `[ceil(n/32), ceil(k/32)]`.
    pub fn from_bytes(codes: Vec<u8>, scales: Vec<u8>, n: usize, k: usize, device: &Device) -> Result<Self> {
        if codes.len() != n * k || scales.len() != blocks(n) * blocks(k) {
            candle_core::bail!(
                "Fp8Weight::from_bytes: [{n}, {k}] needs {} code and {} scale bytes, got {} and {}",
                n * k,
                blocks(n) * blocks(k),
                codes.len(),
                scales.len()
            )
        }
        let c = Tensor::from_vec(codes, (n, k), device)?;
        let s = Tensor::from_vec(scales, (blocks(n), blocks(k)), device)?;
        Self::new(c, s)
    }

    /// `(N, K)` = (out, in).
    pub fn dims(&self) -> (usize, usize) {
        let d = self.codes.dims();
        (d[0], d[1])
    }

    /// The e4m3 codes `[N, K]` (u8, contiguous).
    pub fn codes(&self) -> &Tensor {
        &self.codes
    }

    /// The e8m0 scale bytes `[ceil(N/32), ceil(K/32)]` (u8, contiguous).
    pub fn scales(&self) -> &Tensor {
        &self.scales
    }

    /// The device both tensors live on.
    pub fn device(&self) -> &Device {
        self.codes.device()
    }

    /// Rows `start .. start + len` of the weight, `[len, K]`, sharing this weight's memory (no
    /// copy: views of the codes and of the scale rows of those blocks). `start` must be a multiple
    /// of 32 and `len` one too unless the range ends at N, so that the view's 32×32 blocks are the
    /// weight's (the grouped `wo_a`'s groups, `nn::GroupedLinear`). Errors, naming the values, on
    /// another range.
    pub fn rows(&self, start: usize, len: usize) -> Result<Self> {
        let (n, _) = self.dims();
        let end = start.checked_add(len).filter(|&e| e <= n && len > 0);
        if end.is_none() || !start.is_multiple_of(BLOCK32) || !(len.is_multiple_of(BLOCK32) || end == Some(n)) {
            candle_core::bail!(
                "Fp8Weight::rows: rows {start}..{} of a weight with {n} rows: the range must be non-empty, inside the weight, \
                 start at a multiple of {BLOCK32} and end at one or at the last row (whole 32x32 scale blocks)",
                start.saturating_add(len)
            )
        }
        let codes = self.codes.narrow(0, start, len)?;
        let scales = self.scales.narrow(0, start / BLOCK32, blocks(len))?;
        Ok(Self { codes, scales })
    }

    /// `self`'s rows, then `other`'s: one weight `[N₁ + N₂, K]` (a copy on the weights'
    /// device; [`Fp8Weight::rows`] gives the two back as views of it). Two linears of one input
    /// stacked this way are one product ([`crate::nn::LinearPair`]). Errors, naming the values,
    /// unless both have the same K and device and N₁ is a multiple of 32 (so that `other`'s
    /// 32×32 blocks stay whole).
    pub fn stack(&self, other: &Self) -> Result<Self> {
        let ((n1, k1), (n2, k2)) = (self.dims(), other.dims());
        if k1 != k2 || !n1.is_multiple_of(BLOCK32) || !self.device().same_device(other.device()) {
            candle_core::bail!(
                "Fp8Weight::stack: weights [{n1}, {k1}] on {:?} and [{n2}, {k2}] on {:?}: they need the same K and device, and the first's N a multiple of {BLOCK32}",
                self.device(),
                other.device()
            )
        }
        Self::new(Tensor::cat(&[&self.codes, &other.codes], 0)?, Tensor::cat(&[&self.scales, &other.scales], 0)?)
    }

    /// Bytes held: codes plus scales.
    pub fn bytes(&self) -> usize {
        self.codes.elem_count() + self.scales.elem_count()
    }

    /// The weight `[N, K]` in `dtype` on the weight's device, as
    /// [`crate::loader::dequant::dequant_fp8_block32`] computes it (negative zeros as `+0`).
    /// Exact in f32; in bf16 exact whenever the value is (every code with a scale byte >= 3;
    /// below that the smallest codes fall under bf16's subnormal grid and are rounded). On a
    /// CUDA device (feature `cuda`) f32 and bf16 come from one kernel, bit for bit the host's.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() && matches!(dtype, DType::F32 | DType::BF16) {
            return crate::cuda::fp8_dequantize_device(self, dtype);
        }
        host_dequantize(&self.codes, &self.scales, self.dims(), dtype, dequant_fp8_block32)
    }
}

/// The host path of a packed weight's `dequantize`: `codes` and `scales` (u8, any device) read to
/// the host, decoded by the loader's `decode(codes, scales, n, k)` into f32 `[n, k]`, cast to
/// `dtype` and moved back to the weight's device. Shared by [`Fp8Weight`] and
/// [`crate::quant::Mxfp4Weight`].
pub(crate) fn host_dequantize<E: std::error::Error + Send + Sync + 'static>(
    codes: &Tensor,
    scales: &Tensor,
    (n, k): (usize, usize),
    dtype: DType,
    decode: impl FnOnce(&[u8], &[u8], usize, usize) -> std::result::Result<Vec<f32>, E>,
) -> Result<Tensor> {
    let c = codes.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<u8>()?;
    let s = scales.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<u8>()?;
    let w = decode(&c, &s, n, k).map_err(candle_core::Error::wrap)?;
    Tensor::from_vec(w, (n, k), &Device::Cpu)?.to_dtype(dtype)?.to_device(codes.device())
}

/// The reference FP8 linear: `x` `[M, K]` (bf16 or f32) times the dequantized `w` transposed,
/// with the FP8 activation quantization of `x` (1×32 blocks, e8m0 scale, e4m3 values;
/// [`crate::quant::fp8_activation_quant`], which needs K to be a multiple of 32) when `act_quant`
/// is on, accumulated in f32, returned `[M, N]` in `x`'s dtype — exactly what today's [`Linear`](crate::nn::Linear)
/// of kind [`LinearKind::Quantized`](crate::nn::LinearKind::Quantized) computes over the f32 dequantized weight (it is that
/// linear). Any device; on the CPU it is the reference the CUDA kernels are tested against.
pub fn fp8_linear_ref(x: &Tensor, w: &Fp8Weight, act_quant: bool) -> Result<Tensor> {
    super::quantized_linear_ref("fp8_linear_ref", x, w.dims(), w.device(), || w.dequantize(DType::F32), act_quant)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Module, Tensor};

    use super::*;
    use crate::test_util::{x_rows, xorshift_bytes as bytes};
    use crate::nn::{Linear, LinearKind};
    use crate::numerics::Numerics;
    use crate::quant::formats::e4m3_to_f32;

    fn code(b: u8) -> u8 {
        if b & 0x7f == 0x7f {
            b & 0xf0
        } else {
            b
        }
    }

    fn weight(n: usize, k: usize, seed: u64) -> Fp8Weight {
        let codes = bytes(seed, n * k, code);
        let scales = bytes(seed + 1, blocks(n) * blocks(k), |b| 112 + b % 24);
        Fp8Weight::from_bytes(codes, scales, n, k, &Device::Cpu).unwrap()
    }

    /// Spec §2.4 test vector: row `d8 71 f2 79 70 69 f0 e5`, block scale 0x73 (2^-12).
    #[test]
    fn spec_vector() -> anyhow::Result<()> {
        let w = Fp8Weight::from_bytes(vec![0xd8, 0x71, 0xf2, 0x79, 0x70, 0x69, 0xf0, 0xe5], vec![0x73], 1, 8, &Device::Cpu)?;
        let got = w.dequantize(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let want = [-0.00390625f32, 0.03515625, -0.0390625, 0.0703125, 0.03125, 0.017578125, -0.03125, -0.0126953125];
        assert_eq!(got, want);
        // The bf16 dequantization is exact here.
        let bf = w.dequantize(DType::BF16)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(bf, want);
        assert_eq!(w.dims(), (1, 8));
        Ok(())
    }

    /// Block addressing over partial blocks (33 x 40: 2 x 2 blocks) and signed zeros.
    #[test]
    fn dequantize_blocks() -> anyhow::Result<()> {
        let (n, k) = (33, 40);
        let mut codes = vec![0x38u8; n * k]; // 1.0
        codes[5] = 0x80; // -0 -> +0
        let w = Fp8Weight::from_bytes(codes, vec![127, 128, 129, 130], n, k, &Device::Cpu)?;
        let d = w.dequantize(DType::F32)?.to_vec2::<f32>()?;
        for (r, row) in d.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                let want = if r == 0 && c == 5 { 0.0 } else { [1.0f32, 2.0, 4.0, 8.0][(r / 32) * 2 + c / 32] };
                assert_eq!(v.to_bits(), want.to_bits(), "r={r} c={c}");
            }
        }
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        Ok(())
    }

    /// The reference equals `Linear::from_weight(dequantized)` bit for bit, with and without the
    /// activation quantization, for bf16 and f32 inputs; and the activation quantization matters.
    #[test]
    fn ref_is_todays_linear() -> anyhow::Result<()> {
        let (m, n, k) = (5, 40, 96);
        let w = weight(n, k, 7);
        let dense = w.dequantize(DType::F32)?;
        for dtype in [DType::F32, DType::BF16] {
            let x = x_rows(m, k, 11).to_dtype(dtype)?;
            for aq in [true, false] {
                let numerics = Numerics { activation_quant: aq, ..Numerics::PLAIN };
                let want = Linear::from_weight(dense.clone(), LinearKind::Quantized, numerics).forward(&x)?;
                let got = fp8_linear_ref(&x, &w, aq)?;
                assert_eq!(got.dtype(), dtype);
                assert_eq!(got.dims(), &[m, n]);
                let (g, wv) = (got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, want.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                assert!(g.iter().zip(&wv).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?} aq={aq}");
            }
            let on = fp8_linear_ref(&x, &w, true)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let off = fp8_linear_ref(&x, &w, false)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            assert_ne!(on, off, "activation quantization had no effect ({dtype:?})");
        }
        Ok(())
    }

    /// A stack's row views are the stacked weights, their products the weights' own products;
    /// stacks that would split a 32x32 block or mix widths are errors naming the shapes.
    #[test]
    fn stack_and_rows() -> anyhow::Result<()> {
        let (a, b) = (weight(64, 96, 3), weight(40, 96, 5));
        let s = a.stack(&b)?;
        assert_eq!(s.dims(), (104, 96));
        let x = x_rows(3, 96, 9);
        for (view, w) in [(s.rows(0, 64)?, &a), (s.rows(64, 40)?, &b)] {
            assert_eq!(view.codes().to_vec2::<u8>()?, w.codes().to_vec2::<u8>()?);
            assert_eq!(view.scales().to_vec2::<u8>()?, w.scales().to_vec2::<u8>()?);
            let (g, r) = (fp8_linear_ref(&x, &view, true)?.to_vec2::<f32>()?, fp8_linear_ref(&x, w, true)?.to_vec2::<f32>()?);
            assert_eq!(g, r);
        }
        let e = b.stack(&a).unwrap_err().to_string();
        assert!(e.contains("[40, 96]") && e.contains("multiple of 32"), "{e}");
        let e = a.stack(&weight(32, 64, 1)).unwrap_err().to_string();
        assert!(e.contains("[32, 64]") && e.contains("same K"), "{e}");
        Ok(())
    }

    /// Bad inputs are errors naming the values, never panics.
    #[test]
    fn errors() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let c = Tensor::zeros((33, 40), DType::U8, &dev)?;
        let s = Tensor::zeros((2, 2), DType::U8, &dev)?;
        assert!(Fp8Weight::new(c.clone(), s.clone()).is_ok());
        let e = Fp8Weight::new(c.clone(), Tensor::zeros((1, 2), DType::U8, &dev)?).unwrap_err().to_string();
        assert!(e.contains("[2, 2]") && e.contains("[1, 2]"), "{e}");
        let e = Fp8Weight::new(c.to_dtype(DType::F32)?, s.clone()).unwrap_err().to_string();
        assert!(e.contains("F32"), "{e}");
        let e = Fp8Weight::new(Tensor::zeros((0, 40), DType::U8, &dev)?, s.clone()).unwrap_err().to_string();
        assert!(e.contains("[0, 40]"), "{e}");
        let e = Fp8Weight::new(Tensor::zeros(40, DType::U8, &dev)?, s.clone()).unwrap_err().to_string();
        assert!(e.contains("[40]"), "{e}");
        assert!(Fp8Weight::from_bytes(vec![0; 10], vec![0], 2, 4, &dev).is_err());
        let w = Fp8Weight::new(c, s)?;
        let e = fp8_linear_ref(&Tensor::zeros((3, 41), DType::F32, &dev)?, &w, false).unwrap_err().to_string();
        assert!(e.contains("[3, 41]") && e.contains("40"), "{e}");
        let e = fp8_linear_ref(&Tensor::zeros((3, 40), DType::U8, &dev)?, &w, false).unwrap_err().to_string();
        assert!(e.contains("U8"), "{e}");
        // K = 40 is not a multiple of the activation block: the reference's act quant refuses it.
        assert!(fp8_linear_ref(&Tensor::zeros((3, 40), DType::F32, &dev)?, &w, true).is_err());
        assert!(fp8_linear_ref(&Tensor::zeros((3, 40), DType::F32, &dev)?, &w, false).is_ok());
        Ok(())
    }
}
