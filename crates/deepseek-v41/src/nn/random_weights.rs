//! A seeded random checkpoint: a [`VarBuilder`] backend that makes up every weight it is asked
//! for, for benchmarks and tests of full-size layers without a real checkpoint.
//!
//! Values depend only on the seed and the tensor's name (not on the device or on the order of
//! requests), so the same layer built on the CPU and on a GPU holds the same weights. They are
//! rounded to bf16 like a release checkpoint's dequantized weights, and scaled so that
//! activations keep unit size: a matrix `[out, in]` is uniform with variance `1/in`, a `*norm*`
//! weight is `1 ± 0.1`, an `attn_sink` uniform in `[-1, 1]`.

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

/// The random backend (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct RandomWeights {
    seed: u64,
}

impl RandomWeights {
    /// A backend with the given seed.
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// A [`VarBuilder`] over this backend: weights in `dtype` on `device`.
    pub fn var_builder(self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self), dtype, device.clone())
    }

    /// The values of tensor `name` of shape `dims`, as f32 holding bf16 values.
    pub fn values(&self, name: &str, dims: &[usize]) -> Vec<f32> {
        let n: usize = dims.iter().product();
        let mut state = name.bytes().fold(self.seed ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        let (center, half_width) = if name.contains("norm") {
            (1.0, 0.1)
        } else if name.ends_with("attn_sink") {
            (0.0, 1.0)
        } else {
            let fan_in = dims.last().copied().unwrap_or(1).max(1) as f32;
            (0.0, (3.0 / fan_in).sqrt())
        };
        (0..n)
            .map(|_| {
                let u = (splitmix64(&mut state) >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                half::bf16::from_f32(center + half_width * (2.0 * u - 1.0)).to_f32()
            })
            .collect()
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SimpleBackend for RandomWeights {
    fn get(&self, s: Shape, name: &str, _h: candle_nn::Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let v = self.values(name, s.dims());
        Tensor::from_vec(v, s, &Device::Cpu)?.to_dtype(dtype)?.to_device(dev)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        candle_core::bail!("RandomWeights: `{name}` requested without a shape (the backend needs one to make it up)")
    }

    /// Every name, except the virtual names of stored FP8 parts (`crate::loader::native`): the
    /// random weights are dense.
    fn contains_tensor(&self, name: &str) -> bool {
        crate::loader::StoredPart::parse(name).is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_by_name_and_scaled() -> Result<()> {
        let r = RandomWeights::new(7);
        let a = r.values("layers.0.attn.wq_a.weight", &[64, 256]);
        assert_eq!(a, r.values("layers.0.attn.wq_a.weight", &[64, 256]));
        assert_ne!(a, r.values("layers.1.attn.wq_a.weight", &[64, 256]));
        assert_ne!(a, RandomWeights::new(8).values("layers.0.attn.wq_a.weight", &[64, 256]));
        let var = a.iter().map(|x| x * x).sum::<f32>() / a.len() as f32;
        assert!((var * 256.0 - 1.0).abs() < 0.1, "variance·fan_in = {}", var * 256.0);
        let norm = r.values("q_norm.weight", &[64]);
        assert!(norm.iter().all(|&x| (0.89..=1.11).contains(&x)));
        let vb = r.var_builder(DType::F32, &Device::Cpu);
        let w = vb.get((3, 4), "x")?;
        assert_eq!(w.dims(), &[3, 4]);
        Ok(())
    }
}
