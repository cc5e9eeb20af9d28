//! The scenario of `tests/decode_batch.rs` (CPU) and `tests/cuda_decode_batch.rs` (GPU): every
//! layer of the tiny config (window-only, ratio-2 kv + index sources, top-k reuse, the ratio-1
//! candidate source, its reuse layer, the ratio-1 `Reindex` candidate consumer and its reuse
//! layer) with random weights; B sequences prefilled one at a time to different lengths, their
//! caches loaded into the batched pools, then decode steps of all B at once
//! (`attention::decode_batch`) next to the same tokens one sequence at a time
//! (`Attention::forward`).

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::{
    Attention, BatchStorage, BatchedLayerCache, DecodeLayer, DecodeLayerKind, DecodeStep, DecodeStepInputs, DecodeStepOutput, PageTable, PoolRows,
    Published, SequenceCache,
};
use deepseek_v41::config::{CandidateRole, Config};
use deepseek_v41::nn::RandomWeights;
use deepseek_v41::Numerics;

use crate::rng::Rng;

/// Every layer of `cfg` with the random weights of `seed`, on `dev`.
pub fn random_layers(cfg: &Config, dev: &Device, seed: u64) -> Result<Vec<Attention>> {
    let vb = RandomWeights::new(seed).var_builder(DType::BF16, dev);
    Ok((0..cfg.num_hidden_layers)
        .map(|l| Attention::new(cfg, l, Numerics::REFERENCE, vb.pp("layers").pp(l).pp("attn")))
        .collect::<candle_core::Result<Vec<_>>>()?)
}

/// `[rows, hidden]` bf16 random layer inputs on `dev`, one per layer.
pub fn layer_inputs(cfg: &Config, rng: &mut Rng, rows: usize, dev: &Device) -> Result<Vec<Tensor>> {
    (0..cfg.num_hidden_layers)
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

/// One sequence's output of one layer, its top-k (`[1, k]` entry ids, index sources only) and
/// the candidate blocks it published (`[1, n_keep]`, the candidate source only).
pub struct Alone {
    pub y: Tensor,
    pub topk: Option<Tensor>,
    pub candidates: Option<Tensor>,
}

/// The decode step of every sequence alone at `positions` (`xs`: the `[B, hidden]` inputs per
/// layer): per layer, per sequence.
pub fn one_at_a_time(cfg: &Config, layers: &[Attention], caches: &mut [SequenceCache], xs: &[Tensor], positions: &[usize]) -> Result<Vec<Vec<Alone>>> {
    let mut out: Vec<Vec<Alone>> = (0..layers.len()).map(|_| Vec::new()).collect();
    for (s, cache) in caches.iter_mut().enumerate() {
        for (l, a) in layers.iter().enumerate() {
            let p = positions[s];
            let y = a.forward(&xs[l].narrow(0, s, 1)?, p, cache)?;
            let role = cfg.layers[l];
            let topk = if role.is_index_source() { Some(cache.published_topk(l, p, 1)?.clone()) } else { None };
            let candidates = match role.candidates() {
                CandidateRole::Publish => Some(cache.published_candidates(p).map(|c| c.kept.clone()).ok_or_else(|| anyhow::anyhow!("layer {l}: no candidates"))?),
                _ => None,
            };
            out[l].push(Alone { y, topk, candidates });
        }
    }
    Ok(out)
}

/// The batched pools, step layers and inputs of the scenario's layers.
pub struct Batch<'a> {
    pub layers: Vec<DecodeLayer<'a>>,
    pub caches: Vec<BatchedLayerCache>,
    /// The step inputs, one per RoPE frequency set and cache geometry: the window-only layers
    /// share one, each kv source and the layers that read its entries another.
    pub inputs: Vec<DecodeStepInputs>,
    /// Per layer, its entry of `inputs`.
    pub input_of: Vec<usize>,
}

impl<'a> Batch<'a> {
    /// Zeroed pools for `b` sequences of `entries` compressed entries each, in `storage` (the
    /// default page pools: every sequence can hold `entries`).
    pub fn new(cfg: &Config, attn: &'a [Attention], b: usize, entries: usize, storage: BatchStorage, dev: &Device) -> Result<Self> {
        Self::paged(cfg, attn, b, entries, b * entries.div_ceil(PageTable::PAGE), storage, dev)
    }

