//! The scenario of `tests/decode_batch.rs` (CPU) and `tests/cuda_decode_batch.rs` (GPU): layers
//! 0..=3 of the tiny config (window-only, ratio-2 kv + index source, top-k reuse of layer 1,
//! another ratio-2 source) with random weights; B sequences prefilled one at a time to different
//! lengths, their caches loaded into the batched pools, then decode steps of all B at once
//! (`attention::decode_batch`) next to the same tokens one sequence at a time
//! (`Attention::forward`).

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::{
    Attention, BatchStorage, BatchedLayerCache, DecodeLayer, DecodeStep, DecodeStepInputs, DecodeStepOutput, SequenceCache,
};
use deepseek_v41::config::Config;
use deepseek_v41::nn::RandomWeights;
use deepseek_v41::Numerics;

use crate::rng::Rng;

/// The layers of the scenario (0: window-only, 1: kv + index source, 2: reuse of 1, 3: source).
pub const LAYERS: usize = 4;
/// The index source whose top-k layer 2 reuses.
pub const INDEX_SOURCE: usize = 1;

/// Layers `0..LAYERS` of `cfg` with the random weights of `seed`, on `dev`.
pub fn random_layers(cfg: &Config, dev: &Device, seed: u64) -> Result<Vec<Attention>> {
    let vb = RandomWeights::new(seed).var_builder(DType::BF16, dev);
    Ok((0..LAYERS).map(|l| Attention::new(cfg, l, Numerics::REFERENCE, vb.pp("layers").pp(l).pp("attn"))).collect::<candle_core::Result<Vec<_>>>()?)
}

/// `[rows, hidden]` bf16 random layer inputs on `dev`, one per layer.
pub fn layer_inputs(cfg: &Config, rng: &mut Rng, rows: usize, dev: &Device) -> Result<Vec<Tensor>> {
    (0..LAYERS)
        .map(|_| {
            let v: Vec<f32> = (0..rows * cfg.hidden_size).map(|_| rng.normal()).collect();
            Ok(Tensor::from_vec(v, (rows, cfg.hidden_size), &Device::Cpu)?.to_dtype(DType::BF16)?.to_device(dev)?)
        })
        .collect()
}

/// One cache per sequence, each prefilled (one call per sequence, every layer in order) with
/// `starts[s]` random tokens.
pub fn prefill(cfg: &Config, layers: &[Attention], starts: &[usize], rng: &mut Rng, dev: &Device) -> Result<Vec<SequenceCache>> {
    let mut caches = Vec::new();
    for &n in starts {
        let mut cache = SequenceCache::new(cfg, DType::BF16, dev)?;
        if n > 0 {
            let xs = layer_inputs(cfg, rng, n, dev)?;
            for (a, x) in layers.iter().zip(&xs) {
                a.forward(x, 0, &mut cache)?;
            }
        }
        caches.push(cache);
    }
    Ok(caches)
}

/// The decode step of every sequence alone at `positions` (`xs`: the `[B, hidden]` inputs per
/// layer): per layer, per sequence, `(y [1, hidden], top-k [1, k] entry ids of the index
/// sources, else None)`.
/// One sequence's output of one layer and its top-k (index sources only).
pub type Alone = (Tensor, Option<Tensor>);

pub fn one_at_a_time(layers: &[Attention], caches: &mut [SequenceCache], xs: &[Tensor], positions: &[usize]) -> Result<Vec<Vec<Alone>>> {
    let mut out = vec![Vec::new(); layers.len()];
    for (s, cache) in caches.iter_mut().enumerate() {
        for (l, a) in layers.iter().enumerate() {
            let y = a.forward(&xs[l].narrow(0, s, 1)?, positions[s], cache)?;
            let topk = match l {
                1 | 3 => Some(cache.published_topk(l, positions[s], 1)?.clone()),
                _ => None,
            };
            out[l].push((y, topk));
        }
    }
    Ok(out)
}

