//! The weights of one V4.1 attention layer for the batched decode step that
//! `examples/support/batched_step.rs` composes from the crate's device ops: taken from an
//! [`Attention`] module ([`Weights::from_attention`]: a layer loaded from a checkpoint, as in
//! `examples/bench_flash_layer.rs`), or from one built over seeded random weights
//! ([`Weights::random`], `examples/bench_batched_decode.rs`).
//!
//! The kinds the step composes ([`LayerKind`], spec §1.4): window-only layers, ratio-2 kv +
//! index sources (`Full` top-k without candidate blocks: layer 2 of V4.1-Flash) and top-k reuse
//! layers (layer 3). The ratio-1 candidate source and the `Reindex` layers that consume its
//! candidate blocks (layers 20 and 24) are not composed here.
#![allow(dead_code)]

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::indexer::IndexKeyProjection;
use deepseek_v41::attention::Attention;
use deepseek_v41::config::{AttentionRole, CandidateRole, Config, TopkRole};
use deepseek_v41::nn::{GroupedLinear, Linear, RandomWeights, RmsNorm, RopeTable};
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

/// The compressor and index-key projection of a kv source.
pub struct CompressorWeights {
    /// `compressor.wkv`, `compressor.wgate` (f32 products).
    pub wkv: Linear,
    pub wgate: Linear,
    pub norm: RmsNorm,
    pub keys: IndexKeyProjection,
}

/// The query side of an index source.
pub struct IndexerWeights {
    /// `indexer.wq_b` (quantized), `indexer.weights_proj` (plain).
    pub iq_b: Linear,
    pub w_proj: Linear,
}

/// The layer's weights (shared with the module they come from: the tensors are not copied).
pub struct Weights {
    pub layer: usize,
    pub kind: LayerKind,
    pub wq_a: Linear,
    pub q_norm: RmsNorm,
    pub wq_b: Linear,
    pub wkv: Linear,
    pub kv_norm: RmsNorm,
    /// The grouped `wo_a` (dense bf16 or FP8 as stored on CUDA).
    pub wo_a: GroupedLinear,
    pub wo_b: Linear,
    /// `[H]` f32.
    pub sink: Tensor,
    /// Kv sources only.
    pub compressor: Option<CompressorWeights>,
    /// Index sources only.
    pub indexer: Option<IndexerWeights>,
    pub rope: RopeTable,
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

    /// The weights of `attn`, layer `layer` of `cfg`; errors for a kind the batched step does
    /// not compose (see the module docs).
    pub fn from_attention(cfg: &Config, layer: usize, attn: &Attention) -> Result<Self> {
        let role = attn.role();
        let (kind, ratio) = match role {
            AttentionRole::WindowOnly => (LayerKind::WindowOnly, 0),
            AttentionRole::Compressed { ratio: 2, kv_source, topk: TopkRole::Full { candidates: CandidateRole::None } } if kv_source == layer => {
                (LayerKind::Source, 2)
            }
            AttentionRole::Compressed { ratio, kv_source, topk: TopkRole::Reuse { index_source } } => {
                (LayerKind::Reuse { kv_source, index_source }, ratio)
            }
            _ => bail!(
                "layer {layer} ({role:?}) is not composed by the batched step: it takes window-only layers, ratio-2 kv + index \
                 sources without candidate blocks and top-k reuse layers"
            ),
        };
        let p = attn.params();
        let compressor = match (kind, p.compressor, p.key_projection) {
            (LayerKind::Source, Some(c), Some(k)) => match c.wgate() {
                Some(wgate) => Some(CompressorWeights { wkv: c.wkv().clone(), wgate: wgate.clone(), norm: c.norm().clone(), keys: k.clone() }),
                None => bail!("layer {layer}: the ratio-2 compressor has no wgate"),
            },
            (LayerKind::Source, _, _) => bail!("layer {layer}: a kv source without its compressor or index-key projection"),
            _ => None,
        };
        let indexer = match (kind, p.indexer) {
            (LayerKind::Source, Some(i)) => Some(IndexerWeights { iq_b: i.wq_b().clone(), w_proj: i.weights_proj().clone() }),
            (LayerKind::Source, None) => bail!("layer {layer}: an index source without its indexer"),
            _ => None,
        };
        Ok(Self {
            layer,
            kind,
            wq_a: p.wq_a.clone(),
            q_norm: p.q_norm.clone(),
            wq_b: p.wq_b.clone(),
            wkv: p.wkv.clone(),
            kv_norm: p.kv_norm.clone(),
            wo_a: p.wo_a.clone(),
            wo_b: p.wo_b.clone(),
            sink: p.attn_sink.clone(),
            compressor,
            indexer,
            rope: p.rope.clone(),
            h: cfg.num_attention_heads,
            hd: cfg.head_dim,
            g: cfg.o_groups,
            hi: cfg.index_n_heads,
            di: cfg.index_head_dim,
            topk: cfg.index_topk,
            window: cfg.sliding_window,
            ratio,
        })
    }

    /// Bytes of the weights one step reads.
    pub fn bytes(&self) -> f64 {
        let mut linears = vec![&self.wq_a, &self.wq_b, &self.wkv, &self.wo_b];
        let mut other = self.wo_a.weight().bytes() as f64;
        if let Some(c) = &self.compressor {
            linears.extend([&c.wkv, &c.wgate]);
            other += (c.keys.k_norm().weight().elem_count() + self.di * self.hd) as f64 * 2.0;
        }
        if let Some(i) = &self.indexer {
            linears.extend([&i.iq_b, &i.w_proj]);
        }
        linears.into_iter().map(|l| l.weight().bytes() as f64).sum::<f64>() + other
    }
}