    /// [`Batch::new`] with page pools of `pages` pages per kv source.
    pub fn paged(cfg: &Config, attn: &'a [Attention], b: usize, entries: usize, pages: usize, storage: BatchStorage, dev: &Device) -> Result<Self> {
        let layers = attn.iter().map(|a| DecodeLayer::new(cfg, a)).collect::<candle_core::Result<Vec<_>>>()?;
        let caches =
            layers.iter().map(|l| BatchedLayerCache::zeros_paged(l, b, entries, pages, storage, dev)).collect::<candle_core::Result<Vec<_>>>()?;
        Self::over(layers, caches)
    }

    /// New step layers and inputs over the pools `caches` (one per layer).
    pub fn over(layers: Vec<DecodeLayer<'a>>, caches: Vec<BatchedLayerCache>) -> Result<Self> {
        let (mut inputs, mut input_of, mut keys) = (Vec::new(), Vec::new(), Vec::new());
        for (l, layer) in layers.iter().enumerate() {
            let key = layer.kv_source();
            let i = match keys.iter().position(|k| *k == key) {
                Some(i) => i,
                None => {
                    let kv = Self::kv_of(layer, &caches);
                    inputs.push(DecodeStepInputs::new(layer, &caches[l], kv)?);
                    keys.push(key);
                    inputs.len() - 1
                }
            };
            input_of.push(i);
        }
        Ok(Self { layers, caches, inputs, input_of })
    }

    /// The kv source's cache a layer's step takes (reindex and reuse layers only).
    fn kv_of<'c>(layer: &DecodeLayer, caches: &'c [BatchedLayerCache]) -> Option<&'c BatchedLayerCache> {
        match layer.kind() {
            DecodeLayerKind::Reindex { .. } | DecodeLayerKind::Reuse { .. } => layer.kv_source().map(|s| &caches[s]),
            DecodeLayerKind::WindowOnly | DecodeLayerKind::Source => None,
        }
    }

    /// The inputs of layer `l`.
    pub fn inputs_of(&self, l: usize) -> &DecodeStepInputs {
        &self.inputs[self.input_of[l]]
    }

    /// The page table of the compressed pool layer `l` reads (`None`: window-only).
    pub fn pages(&self, l: usize) -> Option<&PageTable> {
        self.layers[l].kv_source().and_then(|s| self.caches[s].pages())
    }

    /// Loads every sequence's cache into its row of every layer's pools.
    pub fn load(&self, seqs: &[SequenceCache]) -> Result<()> {
        for c in &self.caches {
            for (s, seq) in seqs.iter().enumerate() {
                c.load_sequence(s, seq)?;
            }
        }
        Ok(())
    }

    /// [`Batch::load`], the pages of each kv source taken first one per sequence in turn (page
    /// i of every sequence before page i + 1 of any): a sequence of more than one page holds
    /// pages that are not adjacent.
    pub fn load_interleaved(&self, seqs: &[SequenceCache]) -> Result<()> {
        for c in &self.caches {
            let Some(pages) = c.pages() else { continue };
            let n: Vec<usize> = seqs.iter().map(|s| Ok(s.source(c.layer())?.compressed.len())).collect::<Result<_>>()?;
            for k in 1..=pages.max_pages() {
                pages.grow(&n.iter().map(|&n| n.min(k * PageTable::PAGE)).collect::<Vec<_>>())?;
            }
        }
        self.load(seqs)
    }

    /// Loads `seq` into row `row` of every layer's pools.
    pub fn load_one(&self, row: usize, seq: &SequenceCache) -> Result<()> {
        for c in &self.caches {
            c.load_sequence(row, seq)?;
        }
        Ok(())
    }

    /// Returns row `row`'s pages in every kv source.
    pub fn release(&self, row: usize) -> Result<()> {
        for c in &self.caches {
            c.release(row)?;
        }
        Ok(())
    }

    /// Every inputs object at `positions` (all checked first, as `ModelDecodeStep::update` does:
    /// a full page pool changes nothing).
    pub fn update(&self, positions: &[usize]) -> Result<()> {
        for i in &self.inputs {
            i.check(positions)?;
        }
        for i in &self.inputs {
            i.update(positions)?;
        }
        Ok(())
    }

    /// Whether some sequence holds two pages that are not adjacent in some kv source.
    pub fn pages_interleaved(&self) -> bool {
        self.caches.iter().filter_map(|c| c.pages()).any(|p| {
            (0..p.batch()).any(|s| p.pages_of(s).windows(2).any(|w| w[1] != w[0] + 1))
        })
    }

    /// The step of every layer.
    pub fn steps(&self) -> Result<Vec<DecodeStep<'_>>> {
        (0..self.layers.len())
            .map(|l| Ok(DecodeStep::new(&self.layers[l], &self.caches[l], Self::kv_of(&self.layers[l], &self.caches), self.inputs_of(l))?))
            .collect()
    }
}

