//! The V4.1 attention layer (spec §4): projections, q path, window path, compressed path,
//! selection, sparse attention with sink, inverse RoPE, grouped `wo_a`, `wo_b`.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::cache::SequenceCache;
use super::compressor::{Compressor, Latents};
use super::indexer::{IndexKeyProjection, Indexer};
use super::sparse_attention::sparse_attention;
use crate::config::{AttentionRole, Config, TopkRole};
use crate::nn::linear::{named, prefixed, NamedLinears};
use crate::nn::{GroupedLinear, Linear, LinearKind, LinearPair, RmsNorm, RopeKind, RopeTable};
use crate::numerics::Numerics;
use crate::quant::fake_quant::{fake_quant, QatFormat};

#[cfg(feature = "cuda")]
#[path = "layer_fused.rs"]
mod fused;
#[cfg(feature = "cuda")]
pub use fused::LayerPhase;

/// The attention sublayer of one decoder layer (`layers.N.attn`): its weights and role; the
/// state across calls lives in the caller's [`SequenceCache`].
///
/// One layer on the CPU with random weights, a prefill of 5 tokens then one decode step:
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{DType, Device, Tensor};
/// use deepseek_v41::attention::{Attention, SequenceCache};
/// use deepseek_v41::config::AttentionRole;
/// use deepseek_v41::nn::RandomWeights;
/// use deepseek_v41::{Config, Numerics};
///
/// let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny");
/// let cfg = Config::from_file(format!("{dir}/config.json"))?;
/// let dev = Device::Cpu;
/// let vb = RandomWeights::new(7).var_builder(DType::BF16, &dev);
/// // Layer 1 compresses 2:1 and is its own kv and index source, so it runs alone.
/// let layer = 1;
/// let attn = Attention::new(&cfg, layer, Numerics::REFERENCE, vb.pp(format!("layers.{layer}.attn")))?;
/// assert!(matches!(attn.role(), AttentionRole::Compressed { ratio: 2, .. }));
///
/// let mut cache = SequenceCache::new(&cfg, DType::BF16, &dev)?;
/// // x: the attn-normed input, [T, hidden] bf16.
/// let x = Tensor::randn(0f32, 1.0, (5, cfg.hidden_size), &dev)?.to_dtype(DType::BF16)?;
/// let y = attn.forward(&x, 0, &mut cache)?;
/// assert_eq!(y.dims(), &[5, cfg.hidden_size]);
/// let x = Tensor::randn(0f32, 1.0, (1, cfg.hidden_size), &dev)?.to_dtype(DType::BF16)?;
/// let y = attn.forward(&x, 5, &mut cache)?;
/// assert_eq!((y.dims(), y.dtype()), (&[1, cfg.hidden_size][..], DType::BF16));
/// assert_eq!(cache.layer(layer)?.next_pos, 6);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Attention {
    layer: usize,
    role: AttentionRole,
    /// `wq_a` and `wkv` (one input; stacked into one FP8 product on CUDA, `nn::LinearPair`).
    wq_a_wkv: LinearPair,
    q_norm: RmsNorm,
    wq_b: Linear,
    /// `wq_b` and `indexer.wq_b` (both of the q-LoRA activation) stacked, on CUDA in layers with
    /// an indexer (`wq_b` and the indexer's are then views of it).
    wq_b_index: Option<LinearPair>,
    kv_norm: RmsNorm,
    /// The grouped (block-diagonal) `wo_a`: `o_groups` groups of `o_lora` rows over
    /// `heads_per_group·head_dim` inputs.
    wo_a: GroupedLinear,
    wo_b: Linear,
    /// `[H]` f32 sink logits.
    attn_sink: Tensor,
    /// Kv sources only.
    compressor: Option<Compressor>,
    /// Kv sources only (they own the index keys).
    key_projection: Option<IndexKeyProjection>,
    /// Index sources only.
    indexer: Option<Indexer>,
    rope: RopeTable,
    n_heads: usize,
    head_dim: usize,
    o_groups: usize,
    numerics: Numerics,
    /// Why the fused CUDA kernels cannot run this layer's shapes (`None`: they can); chosen at
    /// construction, see [`Attention::forward`].
    unfused: Option<String>,
}

