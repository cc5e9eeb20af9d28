//! The grouped (block-diagonal) linear of the attention output, `wo_a` (spec §4.8): the heads'
//! outputs are cut into `G` groups and group `g`'s input `[.., in_g]` is multiplied by its own
//! `[out_g, in_g]` slice of the weight `[G·out_g, in_g]` (rows `g·out_g ..`). The reference runs it
//! as a plain einsum in the activation dtype over the weight dequantized at load (no activation
//! quantization, f32 accumulation; spec §0.1b.8).
//!
//! The weight ([`LinearWeight`]) is dense — f32 on the CPU (the reference), the activation dtype
//! elsewhere: one batched matmul over the groups — or, on CUDA with bf16 activations and a
//! release checkpoint under [`crate::loader::QuantizedWeights::Native`], the FP8 codes and 32×32
//! block scales as stored: with few rows (decode) all groups' rows stacked in one product that
//! streams the weight once, keeping each group's diagonal block; otherwise each group's rows of the
//! weight are a view ([`Fp8Weight::rows`]) with a product of their own. Either runs the FP8
//! kernels without the activation quantization (`cuda::fp8_linear`, bf16
//! input times the exact e4m3 · 2^s weight, f32 accumulation: the dense product up to the order
//! of the f32 summation, as for the FP8 linears). That keeps `wo_a` at its stored size (half of
//! bf16) and halves the bytes a decode step reads for it.

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use super::linear::compute_dtype;
use super::linear_weight::{fp8_product, native_on, LinearWeight};
use super::row_groups::RowGroups;
use crate::quant::Fp8Weight;

/// Up to this many stacked rows (groups × tokens) an FP8 `GroupedLinear` multiplies all groups in
/// one weight-streaming product (`cuda::fp8_linear`'s small-m kernels, m ≤ 64) instead of one
/// product per group: a product per group reads a few MB each and pays each launch's ramp-up
/// (V4.1-Flash decode, B = 1: eight 4 MB products took ~9 µs each on an H100, `docs/perf.md`).
const STACKED_MAX_ROWS: usize = 64;

/// A block-diagonal linear of `G` groups (see the module docs).
#[derive(Debug, Clone)]
pub struct GroupedLinear {
    /// `[G·out_g, in_g]`.
    weight: LinearWeight,
    /// Group `g`'s rows of an FP8 weight (views, no copy); empty for a dense weight.
    fp8_groups: Vec<Fp8Weight>,
    groups: usize,
}

impl GroupedLinear {
    /// Loads `<vb>.weight` `[out, in_per_group]` for `groups` groups of `out / groups` rows: FP8 as
    /// stored where the module docs allow it and each group is whole 32-row scale blocks, else
    /// dense in [`compute_dtype`]. Errors, naming the values, when `groups` does not divide `out`.
    pub fn new(in_per_group: usize, out: usize, groups: usize, vb: VarBuilder) -> Result<Self> {
        let dtype = compute_dtype(vb.device(), vb.dtype());
        let whole_blocks = groups == 1 || (out / groups.max(1)).is_multiple_of(32);
        let native = native_on(vb.device(), dtype) && whole_blocks;
        let weight = match LinearWeight::load_as(in_per_group, out, dtype, native, &vb)? {
            // Not a format this module computes with natively: dense, as the reference holds it.
            LinearWeight::Mxfp4(w) => LinearWeight::Dense(w.dequantize(dtype)?),
            w => w,
        };
        Self::from_weight(weight, groups)
    }

    /// Wraps `weight` `[G·out_g, in_g]` as `groups` groups. Errors when `groups` is 0 or does not
    /// divide the rows, or (FP8) when a group is not whole 32-row scale blocks.
    pub fn from_weight(weight: LinearWeight, groups: usize) -> Result<Self> {
        let (out, _) = weight.dims()?;
        if groups == 0 || !out.is_multiple_of(groups) {
            candle_core::bail!("GroupedLinear: {groups} groups must divide the weight's {out} rows")
        }
        let rows = out / groups;
        let fp8_groups = match &weight {
            LinearWeight::Fp8(w) => (0..groups).map(|g| w.rows(g * rows, rows)).collect::<Result<_>>()?,
            LinearWeight::Dense(_) => Vec::new(),
            LinearWeight::Mxfp4(_) => candle_core::bail!("GroupedLinear: an MXFP4 weight is not supported; dequantize it first"),
        };
        Ok(Self { weight, fp8_groups, groups })
    }

    /// The weight `[G·out_g, in_g]`.
    pub fn weight(&self) -> &LinearWeight {
        &self.weight
    }

