//! Attention layers of a config with random weights run over chunked calls on one cache: the
//! comparisons of `tests/cuda_layer.rs` and `tests/cuda_any_config.rs` (GPU against CPU).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::{Attention, CacheStorage, SequenceCache};
use deepseek_v41::config::Config;
use deepseek_v41::nn::RandomWeights;
use deepseek_v41::Numerics;

use crate::rng::Rng;

/// Every attention layer of `cfg` with the random weights of `seed`, on `dev`.
pub fn random_layers(cfg: &Config, dev: &Device, seed: u64) -> Result<Vec<Attention>> {
    let vb = RandomWeights::new(seed).var_builder(DType::BF16, dev);
    Ok((0..cfg.num_hidden_layers)
        .map(|l| Attention::new(cfg, l, Numerics::REFERENCE, vb.pp("layers").pp(l).pp("attn")))
        .collect::<candle_core::Result<Vec<_>>>()?)
}

/// Every layer of `cfg` (random weights of `seed`) over `calls` (chunk lengths) on a cache in
/// `storage`; each layer's outputs.
pub fn run_layers_with(cfg: &Config, dev: &Device, xs: &[Tensor], calls: &[usize], storage: CacheStorage, seed: u64) -> Result<Vec<Tensor>> {
    let layers = random_layers(cfg, dev, seed)?;
    let mut cache = SequenceCache::with_storage(cfg, storage, DType::BF16, dev)?;
    let mut outs = vec![Vec::new(); layers.len()];
    let mut start = 0;
    for &n in calls {
        for (l, a) in layers.iter().enumerate() {
            outs[l].push(a.forward(&xs[l].narrow(0, start, n)?.to_device(dev)?, start, &mut cache)?);
        }
        start += n;
    }
    Ok(outs.iter().map(|o| Tensor::cat(o, 0)).collect::<candle_core::Result<Vec<_>>>()?)
}

/// Random bf16 inputs `[n, hidden]` for every layer of `cfg`.
pub fn layer_inputs(cfg: &Config, rng: &mut Rng, n: usize) -> Result<Vec<Tensor>> {
    Ok((0..cfg.num_hidden_layers)
        .map(|_| {
            let v: Vec<f32> = (0..n * cfg.hidden_size).map(|_| rng.normal()).collect();
            Tensor::from_vec(v, (n, cfg.hidden_size), &Device::Cpu)?.to_dtype(DType::BF16)
        })
        .collect::<candle_core::Result<Vec<_>>>()?)
}
