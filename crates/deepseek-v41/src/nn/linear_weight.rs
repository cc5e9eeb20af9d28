//! What a [`Linear`](super::Linear) multiplies by ([`LinearWeight`]): a dense `[out, in]`
//! tensor, an FP8 weight kept in its release format ([`Fp8Weight`], spec §2.4) or an MXFP4 weight
//! kept in its release format ([`Mxfp4Weight`], the routed experts), and the product over each.
//!
//! [`LinearWeight::load`] picks the form. A quantized weight is kept as stored only on the GPU: a
//! [`LinearKind::Quantized`] linear on a CUDA device (feature `cuda`) with bf16 weights, whose
//! var builder offers the weight's stored parts (a release checkpoint under
//! [`crate::loader::QuantizedWeights::Native`], see [`crate::loader::native`]); an MXFP4 weight
//! also needs `in` to be a multiple of 32. Everything else is dense as before — on the CPU always
//! (f32, the reference).

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use super::linear::{compute_dtype, LinearKind};
use crate::loader::dequant::{blocks, BLOCK};
use crate::loader::StoredPart;
use crate::quant::{fp8_activation_quant, Fp8Weight, Mxfp4Weight};

/// The weight of a [`Linear`](super::Linear), `[out, in]` in one of its forms. More forms can
/// join: every user matches on it.
#[derive(Debug, Clone)]
pub enum LinearWeight {
    /// `[out, in]`: f32 on the CPU, the model dtype elsewhere (f32 for [`LinearKind::F32`]).
    Dense(Tensor),
    /// e4m3 codes `[out, in]` and e8m0 32×32 block scales as stored in the release, on a CUDA
    /// device; multiplied by `cuda::fp8_linear` (quantized linears only).
    Fp8(Fp8Weight),
    /// Packed e2m1 codes `[out, in/2]` and e8m0 per-row 1×32 scales `[out, in/32]` as stored in
    /// the release (the routed experts), on a CUDA device; each product dequantizes the weight on
    /// the device into a bf16 scratch and runs the dense path's matmul (quantized linears only).
    Mxfp4(Mxfp4Weight),
}

impl LinearWeight {
    /// Loads `<vb>.weight` `[out_dim, in_dim]` for a linear of `kind`, when the module docs'
    /// conditions hold: the stored FP8 parts (`weight#e4m3` `[out, in]`, `weight#e8m0`
    /// `[ceil(out/32), ceil(in/32)]`, u8), or the stored MXFP4 parts (`weight#e2m1` `[out, in/2]`,
    /// `weight#e8m0` `[out, in/32]`, u8); else the dense weight in
    /// [`compute_dtype`]`(device, vb.dtype())` (f32 for [`LinearKind::F32`]).
    pub fn load(in_dim: usize, out_dim: usize, kind: LinearKind, vb: &VarBuilder) -> Result<Self> {
        let dtype = match kind {
            LinearKind::F32 => DType::F32,
            _ => compute_dtype(vb.device(), vb.dtype()),
        };
        let native = kind == LinearKind::Quantized && native_on(vb.device(), dtype);
        Self::load_as(in_dim, out_dim, dtype, native, vb)
    }

    /// [`LinearWeight::load`] with the choice made: the stored FP8 / MXFP4 parts when `native`
    /// and the var builder offers them, else the dense weight in `dtype`.
    pub(crate) fn load_as(in_dim: usize, out_dim: usize, dtype: DType, native: bool, vb: &VarBuilder) -> Result<Self> {
        let scales = StoredPart::Scales.name("weight");
        let has = |part: StoredPart| vb.contains_tensor(&part.name("weight"));
        let hints = Default::default();
        if native && has(StoredPart::Codes) && has(StoredPart::Scales) {
            let c = vb.get_with_hints_dtype((out_dim, in_dim), &StoredPart::Codes.name("weight"), hints, DType::U8)?;
            let s = vb.get_with_hints_dtype((blocks(out_dim), blocks(in_dim)), &scales, hints, DType::U8)?;
            return Ok(Self::Fp8(Fp8Weight::new(c, s)?));
        }
        if native && in_dim.is_multiple_of(BLOCK) && has(StoredPart::Fp4Codes) && has(StoredPart::Scales) {
            let c = vb.get_with_hints_dtype((out_dim, in_dim / 2), &StoredPart::Fp4Codes.name("weight"), hints, DType::U8)?;
            let s = vb.get_with_hints_dtype((out_dim, in_dim / BLOCK), &scales, hints, DType::U8)?;
            return Ok(Self::Mxfp4(Mxfp4Weight::new(c, s)?));
        }
        Ok(Self::Dense(vb.get_with_hints_dtype((out_dim, in_dim), "weight", hints, dtype)?))
    }