/// Every layer's step over its input `xs[l]` (`[B, hidden]`), in layer order: a reuse layer takes
/// its index source's top-k, a candidate consumer the candidate source's blocks.
pub fn forward(steps: &[DecodeStep], xs: &[Tensor]) -> Result<Vec<DecodeStepOutput>> {
    let mut outs: Vec<DecodeStepOutput> = Vec::new();
    for (step, x) in steps.iter().zip(xs) {
        let layer = step.layer();
        let topk = match layer.kind() {
            DecodeLayerKind::Reuse { index_source, .. } => outs[index_source].topk.as_ref(),
            _ => None,
        };
        let candidates = match layer.candidates() {
            CandidateRole::Consume { source } => outs[source].candidates.as_ref(),
            _ => None,
        };
        let out = step.forward(x, Published { topk, candidates })?;
        outs.push(out);
    }
    Ok(outs)
}

/// The bits of `t` (any float dtype, any device) as f32 words.
pub fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// The entry ids of a batched top-k `[B, k]` (pool rows, −1 kept): pool row s of sequence b is
/// entry `i·P + s mod P` where page `s / P` is b's i-th page (−2: a row outside b's pages).
pub fn entry_ids(topk: &Tensor, pages: Option<&PageTable>) -> Result<Vec<Vec<i64>>> {
    let pages = pages.ok_or_else(|| anyhow::anyhow!("a top-k of a layer without a page table"))?;
    let p = PageTable::PAGE as i64;
    Ok(topk
        .to_device(&Device::Cpu)?
        .to_vec2::<i64>()?
        .into_iter()
        .enumerate()
        .map(|(b, row)| {
            let held = pages.pages_of(b);
            row.into_iter()
                .map(|s| match (s >= 0).then(|| held.iter().position(|&pg| pg as i64 == s / p)).flatten() {
                    Some(i) => i as i64 * p + s % p,
                    None if s < 0 => -1,
                    None => -2,
                })
                .collect()
        })
        .collect())
}

/// The pool slots of sequence `seq`'s first `n` entries.
pub fn entry_slots(pages: &PageTable, seq: usize, n: usize) -> Result<Vec<usize>> {
    (0..n).map(|j| pages.slot(seq, j).ok_or_else(|| anyhow::anyhow!("sequence {seq} holds no page for entry {j}"))).collect()
}

/// The rows of a pool at `slots`, as bf16 on the CPU.
pub fn pool_slots(p: &PoolRows, slots: &[usize]) -> Result<Tensor> {
    Ok(match p {
        PoolRows::Bf16(t) => {
            let idx = Tensor::from_vec(slots.iter().map(|&s| s as u32).collect::<Vec<_>>(), slots.len(), &Device::Cpu)?;
            t.to_device(&Device::Cpu)?.index_select(&idx, 0)?
        }
        #[cfg(feature = "cuda")]
        PoolRows::Packed(t, l) => l.unpack(t, slots)?.to_dtype(DType::BF16)?,
    })
}

/// The positions of the scenario's sequences at step `t`, checked to cover the cases the tests
/// are about (before any entry, closing a group, opening one, past the window).
pub fn positions(starts: &[usize], t: usize, window: usize) -> Result<Vec<usize>> {
    let p: Vec<usize> = starts.iter().map(|&s| s + t).collect();
    ensure!(p.iter().any(|&p| p % 2 == 1) && p.iter().any(|&p| p % 2 == 0), "positions {p:?}: want closing and opening sequences");
    ensure!(p.iter().any(|&p| p + 1 >= window), "positions {p:?}: want a sequence past the window");
    Ok(p)
}