/// The parameters of one attention layer, borrowed from it ([`Attention::params`]): for
/// composing the layer's step from the crate's ops elsewhere, e.g. the decode step of many
/// sequences whose caches live in pooled device tensors (`attention::decode_batch`).
#[derive(Debug, Clone, Copy)]
pub struct AttentionParams<'a> {
    /// `wq_a` `[q_lora, hidden]`.
    pub wq_a: &'a Linear,
    /// `q_norm` over the q-LoRA activation.
    pub q_norm: &'a RmsNorm,
    /// `wq_b` `[heads·head_dim, q_lora]`.
    pub wq_b: &'a Linear,
    /// `wq_b` and `indexer.wq_b` as one stacked pair (index sources on CUDA; else `None`).
    pub wq_b_index: Option<&'a LinearPair>,
    /// `wkv` `[head_dim, hidden]`.
    pub wkv: &'a Linear,
    /// `wq_a` and `wkv` as one pair (their products of one input in one call).
    pub wq_a_wkv: &'a LinearPair,
    /// `kv_norm` over the window KV.
    pub kv_norm: &'a RmsNorm,
    /// The grouped `wo_a` (`o_groups` groups of `o_lora` rows over `heads_per_group·head_dim`).
    pub wo_a: &'a GroupedLinear,
    /// `wo_b` `[hidden, o_groups·o_lora]`.
    pub wo_b: &'a Linear,
    /// `attn_sink` `[heads]` f32.
    pub attn_sink: &'a Tensor,
    /// The compressor (kv sources only).
    pub compressor: Option<&'a Compressor>,
    /// The index-key projection `indexer.{wk, k_norm}` (kv sources only).
    pub key_projection: Option<&'a IndexKeyProjection>,
    /// The indexer's query side (index sources only: `Full` and `Reindex` layers).
    pub indexer: Option<&'a Indexer>,
    /// The layer's RoPE table (its frequency set follows the compress ratio).
    pub rope: &'a RopeTable,
    /// The numerics the layer was built with (`cache_fake_quant`: the Q1/Q2/Q3 cache
    /// quantization and the index queries' FP4 fake quant).
    pub numerics: Numerics,
}

