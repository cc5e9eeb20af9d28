//! The whole V4.1 text decoder (spec §3): embedding, `num_hidden_layers` blocks with staggered
//! mHC, Engram before the mixes of its layers, attention and MoE sublayers, then the final
//! collapse with the last FFN pre, RMSNorm and the f32 head. MTP (`mtp.*`) and vision weights are
//! not loaded: plain generation does not run them (spec §10).

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};

use super::engram::Engram;
use super::engram_hash::{EngramHasher, EngramHistory, TokenMap};
use super::engram_placement::{EngramOptions, EngramTableInfo};
use super::mhc::{collapse, post, HcMix, HcSublayer};
use super::moe::Moe;
use crate::attention::{Attention, CacheStorage, RollbackError, SequenceCache, Trace};
use crate::config::Config;
use crate::input::{check_tokens, InputError};
use crate::nn::linear::{named, prefixed, NamedLinears};
use crate::nn::{Linear, LinearKind, RmsNorm};
use crate::numerics::Numerics;

/// The caller-owned state of one sequence: attention caches and the Engram token history.
#[derive(Debug, Clone)]
pub struct ModelCache {
    /// Attention caches of every layer.
    pub attention: SequenceCache,
    /// The last `max_ngram_size − 1` compressed token ids (Engram lookback).
    pub engram: EngramHistory,
}

impl ModelCache {
    /// An empty cache (activations in `dtype` on `device`, bf16 attention caches).
    pub fn new(cfg: &Config, dtype: DType, device: &Device) -> Result<Self> {
        Self::with_storage(cfg, CacheStorage::Bf16, dtype, device)
    }

    /// An empty cache whose attention caches are stored as `storage` says (see
    /// [`SequenceCache::with_storage`]).
    pub fn with_storage(cfg: &Config, storage: CacheStorage, dtype: DType, device: &Device) -> Result<Self> {
        let ngram = cfg.engram.as_ref().map_or(1, |e| e.max_ngram_size);
        Ok(Self { attention: SequenceCache::with_storage(cfg, storage, dtype, device)?, engram: EngramHistory::new(ngram) })
    }

    /// Tokens processed so far.
    pub fn seq_len(&self) -> usize {
        self.attention.seq_len()
    }

    /// Keeps enough state to [`ModelCache::truncate`] up to `depth` tokens back from the
    /// furthest position processed
    /// (see [`crate::attention::rollback`] for what is kept); errors unless the cache is empty.
    pub fn set_rollback_depth(&mut self, depth: usize) -> Result<()> {
        self.attention.set_rollback_depth(depth)?;
        self.engram.set_rollback_depth(depth);
        Ok(())
    }

    /// Rolls the cache back to its first `len` tokens: continuing from it gives the results of a
    /// fresh run of those tokens. Fails with a [`RollbackError`], changing nothing, when `len` is
    /// past the end or the rollback needs state that is no longer held (set a rollback depth).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        let seq_len = self.seq_len();
        if let Some(missing) = self.engram.rollback_gap(len.min(self.engram.seq_len())) {
            let depth = self.attention.rollback_depth();
            Err(RollbackError::NotHeld { len, seq_len, what: "Engram token history".into(), missing, depth })?
        }
        self.attention.truncate(len)?;
        self.engram.truncate(len);
        Ok(())
    }

    /// Installs a recorder of intermediate tensors (golden names).
    pub fn set_trace(&mut self, trace: Option<Trace>) {
        self.attention.set_trace(trace);
    }
}

/// One decoder block: `layers.N`.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    layer: usize,
    engram: Option<Engram>,
    hc_attn: HcMix,
    hc_ffn: HcMix,
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: RmsNorm,
    ffn: Moe,
}

impl DecoderLayer {
    /// Loads block `layer` from `vb` (= `layers.N`), an Engram table resident on `vb`'s device.
    pub fn new(cfg: &Config, layer: usize, numerics: Numerics, vb: VarBuilder) -> Result<Self> {
        Self::with_engram(cfg, layer, numerics, vb, &EngramOptions::default())
    }