    /// `(out, in)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match self {
            Self::Dense(w) => w.dims2(),
            Self::Fp8(w) => Ok(w.dims()),
            Self::Mxfp4(w) => Ok(w.dims()),
        }
    }

    /// The device the weight lives on.
    pub fn device(&self) -> &Device {
        match self {
            Self::Dense(w) => w.device(),
            Self::Fp8(w) => w.device(),
            Self::Mxfp4(w) => w.device(),
        }
    }

    /// Bytes held: elements times dtype size for a dense weight, codes plus scales for FP8 and
    /// MXFP4.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            Self::Fp8(w) => w.bytes(),
            Self::Mxfp4(w) => w.bytes(),
        }
    }

    /// The dense `[out, in]` tensor, if this is one.
    pub fn dense(&self) -> Option<&Tensor> {
        match self {
            Self::Dense(w) => Some(w),
            Self::Fp8(_) | Self::Mxfp4(_) => None,
        }
    }

    /// The FP8 weight, if this is one.
    pub fn fp8(&self) -> Option<&Fp8Weight> {
        match self {
            Self::Fp8(w) => Some(w),
            Self::Dense(_) | Self::Mxfp4(_) => None,
        }
    }

    /// The MXFP4 weight, if this is one.
    pub fn mxfp4(&self) -> Option<&Mxfp4Weight> {
        match self {
            Self::Mxfp4(w) => Some(w),
            Self::Dense(_) | Self::Fp8(_) => None,
        }
    }

    /// The weight `[out, in]` as a dense tensor in `dtype` on its device. Cheap for a dense
    /// weight already in `dtype` (shared storage); an FP8 or MXFP4 weight is dequantized on every
    /// call (one kernel on CUDA, [`Fp8Weight::dequantize`], [`Mxfp4Weight::dequantize`]),
    /// allocating `out·in` elements: for inspection and tests, not for a forward pass.
    pub fn to_dense(&self, dtype: DType) -> Result<Tensor> {
        match self {
            Self::Dense(w) => w.to_dtype(dtype),
            Self::Fp8(w) => w.dequantize(dtype),
            Self::Mxfp4(w) => w.dequantize(dtype),
        }
    }
}

/// Whether weights in `dtype` on `device` may stay in their release format: bf16 on a CUDA
/// device of a build with the feature `cuda` (see the module docs).
pub(crate) fn native_on(device: &Device, dtype: DType) -> bool {
    cfg!(feature = "cuda") && dtype == DType::BF16 && device.is_cuda()
}

/// The dense product `x · wᵀ` of `x` `[..., in]` (cast to `w`'s dtype) and `w` `[out, in]`, in
/// `w`'s dtype.
pub(super) fn dense_product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let x = x.to_dtype(w.dtype())?;
    match x.rank() {
        2 => x.matmul(&w.t()?),
        _ => x.broadcast_matmul(&w.t()?),
    }
}

/// The product `x · Wᵀ` `[..., out]` of `x` `[..., in]` (any rank >= 1, any layout, any float
/// dtype) and an FP8 weight, with the FP8 activation quantization of `x` inside when `act_quant`
/// (then `x` must be bf16 on CUDA and `in` a multiple of 32; `Linear` passes it only so).
///
/// * CUDA (feature `cuda`): `x` cast to bf16 — the dense path casts it to its bf16 weight the
///   same way — and flattened to `[M, in]`, `cuda::fp8_linear` (weight streaming for small M,
///   device dequantization + cuBLAS above); inside `cuda::with_plain_candle` always the latter,
///   which is the dense bf16 path's numerics. Returns bf16.
/// * Elsewhere: the dense product over the weight dequantized to f32 on every call (the
///   reference [`crate::quant::fp8_linear_ref`]); returns f32.
pub(super) fn fp8_product(x: &Tensor, w: &Fp8Weight, act_quant: bool) -> Result<Tensor> {
    let (n, k) = w.dims();
    if x.dims().last() != Some(&k) {
        candle_core::bail!("Linear: input must be [..., {k}] for an FP8 weight [{n}, {k}] (out, in), got {:?}", x.dims())
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        use crate::cuda::{fp8_linear_with, fused_kernels, Fp8LinearOptions, Fp8LinearPath};
        let lead = &x.dims()[..x.rank() - 1];
        let x2 = x.to_dtype(DType::BF16)?.reshape((lead.iter().product::<usize>(), k))?;
        let path = if fused_kernels(x.device()) { Fp8LinearPath::Auto } else { Fp8LinearPath::Dequant };
        let y = fp8_linear_with(&x2, w, act_quant, Fp8LinearOptions { path, ..Default::default() })?;
        return y.reshape([lead, &[n]].concat());
    }
    let xq = if act_quant { fp8_activation_quant(x)? } else { x.clone() };
    dense_product(&xq, &w.dequantize(compute_dtype(w.device(), DType::BF16))?)
}

