//! [`LinearPair`]: two linears of one input — the attention's `wq_a` and `wkv` (spec §4.1), its
//! `wq_b` and the indexer's `wq_b` (both of the q-LoRA activation) — computed as one product where
//! that saves a launch.
//!
//! On CUDA, when both weights are FP8 as stored, of the same kind and input quantization, with
//! the same K and the first's N a multiple of 32, the pair holds one weight stacking them along N
//! ([`Fp8Weight::stack`]; the two linears' weights become views of it, so the device holds the
//! same bytes) and a decode-sized call is one launch of the FP8 streaming kernel writing both
//! outputs ([`crate::cuda::fp8_linear_split`]). Every output feature is the dot product of its own
//! weight row, so each output is its linear's product up to the kernel's f32 summation order (the
//! split-K factor follows the stacked N) — the FP8 kernels' contract with the reference
//! ([`crate::quant::fp8_linear_ref`]). Elsewhere (the CPU, dense weights, large calls,
//! `DSV41_UNFUSE=stacked`) the two linears run as before: one call each, and for one sequence
//! ([`LinearPair::forward`]) over one activation quantization of the input when they have the
//! same kind and numerics.

use candle_core::{Module, Result, Tensor};

use super::linear::Linear;
use super::row_groups::RowGroups;
use crate::quant::Fp8Weight;

/// Two linears of one input (see the module docs).
#[derive(Debug, Clone)]
pub struct LinearPair {
    first: Linear,
    second: Linear,
    /// The stacked FP8 weight `[N₁ + N₂, K]` whose row views the two linears hold.
    stacked: Option<Fp8Weight>,
}

impl LinearPair {
    /// The pair `first`, `second` (same input width), stacked where the module docs say.
    pub fn new(first: Linear, second: Linear) -> Result<Self> {
        let stacked = match (first.weight().fp8(), second.weight().fp8()) {
            (Some(a), Some(b))
                if cfg!(feature = "cuda")
                    && a.device().is_cuda()
                    && first.kind() == second.kind()
                    && first.quantizes_input() == second.quantizes_input()
                    && a.dims().1 == b.dims().1
                    && a.dims().0.is_multiple_of(32) =>
            {
                Some(a.stack(b)?)
            }
            _ => None,
        };
        let Some(w) = stacked else {
            return Ok(Self { first, second, stacked: None });
        };
        let (n1, n2) = (first.weight().dims()?.0, second.weight().dims()?.0);
        Ok(Self { first: first.with_fp8(w.rows(0, n1)?), second: second.with_fp8(w.rows(n1, n2)?), stacked: Some(w) })
    }

    /// The first linear (`wq_a`, `wq_b`).
    pub fn first(&self) -> &Linear {
        &self.first
    }

    /// The second linear (`wkv`, `indexer.wq_b`).
    pub fn second(&self) -> &Linear {
        &self.second
    }

    /// Whether the weights are stacked (one launch per decode-sized call on CUDA).
    pub fn is_stacked(&self) -> bool {
        self.stacked.is_some()
    }

    /// `(first(x), second(x))` for `x` `[m, in]` holding the rows of several sequences split as
    /// `groups`: the stacked product where it applies, else [`Linear::forward_grouped`] of each.
    pub fn forward_grouped(&self, x: &Tensor, groups: &RowGroups) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if let Some(y) = self.stacked_forward(x)? {
            return Ok(y);
        }
        Ok((self.first.forward_grouped(x, groups)?, self.second.forward_grouped(x, groups)?))
    }

    /// `(first(x), second(x))` for one sequence's rows `x` `[m, in]`: the stacked product where it
    /// applies, else the two products of one [`Linear::prepare_input`] of `x` when the linears
    /// have the same kind and input quantization (bit for bit each linear's `forward` for a dense
    /// or MXFP4 weight; for an FP8 weight on CUDA up to the kernels' f32 summation order), else
    /// each linear's `forward`.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if let Some(y) = self.stacked_forward(x)? {
            return Ok(y);
        }
        if self.first.kind() == self.second.kind() && self.first.quantizes_input() == self.second.quantizes_input() {
            let xq = self.first.prepare_input(x)?;
            return Ok((self.first.forward_prepared(&xq)?, self.second.forward_prepared(&xq)?));
        }
        Ok((self.first.forward(x)?, self.second.forward(x)?))
    }

    /// The stacked product where it applies: a stacked pair, a contiguous `[m, in]` bf16 input
    /// the FP8 kernel quantizes itself, m within the streaming kernel's decode sizes.
    #[cfg(feature = "cuda")]
    fn stacked_forward(&self, x: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        use crate::cuda::{auto_streams, fp8_linear_split, fused_kernels, unfused, Fp8LinearOptions};
        let Some(w) = &self.stacked else { return Ok(None) };
        let rows = match x.dims() {
            &[m, _] => m,
            _ => return Ok(None),
        };
        if self.first.fused_fp8(x.device(), x.dtype()).is_none() || !fused_kernels(x.device()) || unfused("stacked") || rows == 0 || !auto_streams(rows) {
            return Ok(None);
        }
        let n1 = self.first.weight().dims()?.0;
        fp8_linear_split(x, w, true, Fp8LinearOptions::default(), n1).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::nn::LinearKind;
    use crate::numerics::Numerics;

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    /// On the CPU a pair is not stacked and gives each linear's own output, in order, for one
    /// sequence and for rows of several (each group as its own call).
    #[test]
    fn cpu_pair_is_the_two_linears() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let numerics = Numerics::REFERENCE;
        let w1 = Tensor::randn(0f32, 0.05, (64, 96), &dev)?;
        let w2 = Tensor::randn(0f32, 0.05, (32, 96), &dev)?;
        let (a, b) = (Linear::from_weight(w1, LinearKind::Quantized, numerics), Linear::from_weight(w2, LinearKind::Quantized, numerics));
        let pair = LinearPair::new(a.clone(), b.clone())?;
        assert!(!pair.is_stacked());
        let x = Tensor::randn(0f32, 1.0, (5, 96), &dev)?;
        let (ya, yb) = pair.forward(&x)?;
        assert_eq!((bits(&ya), bits(&yb)), (bits(&a.forward(&x)?), bits(&b.forward(&x)?)));
        let groups = RowGroups::from_lens([2, 3]);
        let (ga, gb) = pair.forward_grouped(&x, &groups)?;
        assert_eq!((bits(&ga), bits(&gb)), (bits(&a.forward_grouped(&x, &groups)?), bits(&b.forward_grouped(&x, &groups)?)));
        Ok(())
    }
}