    /// [`DecoderLayer::new`] with the Engram table placed as `engram` says ([`Engram::load`]).
    pub fn with_engram(cfg: &Config, layer: usize, numerics: Numerics, vb: VarBuilder, engram: &EngramOptions) -> Result<Self> {
        let engram = match cfg.layers[layer].engram {
            true => Some(Engram::load(cfg, layer, numerics, vb.pp("engram"), engram)?),
            false => None,
        };
        Ok(Self {
            layer,
            engram,
            hc_attn: HcMix::new(cfg, vb.clone(), HcSublayer::Attn)?,
            hc_ffn: HcMix::new(cfg, vb.clone(), HcSublayer::Ffn)?,
            attn_norm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("attn_norm"))?,
            attn: Attention::new(cfg, layer, numerics, vb.pp("attn"))?,
            ffn_norm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("ffn_norm"))?,
            ffn: Moe::new(cfg, numerics, vb.pp("ffn"))?,
        })
    }

    /// Runs the block on the stream `x` `[T, hc, D]` (bf16) with the carried pre `p_in` `[T, hc]`
    /// (f32); `hashes` are this layer's Engram row ids `[T, n]` when it is an Engram layer.
    /// Returns the new stream and the pre for the next block (this block's FFN pre).
    pub fn forward(
        &self,
        x: &Tensor,
        p_in: &Tensor,
        start: usize,
        hashes: Option<&Tensor>,
        cache: &mut SequenceCache,
    ) -> Result<(Tensor, Tensor)> {
        let l = self.layer;
        let mut x = x.clone();
        if let (Some(engram), Some(h)) = (&self.engram, hashes) {
            x = engram.forward(&x, h)?;
            cache.record(|| format!("L{l}.engram_out"), &x);
        }
        let a = self.hc_attn.mixes(&x)?;
        let h = self.attn_norm.forward(&collapse(&x, p_in)?)?;
        cache.record(|| format!("L{l}.attn_in"), &h);
        let y = self.attn.forward(&h, start, cache)?;
        cache.record(|| format!("L{l}.attn_out"), &y);
        let x1 = post(&y, &x, &a.post, &a.comb)?;
        let f = self.hc_ffn.mixes(&x1)?;
        let h2 = self.ffn_norm.forward(&collapse(&x1, &a.pre)?)?;
        cache.record(|| format!("L{l}.ffn_in"), &h2);
        let z = self.ffn.forward(&h2)?;
        cache.record(|| format!("L{l}.ffn_out"), &z.out);
        cache.record(|| format!("L{l}.moe_ids"), &z.ids);
        cache.record(|| format!("L{l}.moe_weights"), &z.weights);
        for (name, c) in [("attn", &a), ("ffn", &f)] {
            cache.record(|| format!("L{l}.hc_{name}_pre"), &c.pre);
            cache.record(|| format!("L{l}.hc_{name}_post"), &c.post);
            cache.record(|| format!("L{l}.hc_{name}_comb"), &c.comb);
        }
        let x2 = post(&z.out, &x1, &f.post, &f.comb)?;
        Ok((x2, f.pre))
    }

    /// The block's Engram module, if it has one.
    pub fn engram(&self) -> Option<&Engram> {
        self.engram.as_ref()
    }

    /// Every linear of the block with its checkpoint prefix (`attn.wq_a`, `ffn.experts.0.w1`,
    /// `engram.wkv`, ...).
    pub fn linears(&self) -> NamedLinears<'_> {
        let mut v = prefixed("attn", self.attn.linears());
        v.extend(prefixed("ffn", self.ffn.linears()));
        if let Some(e) = &self.engram {
            v.extend(prefixed("engram", e.linears()));
        }
        v
    }
}

/// The V4.1 text model.
#[derive(Debug, Clone)]
pub struct Model {
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    head: Linear,
    engram: Option<EngramHasher>,
    hc: usize,
    dtype: DType,
    vocab_size: usize,
    max_positions: usize,
}

impl Model {
    /// Loads the text model from `vb` (checkpoint root). `token_map` maps token ids to Engram
    /// compressed ids (required when the config has Engram layers). The Engram tables are taken
    /// whole and kept on `vb`'s device; [`Model::with_engram`] can leave large ones in host memory.
    pub fn new(cfg: &Config, numerics: Numerics, token_map: Option<TokenMap>, vb: VarBuilder) -> Result<Self> {
        Self::with_engram(cfg, numerics, token_map, vb, &EngramOptions::default())
    }