    /// `G`.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// `x` `[T, G, in_g]` → `[T, G·out_g]` in `x`'s dtype: group `g`'s output columns are
    /// `g·out_g ..` (the weight's rows of the group).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (t, g, k) = x.dims3()?;
        let (out, in_g) = self.weight.dims()?;
        if g != self.groups || k != in_g {
            candle_core::bail!("GroupedLinear: input must be [T, {}, {in_g}], got {:?}", self.groups, x.dims())
        }
        let dtype = x.dtype();
        match &self.weight {
            LinearWeight::Dense(w) => {
                // Contiguous per group: cuBLAS's batched matmul needs a dense batch stride.
                let xg = x.transpose(0, 1)?.to_dtype(w.dtype())?.contiguous()?;
                // [G, T, in_g] x [G, in_g, out_g] -> [G, T, out_g]
                let w3 = w.reshape((g, out / g, in_g))?;
                xg.matmul(&w3.transpose(1, 2)?)?.transpose(0, 1)?.to_dtype(dtype)?.reshape((t, out))
            }
            LinearWeight::Fp8(w) if g * t <= STACKED_MAX_ROWS => {
                // Few rows (decode): one product of the groups' rows stacked group-major
                // `[G·T, in_g]` with the whole weight, which streams the weight once; group g's
                // outputs are the diagonal block (rows g·T.., columns g·out_g..). The off-diagonal
                // products are wasted, but at this size the time is the weight's bytes.
                let og = out / g;
                let stacked = x.transpose(0, 1)?.contiguous()?.reshape((g * t, k))?;
                let y = fp8_product(&stacked, w, false)?;
                #[cfg(feature = "cuda")]
                if crate::cuda::fused_kernels(y.device()) && !crate::cuda::unfused("group_diagonal") {
                    // One launch for the G blocks (a copy, bit for bit the concatenation below).
                    return crate::cuda::group_diagonal_device(&y, g)?.to_dtype(dtype);
                }
                let blocks = (0..g).map(|gi| y.narrow(0, gi * t, t)?.narrow(1, gi * og, og)).collect::<Result<Vec<_>>>()?;
                Tensor::cat(&blocks, 1)?.to_dtype(dtype)
            }
            LinearWeight::Fp8(_) => {
                let parts = self
                    .fp8_groups
                    .iter()
                    .enumerate()
                    .map(|(gi, w)| fp8_product(&x.narrow(1, gi, 1)?.squeeze(1)?, w, false))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 1)?.to_dtype(dtype)
            }
            LinearWeight::Mxfp4(_) => candle_core::bail!("GroupedLinear: an MXFP4 weight is not supported"),
        }
    }

    /// [`GroupedLinear::forward`] of `x` `[T, G, in_g]` holding the rows of several sequences
    /// split as `rows` ([`RowGroups`]): on the CPU with a dense weight each sequence's rows run
    /// through their own call (padded with zero rows to the sequence's own row count), so they
    /// get exactly the bits that call gives (the batched matmul picks its `gemm` kernel by the
    /// row count, `nn::row_groups`); otherwise (one whole group, a CUDA device, an FP8 weight)
    /// exactly `forward(x)`.
    pub fn forward_grouped(&self, x: &Tensor, rows: &RowGroups) -> Result<Tensor> {
        let (t, g, k) = x.dims3()?;
        if rows.rows() != t {
            candle_core::bail!("GroupedLinear::forward_grouped: the row groups cover {} rows, the input has {t}", rows.rows())
        }
        if !x.device().is_cpu() || rows.is_whole() || !matches!(self.weight, LinearWeight::Dense(_)) {
            return self.forward(x);
        }
        let mut parts = Vec::with_capacity(rows.groups().len());
        let mut at = 0;
        for r in rows.groups().iter().filter(|r| r.len > 0) {
            let own = x.narrow(0, at, r.len)?;
            let own = if r.alone > r.len { Tensor::cat(&[own, Tensor::zeros((r.alone - r.len, g, k), x.dtype(), x.device())?], 0)? } else { own };
            parts.push(self.forward(&own)?.narrow(0, 0, r.len)?);
            at += r.len;
        }
        Tensor::cat(&parts, 0)
    }

    /// The dense weight `[G, out_g, in_g]` in `dtype` (dequantized for FP8): for tests and
    /// inspection.
    pub fn to_dense(&self, dtype: DType) -> Result<Tensor> {
        let (out, in_g) = self.weight.dims()?;
        self.weight.to_dense(dtype)?.reshape((self.groups, out / self.groups, in_g))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    /// The dense path is the einsum `z[t, g] = x[t, g] · W_gᵀ`, bit for bit the per-group product.
    #[test]
    fn dense_groups_are_per_group_products() -> Result<()> {
        let dev = Device::Cpu;
        let (t, g, k, og) = (5, 3, 8, 4);
        let x = Tensor::randn(0f32, 1.0, (t, g, k), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (g * og, k), &dev)?;
        let gl = GroupedLinear::from_weight(LinearWeight::Dense(w.clone()), g)?;
        let z = gl.forward(&x)?;
        assert_eq!(z.dims(), &[t, g * og]);
        for gi in 0..g {
            let want = x.narrow(1, gi, 1)?.squeeze(1)?.matmul(&w.narrow(0, gi * og, og)?.t()?)?;
            let got = z.narrow(1, gi * og, og)?;
            assert_eq!(got.to_vec2::<f32>()?, want.to_vec2::<f32>()?, "group {gi}");
        }
        Ok(())
    }

    #[test]
    fn errors_name_the_values() -> Result<()> {
        let w = LinearWeight::Dense(Tensor::zeros((6, 4), DType::F32, &Device::Cpu)?);
        let e = GroupedLinear::from_weight(w.clone(), 4).unwrap_err().to_string();
        assert!(e.contains("4 groups") && e.contains("6 rows"), "{e}");
        let gl = GroupedLinear::from_weight(w, 2)?;
        let e = gl.forward(&Tensor::zeros((1, 3, 4), DType::F32, &Device::Cpu)?).unwrap_err().to_string();
        assert!(e.contains("[T, 2, 4]"), "{e}");
        Ok(())
    }

    /// FP8 groups are views of whole 32-row blocks; other splits are refused.
    #[test]
    fn fp8_rows_need_whole_blocks() -> Result<()> {
        let dev = Device::Cpu;
        let (n, k) = (96, 40);
        let codes: Vec<u8> = (0..n * k).map(|i| (i * 7 % 251) as u8 & 0x7e).collect();
        let scales: Vec<u8> = (0..3 * 2).map(|i| 120 + i as u8).collect();
        let w = Fp8Weight::from_bytes(codes, scales, n, k, &dev)?;
        let r = w.rows(32, 64)?;
        assert_eq!(r.dims(), (64, k));
        assert_eq!(r.dequantize(DType::F32)?.to_vec2::<f32>()?, w.dequantize(DType::F32)?.narrow(0, 32, 64)?.to_vec2::<f32>()?);
        for (s, l) in [(16, 32), (0, 40), (64, 64), (0, 0)] {
            let e = w.rows(s, l).unwrap_err().to_string();
            assert!(e.contains(&format!("rows {s}..{}", s + l)), "{e}");
        }
        assert_eq!(w.rows(64, 32)?.dims(), (32, k));
        let gl = GroupedLinear::from_weight(LinearWeight::Fp8(w.clone()), 3)?;
        assert_eq!(gl.groups(), 3);
        assert!(GroupedLinear::from_weight(LinearWeight::Fp8(w), 2).is_err(), "48-row groups are not whole blocks");
        Ok(())
    }

    /// Both FP8 paths (the stacked product for few rows, a product per group above) give the
    /// dense einsum over the dequantized weight (on the CPU up to the f32 summation order of the
    /// products' row counts).
    #[test]
    fn fp8_paths_match_the_dense_einsum() -> Result<()> {
        let dev = Device::Cpu;
        let (g, og, k) = (3, 32, 64);
        let codes: Vec<u8> = (0..g * og * k).map(|i| (i * 37 % 253) as u8 & 0x7e).collect();
        let scales: Vec<u8> = (0..g * 2).map(|i| 124 + i as u8).collect();
        let w = Fp8Weight::from_bytes(codes, scales, g * og, k, &dev)?;
        let fp8 = GroupedLinear::from_weight(LinearWeight::Fp8(w.clone()), g)?;
        let dense = GroupedLinear::from_weight(LinearWeight::Dense(w.dequantize(DType::F32)?), g)?;
        for t in [1, STACKED_MAX_ROWS / g, STACKED_MAX_ROWS / g + 1, 40] {
            let x = Tensor::randn(0f32, 1.0, (t, g, k), &dev)?;
            let (a, b) = (fp8.forward(&x)?, dense.forward(&x)?);
            assert_eq!(a.dims(), &[t, g * og]);
            let err = (a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(err <= 1e-5 * scale, "t = {t}: max |fp8 - dense| = {err} (max |dense| {scale})");
        }
        Ok(())
    }
}
