//! One V4.1 attention layer for the benchmarks of the batched decode step
//! (`deepseek_v41::attention::decode_batch`, wrapped by `examples/support/batched_step.rs`):
//! the layer's [`Attention`] module — loaded from a checkpoint
//! ([`Weights::from_attention`], `examples/bench_flash_layer.rs`) or built over seeded random
//! weights ([`Weights::random`], `examples/bench_batched_decode.rs`) — with its shapes and the
//! bytes a step reads.
//!
//! The kinds the benchmarks set up ([`LayerKind`], spec §1.4): window-only layers, kv + index
//! sources without candidate blocks (`Full` top-k: layer 2 of V4.1-Flash) and top-k reuse layers
//! (layer 3), and the ratio-1 candidate source (layer 20: a kv + index source that also returns
//! its candidate blocks). The step also composes the `Reindex` layers that consume those blocks
//! (layer 24); the benchmarks do not pass candidate blocks, and refuse them.
#![allow(dead_code)]

use anyhow::Result;
use candle_core::{DType, Device};
use deepseek_v41::attention::{Attention, DecodeLayer, DecodeLayerKind};
use deepseek_v41::config::{CandidateRole, Config};
use deepseek_v41::nn::RandomWeights;
use deepseek_v41::Numerics;

/// What the layer's step does besides the projections, the window and the output (spec §1.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Attention over the window only.
    WindowOnly,
    /// A ratio-2 kv and index source: compressor, compressed entries and index keys, index
    /// scores and top-k over its own keys.
    Source,
    /// Attention over the window and the compressed entries of `kv_source` selected by the
    /// top-k that `index_source` published this step.
    Reuse { kv_source: usize, index_source: usize },
}

impl LayerKind {
    /// A short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::WindowOnly => "window-only",
            LayerKind::Source => "kv + index source",
            LayerKind::Reuse { .. } => "top-k reuse",
        }
    }

    /// Whether the attention reads compressed entries.
    pub fn compressed(self) -> bool {
        self != LayerKind::WindowOnly
    }
}

impl LayerKind {
    /// The kind of `dl`; errors for the layers the benchmarks do not set up (candidate consumers,
    /// `Reindex` layers). The candidate source is a kv + index source that also returns its
    /// candidate blocks (computed every step, consumed by no layer of the benchmark).
    pub fn of(dl: &DecodeLayer) -> Result<Self> {
        let l = dl.layer();
        anyhow::ensure!(
            matches!(dl.candidates(), CandidateRole::None | CandidateRole::Publish),
            "layer {l}: the benchmarks do not pass candidate blocks to a consumer ({:?})",
            dl.candidates()
        );
        Ok(match dl.kind() {
            DecodeLayerKind::WindowOnly => LayerKind::WindowOnly,
            DecodeLayerKind::Source => LayerKind::Source,
            DecodeLayerKind::Reuse { kv_source, index_source } => LayerKind::Reuse { kv_source, index_source },
            DecodeLayerKind::Reindex { key_owner } => anyhow::bail!("layer {l}: the benchmarks do not set up reindex layers (keys of layer {key_owner})"),
        })
    }
}

/// The layer (its module shares the tensors of the module it was cloned from) and its shapes.
pub struct Weights {
    pub layer: usize,
    pub kind: LayerKind,
    pub attn: Attention,
    pub cfg: Config,
    pub h: usize,
    pub hd: usize,
    pub g: usize,
    pub hi: usize,
    pub di: usize,
    pub topk: usize,
    pub window: usize,
    /// The compress ratio (0: window-only).
    pub ratio: usize,
}

impl Weights {
    /// Layer `layer` of `cfg` built over seeded random weights (`RandomWeights`, seed 1: the
    /// values depend on the tensor names only) on `dev`.
    pub fn random(cfg: &Config, layer: usize, dev: &Device) -> Result<Self> {
        let vb = RandomWeights::new(1).var_builder(DType::BF16, dev).pp("layers").pp(layer).pp("attn");
        let attn = Attention::new(cfg, layer, Numerics::REFERENCE, vb)?;
        Self::from_attention(cfg, layer, &attn)
    }

    /// The layer `attn` (layer `layer` of `cfg`); errors for a kind the batched step does not
    /// compose (see the module docs).
    pub fn from_attention(cfg: &Config, layer: usize, attn: &Attention) -> Result<Self> {
        anyhow::ensure!(attn.layer() == layer, "the module is layer {}, not {layer}", attn.layer());
        let dl = DecodeLayer::new(cfg, attn)?;
        Ok(Self {
            layer,
            kind: LayerKind::of(&dl)?,
            ratio: dl.ratio(),
            attn: attn.clone(),
            cfg: cfg.clone(),
            h: cfg.num_attention_heads,
            hd: cfg.head_dim,
            g: cfg.o_groups,
            hi: cfg.index_n_heads,
            di: cfg.index_head_dim,
            topk: cfg.index_topk,
            window: cfg.sliding_window,
        })
    }

    /// The layer as the batched step runs it.
    pub fn decode_layer(&self) -> Result<DecodeLayer<'_>> {
        Ok(DecodeLayer::new(&self.cfg, &self.attn)?)
    }

    /// Bytes of the weights one step reads.
    pub fn bytes(&self) -> f64 {
        let p = self.attn.params();
        let mut linears = vec![p.wq_a, p.wq_b, p.wkv, p.wo_b];
        let mut other = p.wo_a.weight().bytes() as f64;
        if self.kind == LayerKind::Source {
            if let Some(c) = p.compressor {
                linears.push(c.wkv());
                linears.extend(c.wgate());
            }
            if let Some(k) = p.key_projection {
                other += (k.k_norm().weight().elem_count() + self.di * self.hd) as f64 * 2.0;
            }
            if let Some(i) = p.indexer {
                linears.extend([i.wq_b(), i.weights_proj()]);
            }
        }
        linears.into_iter().map(|l| l.weight().bytes() as f64).sum::<f64>() + other
    }
}
