//! Random weights whose routed experts are MXFP4 (what the release stores): a `VarBuilder`
//! backend over `nn::RandomWeights` that offers every routed expert's linear
//! (`*.ffn.experts.E.w{1,2,3}`) as the stored parts of an MXFP4 weight (`weight#e2m1`,
//! `weight#e8m0`, `loader::native`) with random codes and scales of trained magnitudes, and as
//! the dense weight those parts dequantize to: a model built on CUDA keeps the parts (grouped
//! expert kernels, the MoE on the device), on the CPU the same numbers dense.

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use deepseek_v41::loader::StoredPart;
use deepseek_v41::nn::RandomWeights;
use deepseek_v41::quant::Mxfp4Weight;

/// The backend (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Mxfp4Experts {
    seed: u64,
}

impl Mxfp4Experts {
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }

    pub fn var_builder(self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self), dtype, device.clone())
    }

    /// The parts of expert weight `base` (`…experts.E.wN.weight`) of logical shape `[n, k]`:
    /// random codes, scales 2^−⌈log2 √(8.7·k)⌉ (unit-size outputs: e2m1 values have a mean square
    /// of about 8.7).
    fn parts(&self, base: &str, n: usize, k: usize) -> (Vec<u8>, Vec<u8>) {
        let mut state = base.bytes().fold(self.seed ^ 0x4d58_4650_3400_0001, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        let codes = (0..n * k / 2).map(|_| (splitmix64(&mut state) >> 56) as u8).collect();
        let e = (8.7 * k as f64).sqrt().log2().ceil() as i32;
        let scales = (0..n * (k / 32)).map(|i| (127 - e - (i % 2) as i32) as u8).collect();
        (codes, scales)
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Whether `name` is a routed expert's weight (not the shared expert's).
fn routed(name: &str) -> bool {
    name.contains(".ffn.experts.") && name.ends_with(".weight")
}

impl SimpleBackend for Mxfp4Experts {
    fn get(&self, s: Shape, name: &str, h: candle_nn::Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        match StoredPart::parse(name) {
            Some((base, part)) if routed(base) => {
                let d = s.dims();
                let (n, k) = match part {
                    StoredPart::Fp4Codes => (d[0], d[1] * 2),
                    _ => (d[0], d[1] * 32),
                };
                let (codes, scales) = self.parts(base, n, k);
                let bytes = if part == StoredPart::Fp4Codes { codes } else { scales };
                Tensor::from_vec(bytes, s, &Device::Cpu)?.to_device(dev)
            }
            _ if routed(name) => {
                let (n, k) = s.dims2()?;
                let (codes, scales) = self.parts(name, n, k);
                Mxfp4Weight::from_bytes(codes, scales, n, k, &Device::Cpu)?.dequantize(DType::F32)?.to_dtype(dtype)?.to_device(dev)
            }
            _ => RandomWeights::new(self.seed).get(s, name, h, dtype, dev),
        }
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        candle_core::bail!("Mxfp4Experts: `{name}` requested without a shape")
    }

    /// The routed experts' MXFP4 parts and every dense name; no FP8 parts.
    fn contains_tensor(&self, name: &str) -> bool {
        match StoredPart::parse(name) {
            Some((base, StoredPart::Fp4Codes | StoredPart::Scales)) => routed(base),
            Some(_) => false,
            None => true,
        }
    }
}