    /// [`Model::new`] with the Engram tables placed as `engram` says: with the checkpoint `vb`
    /// reads in [`EngramOptions::checkpoint`], [`super::EngramPlacement::Auto`] keeps the tables
    /// over [`super::AUTO_DEVICE_MAX_BYTES`] (the released ones) in host memory, read by rows per
    /// call ([`super::HostRows`]); see [`Model::engram_placements`].
    pub fn with_engram(cfg: &Config, numerics: Numerics, token_map: Option<TokenMap>, vb: VarBuilder, engram: &EngramOptions) -> Result<Self> {
        let embed = candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, vb.pp("embed"))?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| DecoderLayer::with_engram(cfg, l, numerics, vb.pp("layers").pp(l), engram))
            .collect::<Result<Vec<_>>>()?;
        let engram = match (&cfg.engram, token_map) {
            (None, _) => None,
            (Some(e), Some(map)) => Some(EngramHasher::new(e, map)?),
            (Some(_), None) => candle_core::bail!("Model: the config has Engram layers but no token map was given"),
        };
        Ok(Self {
            embed,
            layers,
            norm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("norm"))?,
            head: Linear::new(cfg.hidden_size, cfg.vocab_size, LinearKind::F32, numerics, vb.pp("head"))?,
            engram,
            hc: cfg.hc_mult,
            dtype: vb.dtype(),
            vocab_size: cfg.vocab_size,
            max_positions: cfg.max_position_embeddings,
        })
    }

    /// The vocabulary size (token ids must be below it).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The config's `max_position_embeddings`: the positions RoPE/YaRN is defined for.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// `tokens` is not empty and every id is below [`Model::vocab_size`] ([`InputError`]).
    pub fn check_tokens(&self, tokens: &[u32]) -> std::result::Result<(), InputError> {
        check_tokens(tokens, self.vocab_size)
    }

    /// Logits `[T, vocab]` (f32) of `tokens` at positions `cache.seq_len() ..`.
    ///
    /// Errors with an [`InputError`] (naming the id and the vocabulary size) for an empty
    /// `tokens` or an id outside the vocabulary, before touching the cache.
    pub fn forward(&self, tokens: &[u32], cache: &mut ModelCache) -> Result<Tensor> {
        self.check_tokens(tokens)?;
        let start = cache.seq_len();
        let t = tokens.len();
        let dev = self.head.device().clone();
        let ids = Tensor::new(tokens, &dev)?;
        let h0 = self.embed.forward(&ids)?.to_dtype(self.dtype)?;
        let d = h0.dim(1)?;
        let mut x = h0.unsqueeze(1)?.broadcast_as((t, self.hc, d))?.contiguous()?;
        let mut one_hot = vec![0f32; self.hc];
        one_hot[0] = 1.0;
        let mut pre = Tensor::new(one_hot, &dev)?.unsqueeze(0)?.broadcast_as((t, self.hc))?.contiguous()?;
        let hashes = match &self.engram {
            Some(hasher) => Some(hasher.hash(tokens, &mut cache.engram)?),
            None => None,
        };
        for layer in &self.layers {
            let h = match (&hashes, &layer.engram) {
                (Some(hs), Some(e)) => Some(hs.tensor(layer.layer, &e.table().ids_device(&dev))?),
                _ => None,
            };
            if let Some(h) = &h {
                cache.attention.record(|| format!("L{}.engram_hash", layer.layer), h);
            }
            (x, pre) = layer.forward(&x, &pre, start, h.as_ref(), &mut cache.attention)?;
        }
        let h = self.norm.forward(&collapse(&x, &pre)?)?;
        let logits = self.head.forward(&h)?;
        cache.attention.record(|| "logits".to_string(), &logits);
        Ok(logits)
    }

    /// The Engram modules, by layer.
    pub fn engram_modules(&self) -> Vec<&Engram> {
        self.layers.iter().filter_map(|l| l.engram.as_ref()).collect()
    }

    /// Every Engram table of the model, by layer: rows, width, where it lives
    /// ([`super::EngramLocation`]) and its bytes there (for a load plan or a report).
    pub fn engram_placements(&self) -> Vec<EngramTableInfo> {
        self.layers.iter().filter_map(|l| l.engram.as_ref()).map(Engram::table_info).collect()
    }

    /// Every linear of the model with its checkpoint prefix (`layers.3.attn.wq_a`, `head`, ...;
    /// the weight is `<prefix>.weight`), e.g. to see which hold FP8 weights
    /// ([`crate::nn::LinearWeight`]) and how many bytes.
    pub fn linears(&self) -> NamedLinears<'_> {
        let mut v = NamedLinears::new();
        for (l, layer) in self.layers.iter().enumerate() {
            v.extend(prefixed(&format!("layers.{l}"), layer.linears()));
        }
        v.extend(named([("head", &self.head)]));
        v
    }
}