/// The product `x · Wᵀ` `[..., out]` of `x` `[..., in]` (any rank >= 1, any layout, any float
/// dtype; already activation-quantized when the linear quantizes: [`super::Linear::prepare_input`])
/// and an MXFP4 weight: the weight dequantized on every call into a scratch of the dense path's
/// dtype ([`compute_dtype`]: bf16 on CUDA, by one kernel; f32 on the CPU), then the dense path's
/// product ([`dense_product`]). The dequantization is exact, so this is bit for bit the dense
/// linear over the dequantized weight (the `Dequantized` policy) — until a grouped expert kernel
/// computes with the packed codes directly.
pub(super) fn mxfp4_product(x: &Tensor, w: &Mxfp4Weight) -> Result<Tensor> {
    let (n, k) = w.dims();
    if x.dims().last() != Some(&k) {
        candle_core::bail!("Linear: input must be [..., {k}] for an MXFP4 weight [{n}, {k}] (out, in), got {:?}", x.dims())
    }
    dense_product(x, &w.dequantize(compute_dtype(w.device(), DType::BF16))?)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Module, Tensor};

    use super::*;
    use crate::nn::Linear;
    use crate::numerics::Numerics;
    use crate::quant::{fp8_linear_ref, mxfp4_linear_ref};
    use crate::test_util::xorshift_bytes as bytes;

    /// A random FP8 weight (no NaN codes, scales around 2^-10).
    fn weight(n: usize, k: usize, seed: u64) -> Fp8Weight {
        let codes = bytes(seed, n * k, |b| b).into_iter().map(|b| if b & 0x7f == 0x7f { b & 0xf0 } else { b }).collect();
        let scales = bytes(seed + 1, blocks(n) * blocks(k), |b| b).into_iter().map(|b| 112 + b % 24).collect();
        Fp8Weight::from_bytes(codes, scales, n, k, &Device::Cpu).unwrap()
    }

    fn x(dims: &[usize], seed: u64) -> Tensor {
        let n = dims.iter().product();
        let scale = |i: usize| 2f32.powi((i / 32 % 7) as i32 - 3);
        let v: Vec<f32> = bytes(seed, n, |b| b).iter().enumerate().map(|(i, &b)| (b as f32 - 127.5) / 32.0 * scale(i)).collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    fn f32s(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
    }

    /// A Linear over an FP8 weight on the CPU is the reference `fp8_linear_ref` bit for bit and
    /// the dense Linear over the dequantized weight, for `forward` and `forward_prepared`, with
    /// and without activation quantization, bf16 and f32 inputs, rank 3 and non-contiguous
    /// inputs.
    #[test]
    fn fp8_linear_on_the_cpu_is_the_reference() -> anyhow::Result<()> {
        let (n, k) = (40, 96);
        let w = weight(n, k, 3);
        for aq in [true, false] {
            let numerics = Numerics { activation_quant: aq, ..Numerics::PLAIN };
            let fp8 = Linear::from_fp8(w.clone(), numerics);
            let dense = Linear::from_weight(w.dequantize(DType::F32)?, LinearKind::Quantized, numerics);
            assert!(fp8.weight().fp8().is_some() && fp8.weight().dense().is_none());
            assert_eq!(fp8.weight().bytes(), n * k + 2 * 3);
            for dtype in [DType::F32, DType::BF16] {
                let x2 = x(&[5, k], 9).to_dtype(dtype)?;
                let want = fp8_linear_ref(&x2, &w, aq)?;
                let got = fp8.forward(&x2)?;
                assert_eq!((got.dtype(), got.dims()), (dtype, &[5, n][..]));
                assert_eq!(f32s(&got), f32s(&want), "forward {dtype:?} aq={aq}");
                assert_eq!(f32s(&fp8.forward_prepared(&fp8.prepare_input(&x2)?)?), f32s(&want), "prepared {dtype:?} aq={aq}");
                // Rank 3, and a transposed (non-contiguous) view of the same values.
                let x3 = x(&[2, 3, k], 11).to_dtype(dtype)?;
                let xt = x3.transpose(0, 1)?.contiguous()?.transpose(0, 1)?;
                assert!(!xt.is_contiguous());
                let want3 = dense.forward(&x3)?;
                assert_eq!(f32s(&fp8.forward(&x3)?), f32s(&want3), "rank 3 {dtype:?} aq={aq}");
                // (Candle's CPU matmul may sum a strided input in another order: same call both sides.)
                assert_eq!(f32s(&fp8.forward(&xt)?), f32s(&dense.forward(&xt)?), "non-contiguous {dtype:?} aq={aq}");
            }
        }
        // The activation quantization matters (the test can fail).
        let x2 = x(&[5, k], 9);
        let on = Linear::from_fp8(w.clone(), Numerics { activation_quant: true, ..Numerics::PLAIN }).forward(&x2)?;
        let off = Linear::from_fp8(w.clone(), Numerics::PLAIN).forward(&x2)?;
        assert_ne!(f32s(&on), f32s(&off));
        // A wrong input width is an error naming both shapes.
        let e = Linear::from_fp8(w, Numerics::PLAIN).forward(&x(&[2, 64], 1)).unwrap_err().to_string();
        assert!(e.contains("[2, 64]") && e.contains("[40, 96]"), "{e}");
        Ok(())
    }

    /// A Linear over an MXFP4 weight on the CPU is the reference `mxfp4_linear_ref` bit for bit
    /// and the dense Linear over the dequantized weight, for `forward` and `forward_prepared`,
    /// with and without activation quantization, bf16 and f32, rank 3 and non-contiguous inputs.
    #[test]
    fn mxfp4_linear_on_the_cpu_is_the_reference() -> anyhow::Result<()> {
        let (n, k) = (40, 96);
        let w = Mxfp4Weight::from_bytes(bytes(5, n * k / 2, |b| b), bytes(6, n * k / 32, |b| b).into_iter().map(|b| 118 + b % 12).collect(), n, k, &Device::Cpu)?;
        for aq in [true, false] {
            let numerics = Numerics { activation_quant: aq, ..Numerics::PLAIN };
            let fp4 = Linear::from_mxfp4(w.clone(), numerics);
            let dense = Linear::from_weight(w.dequantize(DType::F32)?, LinearKind::Quantized, numerics);
            assert!(fp4.weight().mxfp4().is_some() && fp4.weight().dense().is_none() && fp4.weight().fp8().is_none());
            assert_eq!((fp4.weight().bytes(), fp4.weight().dims()?), (n * k / 2 + n * 3, (n, k)));
            assert_eq!(f32s(&fp4.weight().to_dense(DType::F32)?), f32s(&w.dequantize(DType::F32)?));
            for dtype in [DType::F32, DType::BF16] {
                let x2 = x(&[5, k], 9).to_dtype(dtype)?;
                let want = mxfp4_linear_ref(&x2, &w, aq)?;
                let got = fp4.forward(&x2)?;
                assert_eq!((got.dtype(), got.dims()), (dtype, &[5, n][..]));
                assert_eq!(f32s(&got), f32s(&want), "forward {dtype:?} aq={aq}");
                assert_eq!(f32s(&fp4.forward_prepared(&fp4.prepare_input(&x2)?)?), f32s(&want), "prepared {dtype:?} aq={aq}");
                let x3 = x(&[2, 3, k], 11).to_dtype(dtype)?;
                let xt = x3.transpose(0, 1)?.contiguous()?.transpose(0, 1)?;
                assert_eq!(f32s(&fp4.forward(&x3)?), f32s(&dense.forward(&x3)?), "rank 3 {dtype:?} aq={aq}");
                assert_eq!(f32s(&fp4.forward(&xt)?), f32s(&dense.forward(&xt)?), "non-contiguous {dtype:?} aq={aq}");
            }
        }
        let on = Linear::from_mxfp4(w.clone(), Numerics { activation_quant: true, ..Numerics::PLAIN }).forward(&x(&[5, k], 9))?;
        let off = Linear::from_mxfp4(w.clone(), Numerics::PLAIN).forward(&x(&[5, k], 9))?;
        assert_ne!(f32s(&on), f32s(&off));
        let e = Linear::from_mxfp4(w, Numerics::PLAIN).forward(&x(&[2, 64], 1)).unwrap_err().to_string();
        assert!(e.contains("[2, 64]") && e.contains("[40, 96]"), "{e}");
        Ok(())
    }

    /// On the CPU, `load` always gives a dense weight, whatever the backend offers.
    #[test]
    fn load_on_the_cpu_is_dense() -> anyhow::Result<()> {
        let vb = crate::nn::RandomWeights::new(1).var_builder(DType::BF16, &Device::Cpu).pp("w");
        let w = LinearWeight::load(64, 32, LinearKind::Quantized, &vb)?;
        assert_eq!(w.dense().map(|t| (t.dtype(), t.dims().to_vec())), Some((DType::F32, vec![32, 64])));
        assert_eq!(w.dims()?, (32, 64));
        assert_eq!(w.bytes(), 32 * 64 * 4);
        Ok(())
    }
}