impl Attention {
    /// Loads layer `layer`'s attention from `vb` (= `layers.N.attn`).
    pub fn new(cfg: &Config, layer: usize, numerics: Numerics, vb: VarBuilder) -> Result<Self> {
        let role = cfg
            .layers
            .get(layer)
            .ok_or_else(|| candle_core::Error::Msg(format!("Attention: config has no layer {layer}")))?
            .attention;
        let (d, h, hd) = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim);
        let (g, ol) = (cfg.o_groups, cfg.o_lora_rank);
        let q = LinearKind::Quantized;
        let ratio = match role {
            AttentionRole::WindowOnly => 0,
            AttentionRole::Compressed { ratio, .. } => ratio,
        };
        let wo_a = GroupedLinear::new(h / g * hd, g * ol, g, vb.pp("wo_a"))?;
        let (mut compressor, mut key_projection, mut indexer) = (None, None, None);
        let wq_b = Linear::new(cfg.q_lora_rank, h * hd, q, numerics, vb.pp("wq_b"))?;
        if let AttentionRole::Compressed { ratio, kv_source, topk } = role {
            if kv_source == layer {
                compressor = Some(Compressor::new(cfg, ratio, numerics, vb.pp("compressor"))?);
                key_projection = Some(IndexKeyProjection::new(cfg, numerics, vb.pp("indexer"))?);
            }
            let candidates = match topk {
                TopkRole::Full { candidates } | TopkRole::Reindex { candidates, .. } => Some(candidates),
                TopkRole::Reuse { .. } => None,
            };
            if let Some(c) = candidates {
                indexer = Some(Indexer::new(cfg, ratio, c, numerics, vb.pp("indexer"))?);
            }
        }
        let (wq_b, wq_b_index) = match indexer.as_mut() {
            Some(ix) => {
                let pair = LinearPair::new(wq_b, ix.wq_b().clone())?;
                ix.set_wq_b(pair.second().clone());
                (pair.first().clone(), Some(pair).filter(LinearPair::is_stacked))
            }
            None => (wq_b, None),
        };
        Ok(Self {
            layer,
            role,
            wq_a_wkv: LinearPair::new(
                Linear::new(d, cfg.q_lora_rank, q, numerics, vb.pp("wq_a"))?,
                Linear::new(d, hd, q, numerics, vb.pp("wkv"))?,
            )?,
            q_norm: RmsNorm::new(cfg.q_lora_rank, cfg.rms_norm_eps, vb.pp("q_norm"))?,
            wq_b,
            wq_b_index,
            kv_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("kv_norm"))?,
            wo_a,
            wo_b: Linear::new(g * ol, d, q, numerics, vb.pp("wo_b"))?,
            attn_sink: vb.get_with_hints_dtype(h, "attn_sink", Default::default(), DType::F32)?,
            compressor,
            key_projection,
            indexer,
            rope: RopeTable::new(cfg.qk_rope_head_dim, &RopeKind::for_ratio(cfg, ratio), vb.device())?,
            n_heads: h,
            head_dim: hd,
            o_groups: g,
            numerics,
            unfused: fused_shape_limits(cfg, indexer_dims_used(role, layer)),
        })
    }

    /// The layer's role.
    pub fn role(&self) -> AttentionRole {
        self.role
    }

    /// The layer's parameters, borrowed ([`AttentionParams`]).
    pub fn params(&self) -> AttentionParams<'_> {
        AttentionParams {
            wq_a: self.wq_a_wkv.first(),
            q_norm: &self.q_norm,
            wq_b: &self.wq_b,
            wq_b_index: self.wq_b_index.as_ref(),
            wkv: self.wq_a_wkv.second(),
            wq_a_wkv: &self.wq_a_wkv,
            kv_norm: &self.kv_norm,
            wo_a: &self.wo_a,
            wo_b: &self.wo_b,
            attn_sink: &self.attn_sink,
            compressor: self.compressor.as_ref(),
            key_projection: self.key_projection.as_ref(),
            indexer: self.indexer.as_ref(),
            rope: &self.rope,
            numerics: self.numerics,
        }
    }

    /// The layer's index.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// Why the fused CUDA kernels cannot run this layer (`None`: they can, and `forward` uses
    /// them for CUDA inputs).
    pub fn fused_limits(&self) -> Option<&str> {
        self.unfused.as_deref()
    }

    /// Attention of the tokens at positions `start .. start + T`.
    ///
    /// `x`: `[T, hidden]` (bf16), the attn-normed sublayer input. Layers of one call must run in
    /// layer order on the same `cache` (kv sources and index sources publish to later layers).
    /// Returns `[T, hidden]` in `x`'s dtype.
    ///
    /// With the `cuda` feature, inputs on a CUDA device run `Attention::forward_fused` (cache
    /// writes, RoPE and attention in fused kernels, everything on the device); otherwise — on
    /// the CPU, or on a CUDA device inside `cuda::with_plain_candle` — this is the reference
    /// path below, in plain Candle ops. A cache in packed storage
    /// ([`crate::attention::CacheStorage::Packed`], `cuda` feature only) always runs
    /// `forward_fused` (its ops' CPU references on the CPU): the reference path reads and writes
    /// bf16 rows only.
    ///
    /// A layer whose shapes the fused kernels do not take ([`Attention::fused_limits`]: e.g.
    /// head_dim 192) runs the reference path in plain Candle ops on the device instead
    /// (`cuda::with_plain_candle`), chosen once at construction; with a packed cache that is an
    /// error naming the limit (the packed formats are written by the fused kernels only).
    pub fn forward(&self, x: &Tensor, start: usize, cache: &mut SequenceCache) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if crate::cuda::fused_kernels(x.device()) || cache.storage().is_packed() {
            match (&self.unfused, x.device().is_cuda()) {
                (Some(why), true) if cache.storage().is_packed() => candle_core::bail!(
                    "layer {}: packed cache storage on CUDA needs the fused kernels, but {why}; use bf16 cache storage",
                    self.layer
                ),
                (Some(_), true) => return crate::cuda::with_plain_candle(|| self.forward(x, start, cache)),
                _ => return self.forward_fused(x, start, cache, &mut |_| {}),
            }
        }
        let l = self.layer;
        let t = x.dim(0)?;
        let expected = cache.layer(l)?.next_pos;
        if start != expected {
            candle_core::bail!("layer {l}: call starts at position {start}, but the cache holds {expected} tokens")
        }
        let positions: Vec<usize> = (start..start + t).collect();

        // Projections and the q path (no q norm in V4.1).
        let qr = self.q_norm.forward(&self.wq_a_wkv.first().forward(x)?)?;
        let kv = self.kv_norm.forward(&self.wq_a_wkv.second().forward(x)?)?;
        let q = self.wq_b.forward(&qr)?.reshape((t, self.n_heads, self.head_dim))?;
        let q = self.rope.apply(&q, &positions, false)?;

        // Window path, every layer.
        let mut window_kv = self.rope.apply(&kv, &positions, false)?;
        if self.numerics.cache_fake_quant {
            window_kv = fake_quant(&window_kv, QatFormat::Fp8Ue8m0B32)?;
        }
        cache.record(|| format!("L{l}.window_kv"), &window_kv);
        let window = cache.layer_mut(l)?.window.extend(&window_kv, start)?;

        // Compressed path and selection.
        let (kv_all, indices) = match self.role {
            AttentionRole::WindowOnly => (window.kv, window.indices),
            AttentionRole::Compressed { ratio, kv_source, topk } => {
                if let (Some(c), Some(kp)) = (&self.compressor, &self.key_projection) {
                    self.compress(x, start, ratio, c, kp, cache)?;
                }
                let selected =
                    super::selection::select(l, topk, self.indexer.as_ref(), x, &qr, &positions, &self.rope, cache)?;
                cache.record(|| format!("L{l}.topk"), &selected);
                let selected = selected.to_vec2::<i64>()?;
                let compressed = cache.source(kv_source)?.compressed.rows()?;
                let offset = window.kv.dim(0)? as i64;
                let indices = window
                    .indices
                    .into_iter()
                    .zip(selected)
                    .map(|(mut w, s)| {
                        w.extend(s.iter().map(|&j| if j >= 0 { j + offset } else { -1 }));
                        w
                    })
                    .collect();
                (Tensor::cat(&[window.kv, compressed], 0)?, indices)
            }
        };
        cache.layer_mut(l)?.next_pos = start + t;

        let indices = Tensor::new(indices, x.device())?;
        let scale = (self.head_dim as f32).powf(-0.5);
        let o = sparse_attention(&q, &kv_all, &indices, &self.attn_sink, scale)?;
        let o = self.rope.apply(&o, &positions, true)?;
        self.output(&o)
    }

    /// The compressor step of this kv source: the latents of the groups closing in this call,
    /// `None` when none closes; checked against the entries the source's cache already holds.
    pub(super) fn closed_groups(&self, x: &Tensor, start: usize, compressor: &Compressor, cache: &mut SequenceCache) -> Result<Option<Latents>> {
        let l = self.layer;
        let source = cache.source_mut(l)?;
        let lat = compressor.forward(x, start, &mut source.carry)?;
        if lat.latent.dim(0)? == 0 {
            return Ok(None);
        }
        if source.compressed.len() != lat.first_entry {
            candle_core::bail!("layer {l}: compressed cache holds {} entries, call emits entry {}", source.compressed.len(), lat.first_entry)
        }
        Ok(Some(lat))
    }

    /// Runs the compressor of this kv source and appends index keys and compressed entries.
    fn compress(
        &self,
        x: &Tensor,
        start: usize,
        ratio: usize,
        compressor: &Compressor,
        keys: &IndexKeyProjection,
        cache: &mut SequenceCache,
    ) -> Result<()> {
        let Some(lat) = self.closed_groups(x, start, compressor, cache)? else { return Ok(()) };
        let index_k = keys.keys(&lat.latent, lat.first_entry, ratio, &self.rope)?;
        let positions: Vec<usize> = (0..lat.latent.dim(0)?).map(|i| (lat.first_entry + i) * ratio).collect();
        let mut entries = self.rope.apply(&lat.latent, &positions, false)?;
        if self.numerics.cache_fake_quant {
            entries = fake_quant(&entries, QatFormat::Fp4E4m3B16)?;
        }
        let source = cache.source_mut(self.layer)?;
        source.compressed.append(&entries)?;
        source.index_keys.append(&index_k)?;
        Ok(())
    }

    /// Grouped `wo_a` then `wo_b`: `o` `[T, H, head_dim]` → `[T, hidden]`.
    fn output(&self, o: &Tensor) -> Result<Tensor> {
        let t = o.dim(0)?;
        let g = self.o_groups;
        let z = self.wo_a.forward(&o.reshape((t, g, self.n_heads / g * self.head_dim))?)?;
        self.wo_b.forward(&z)
    }

    /// The grouped `wo_a` (`nn::GroupedLinear`: dense, or FP8 as stored on CUDA).
    pub fn wo_a(&self) -> &GroupedLinear {
        &self.wo_a
    }

    /// Every linear of the layer with its checkpoint prefix (`wq_a`, `compressor.wkv`,
    /// `indexer.wq_b`, ...). The grouped `wo_a` is not a linear ([`Attention::wo_a`]).
    pub fn linears(&self) -> NamedLinears<'_> {
        let mut v = named([("wq_a", self.wq_a_wkv.first()), ("wq_b", &self.wq_b), ("wkv", self.wq_a_wkv.second()), ("wo_b", &self.wo_b)]);
        if let Some(c) = &self.compressor {
            v.extend(prefixed("compressor", c.linears()));
        }
        if let Some(k) = &self.key_projection {
            v.extend(prefixed("indexer", k.linears()));
        }
        if let Some(i) = &self.indexer {
            v.extend(prefixed("indexer", i.linears()));
        }
        v
    }
}