/// The batched pools, step layers and inputs of the scenario's layers.
pub struct Batch<'a> {
    pub layers: Vec<DecodeLayer<'a>>,
    pub caches: Vec<BatchedLayerCache>,
    /// Inputs of the window-only layer (plain RoPE) and of the ratio-2 layers (YaRN RoPE,
    /// shared by both sources and the reuse layer: same geometry).
    pub window_inputs: DecodeStepInputs,
    pub compressed_inputs: DecodeStepInputs,
}

impl<'a> Batch<'a> {
    /// Zeroed pools for `b` sequences of `entries` compressed entries each, in `storage`.
    pub fn new(cfg: &Config, attn: &'a [Attention], b: usize, entries: usize, storage: BatchStorage, dev: &Device) -> Result<Self> {
        let layers = attn.iter().map(|a| DecodeLayer::new(cfg, a)).collect::<candle_core::Result<Vec<_>>>()?;
        let caches = layers.iter().map(|l| BatchedLayerCache::zeros(l, b, entries, storage, dev)).collect::<candle_core::Result<Vec<_>>>()?;
        let window_inputs = DecodeStepInputs::new(&layers[0], &caches[0], None)?;
        let compressed_inputs = DecodeStepInputs::new(&layers[1], &caches[1], None)?;
        Ok(Self { layers, caches, window_inputs, compressed_inputs })
    }

    /// Loads every sequence's cache into its region of every layer's pools.
    pub fn load(&self, seqs: &[SequenceCache]) -> Result<()> {
        for c in &self.caches {
            for (s, seq) in seqs.iter().enumerate() {
                c.load_sequence(s, seq)?;
            }
        }
        Ok(())
    }

    /// Both inputs at `positions`.
    pub fn update(&self, positions: &[usize]) -> Result<()> {
        self.window_inputs.update(positions)?;
        self.compressed_inputs.update(positions)?;
        Ok(())
    }

    /// The step of every layer.
    pub fn steps(&self) -> Result<Vec<DecodeStep<'_>>> {
        (0..LAYERS)
            .map(|l| {
                let (kv, inputs) = match l {
                    0 => (None, &self.window_inputs),
                    2 => (Some(&self.caches[INDEX_SOURCE]), &self.compressed_inputs),
                    _ => (None, &self.compressed_inputs),
                };
                Ok(DecodeStep::new(&self.layers[l], &self.caches[l], kv, inputs)?)
            })
            .collect()
    }
}

/// Every layer's step over its input `xs[l]` (`[B, hidden]`), in layer order (the reuse layer
/// takes its index source's top-k).
pub fn forward(steps: &[DecodeStep], xs: &[Tensor]) -> Result<Vec<DecodeStepOutput>> {
    let mut outs: Vec<DecodeStepOutput> = Vec::new();
    for (l, step) in steps.iter().enumerate() {
        let reuse = if l == 2 { outs[INDEX_SOURCE].topk.clone() } else { None };
        outs.push(step.forward(&xs[l], reuse.as_ref())?);
    }
    Ok(outs)
}

/// The bits of `t` (any float dtype, any device) as f32 words.
pub fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// The entry ids of a batched top-k `[B, k]` (pool rows, −1 kept): row b minus `b · stride`.
pub fn entry_ids(topk: &Tensor, stride: usize) -> Result<Vec<Vec<i64>>> {
    Ok(topk
        .to_device(&Device::Cpu)?
        .to_vec2::<i64>()?
        .into_iter()
        .enumerate()
        .map(|(b, row)| row.into_iter().map(|j| if j >= 0 { j - (b * stride) as i64 } else { -1 }).collect())
        .collect())
}

/// The positions of the scenario's sequences at step `t`, checked to cover the cases the tests
/// are about (before any entry, closing a group, opening one, past the window).
pub fn positions(starts: &[usize], t: usize, window: usize) -> Result<Vec<usize>> {
    let p: Vec<usize> = starts.iter().map(|&s| s + t).collect();
    ensure!(p.iter().any(|&p| p % 2 == 1) && p.iter().any(|&p| p % 2 == 0), "positions {p:?}: want closing and opening sequences");
    ensure!(p.iter().any(|&p| p + 1 >= window), "positions {p:?}: want a sequence past the window");
    Ok(p)
}