/// Whether layer `layer` of role `role` runs the indexer's kernels (index-key inserts as a kv
/// source, scores and top-k as an index source).
fn indexer_dims_used(role: AttentionRole, layer: usize) -> bool {
    match role {
        AttentionRole::WindowOnly => false,
        AttentionRole::Compressed { kv_source, topk, .. } => kv_source == layer || !matches!(topk, TopkRole::Reuse { .. }),
    }
}

/// The shapes of `cfg` the fused CUDA kernels do not take, in words (`None`: every fused op of a
/// layer fits; `indexer`: the layer runs the indexer's kernels). The sparse attention falls back
/// per call by itself (`sparse_attention_kv_rows`).
fn fused_shape_limits(cfg: &Config, indexer: bool) -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        let (hd, r) = (cfg.head_dim, cfg.qk_rope_head_dim);
        if ![64, 128, 256, 512].contains(&hd) {
            return Some(format!("the q RoPE and cache-insert kernels take head_dim 64, 128, 256 or 512, got {hd}"));
        }
        if r % 2 != 0 || r < 2 || r > hd {
            return Some(format!("the RoPE kernels take an even qk_rope_head_dim in 2..={hd}, got {r}"));
        }
        let (ih, id) = (cfg.index_n_heads, cfg.index_head_dim);
        if indexer && (id != crate::cuda::INDEX_HEAD_DIM || !(1..=crate::cuda::MAX_INDEX_HEADS).contains(&ih)) {
            return Some(format!(
                "the indexer kernels take index_head_dim {} and 1..={} index heads, got {id} and {ih}",
                crate::cuda::INDEX_HEAD_DIM,
                crate::cuda::MAX_INDEX_HEADS
            ));
        }
        None
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (cfg, indexer);
        None
    }
}
