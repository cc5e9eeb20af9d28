//! The whole V4.1 text decoder (spec §3): embedding, `num_hidden_layers` blocks with staggered
//! mHC, Engram before the mixes of its layers, attention and MoE sublayers, then the final
//! collapse with the last FFN pre, RMSNorm and the f32 head. MTP (`mtp.*`) and vision weights are
//! not loaded: plain generation does not run them (spec §10).

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};

use super::batch::{BatchItem, BatchOutput, BatchPlan, LogitRows};
use super::engram::Engram;
use super::engram_hash::{EngramHasher, EngramHistory, EngramIds, TokenMap};
use super::engram_placement::{EngramOptions, EngramTableInfo};
use super::mhc::{collapse_norm, post, post_collapse_norm, HcMix, HcSublayer};
use super::moe::Moe;
use crate::parallel::{agree, Collective, ExpertPlacement, ShardedMoe, Turn};
use crate::attention::{Attention, CachePool, CacheStorage, PoolLease, RollbackError, SequenceCache, Trace};
use crate::config::Config;
use crate::input::{check_tokens, InputError};
use crate::nn::linear::{named, prefixed, NamedLinears};
use crate::nn::{Linear, LinearKind, RmsNorm, RowGroup, RowGroups};
use crate::numerics::Numerics;

/// The caller-owned state of one sequence: attention caches and the Engram token history.
#[derive(Debug, Clone)]
pub struct ModelCache {
    /// Attention caches of every layer.
    pub attention: SequenceCache,
    /// The last `max_ngram_size − 1` compressed token ids (Engram lookback).
    pub engram: EngramHistory,
    /// The pool pages holding the window rings, for a cache admitted to a [`CachePool`]
    /// (given back when the cache and its clones are dropped).
    lease: Option<Arc<PoolLease>>,
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
        Ok(Self { attention: SequenceCache::with_storage(cfg, storage, dtype, device)?, engram: EngramHistory::new(ngram), lease: None })
    }

    /// Admits a new sequence to `pool`: an empty cache whose window rings are pages of the pool
    /// (zeroed; the storage and dtype are the pool's), the compressed entries, index keys,
    /// compressor carry and Engram history its own. Runs exactly like a private cache
    /// (`tests/batched.rs`). The pages go back to the pool when the cache (and every clone of it)
    /// is dropped. Fails with a [`PoolError::Full`](crate::attention::PoolError) when the pool
    /// has not enough free pages, taking none and changing no other sequence.
    pub fn admit(pool: &CachePool) -> Result<Self> {
        let cfg = pool.config();
        let (lease, rings) = pool.lease()?;
        let device = rings.first().map_or(Device::Cpu, |r| r.device().clone());
        let attention = SequenceCache::with_rings(cfg, pool.storage(), pool.dtype(), &device, rings)?;
        let ngram = cfg.engram.as_ref().map_or(1, |e| e.max_ngram_size);
        Ok(Self { attention, engram: EngramHistory::new(ngram), lease: Some(Arc::new(lease)) })
    }

    /// The pool pages of a cache admitted with [`ModelCache::admit`] (its page table: layer l's
    /// ring is page `pages()[l]`).
    pub fn pool_pages(&self) -> Option<&[usize]> {
        self.lease.as_deref().map(PoolLease::pages)
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
    ffn: Ffn,
}

/// A block's MoE: whole, or a rank's part of it with the group its tokens' slots travel in
/// (expert parallelism, [`crate::parallel`]).
#[derive(Debug, Clone)]
enum Ffn {
    Whole(Moe),
    Sharded(ShardedMoe, Arc<dyn Collective>),
}

impl DecoderLayer {
    /// Loads block `layer` from `vb` (= `layers.N`), an Engram table resident on `vb`'s device.
    pub fn new(cfg: &Config, layer: usize, numerics: Numerics, vb: VarBuilder) -> Result<Self> {
        Self::with_engram(cfg, layer, numerics, vb, &EngramOptions::default())
    }

    /// [`DecoderLayer::new`] with the Engram table placed as `engram` says ([`Engram::load`]).
    pub fn with_engram(cfg: &Config, layer: usize, numerics: Numerics, vb: VarBuilder, engram: &EngramOptions) -> Result<Self> {
        let ffn = Ffn::Whole(Moe::new(cfg, numerics, vb.pp("ffn"))?);
        Self::with_ffn(cfg, layer, numerics, vb, engram, ffn)
    }

    /// [`DecoderLayer::with_engram`] holding only `placement`'s routed experts, its MoE calls
    /// exchanging slots with the other ranks of `comm` ([`ShardedMoe`]).
    pub fn expert_parallel(
        cfg: &Config,
        layer: usize,
        numerics: Numerics,
        vb: VarBuilder,
        engram: &EngramOptions,
        placement: ExpertPlacement,
        comm: Arc<dyn Collective>,
    ) -> Result<Self> {
        let ffn = Ffn::Sharded(ShardedMoe::new(cfg, numerics, vb.pp("ffn"), placement)?, comm);
        Self::with_ffn(cfg, layer, numerics, vb, engram, ffn)
    }

    fn with_ffn(cfg: &Config, layer: usize, numerics: Numerics, vb: VarBuilder, engram: &EngramOptions, ffn: Ffn) -> Result<Self> {
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
            ffn,
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
        let rows = 0..x.dim(0)?;
        self.forward_segments(x, p_in, hashes.map(EngramInput::Ids), &mut [Segment { rows, start, cache }])
    }

    /// [`DecoderLayer::forward`] over the concatenated rows of several sequences: every
    /// row-wise part (Engram, mixes, norms, MoE) runs once on all rows, the attention once per
    /// segment on its rows and its cache.
    pub(crate) fn forward_segments(
        &self,
        x: &Tensor,
        p_in: &Tensor,
        engram_in: Option<EngramInput>,
        segs: &mut [Segment],
    ) -> Result<(Tensor, Tensor)> {
        let l = self.layer;
        let groups = RowGroups::from_lens(segs.iter().map(|s| s.rows.len()));
        let mut x = x.clone();
        if let (Some(engram), Some(input)) = (&self.engram, engram_in) {
            x = match input {
                EngramInput::Ids(h) => engram.forward_grouped(&x, h, &groups)?,
                EngramInput::Rows(rows) => engram.forward_rows(&x, &rows.reshape((x.dim(0)?, ()))?, &groups)?,
            };
            record(segs, || format!("L{l}.engram_out"), &x)?;
        }
        let a = self.hc_attn.mixes_grouped(&x, &groups)?;
        let h = collapse_norm(&x, p_in, &self.attn_norm)?;
        record(segs, || format!("L{l}.attn_in"), &h)?;
        let y = self.segment_attention(&h, segs)?;
        record(segs, || format!("L{l}.attn_out"), &y)?;
        let (x1, h2) = post_collapse_norm(&y, &x, &a.post, &a.comb, &a.pre, &self.ffn_norm)?;
        let f = self.hc_ffn.mixes_grouped(&x1, &groups)?;
        record(segs, || format!("L{l}.ffn_in"), &h2)?;
        let z = match &self.ffn {
            Ffn::Whole(moe) => {
                let z = moe.forward_grouped(&h2, &groups)?;
                record(segs, || format!("L{l}.moe_ids"), &z.ids)?;
                record(segs, || format!("L{l}.moe_weights"), &z.weights)?;
                z.out
            }
            Ffn::Sharded(moe, comm) => moe.forward(&h2, &groups, comm.as_ref())?,
        };
        record(segs, || format!("L{l}.ffn_out"), &z)?;
        for (name, c) in [("attn", &a), ("ffn", &f)] {
            record(segs, || format!("L{l}.hc_{name}_pre"), &c.pre)?;
            record(segs, || format!("L{l}.hc_{name}_post"), &c.post)?;
            record(segs, || format!("L{l}.hc_{name}_comb"), &c.comb)?;
        }
        let x2 = post(&z, &x1, &f.post, &f.comb)?;
        Ok((x2, f.pre))
    }

    /// The block's Engram module, if it has one.
    pub fn engram(&self) -> Option<&Engram> {
        self.engram.as_ref()
    }

    /// The backbone layer id (`layers.N`).
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The attention sublayer.
    pub fn attention(&self) -> &Attention {
        &self.attn
    }

    /// The MoE sublayer; an error for a block of a [`Model::expert_parallel`] rank (it holds only
    /// its share of the routed experts).
    pub fn moe(&self) -> Result<&Moe> {
        match &self.ffn {
            Ffn::Whole(moe) => Ok(moe),
            Ffn::Sharded(m, _) => candle_core::bail!(
                "layer {}: the MoE is split over {} ranks (expert parallelism); this path needs the whole MoE",
                self.layer,
                m.placement().world()
            ),
        }
    }

    /// The RMSNorm before the attention (`attn_norm`).
    pub fn attn_norm(&self) -> &RmsNorm {
        &self.attn_norm
    }

    /// The RMSNorm before the MoE (`ffn_norm`).
    pub fn ffn_norm(&self) -> &RmsNorm {
        &self.ffn_norm
    }

    /// The mHC mixing weights of one sublayer (`hc_attn_*` or `hc_ffn_*`).
    pub fn hc_mix(&self, which: HcSublayer) -> &HcMix {
        match which {
            HcSublayer::Attn => &self.hc_attn,
            HcSublayer::Ffn => &self.hc_ffn,
        }
    }

    /// The attention of each segment on its rows of `h` `[T, D]` and its cache, concatenated.
    fn segment_attention(&self, h: &Tensor, segs: &mut [Segment]) -> Result<Tensor> {
        if let [seg] = segs {
            if seg.rows == (0..h.dim(0)?) {
                return self.attn.forward(h, seg.start, seg.cache);
            }
        }
        let ys = segs
            .iter_mut()
            .map(|s| self.attn.forward(&h.narrow(0, s.rows.start, s.rows.len())?, s.start, s.cache))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&ys, 0)
    }

    /// Every linear of the block with its checkpoint prefix (`attn.wq_a`, `ffn.experts.0.w1`,
    /// `engram.wkv`, ...).
    pub fn linears(&self) -> NamedLinears<'_> {
        let mut v = prefixed("attn", self.attn.linears());
        v.extend(prefixed(
            "ffn",
            match &self.ffn {
                Ffn::Whole(moe) => moe.linears(),
                Ffn::Sharded(moe, _) => moe.linears(),
            },
        ));
        if let Some(e) = &self.engram {
            v.extend(prefixed("engram", e.linears()));
        }
        v
    }
}

/// One sequence's part of a batched layer call: rows `rows` of the stream, at positions
/// `start ..` of `cache`.
pub(crate) struct Segment<'c> {
    pub(crate) rows: Range<usize>,
    pub(crate) start: usize,
    pub(crate) cache: &'c mut SequenceCache,
}

/// Records each segment's rows of `t` in its cache's trace (when it has one).
fn record(segs: &mut [Segment], name: impl Fn() -> String, t: &Tensor) -> Result<()> {
    for s in segs.iter_mut().filter(|s| s.cache.is_tracing()) {
        let part = if s.rows == (0..t.dim(0)?) { t.clone() } else { t.narrow(0, s.rows.start, s.rows.len())? };
        s.cache.record(&name, &part);
    }
    Ok(())
}

/// Engram layer `layer`'s row ids of all items, concatenated in item order: `[T, n]` u32 on
/// `device` (the table's [`super::EngramTable::ids_device`]: the CPU for a table in host memory).
/// What an Engram layer's block gets: its hash ids (the block looks the rows up), or the rows
/// themselves, looked up ahead of the block (`[T·cols, width]`, a host table's prefetch).
pub(crate) enum EngramInput<'a> {
    Ids(&'a Tensor),
    Rows(Tensor),
}

fn engram_ids(hashes: &[EngramIds], layer: usize, t: usize, device: &Device) -> Result<Tensor> {
    if let [one] = hashes {
        return one.tensor(layer, device);
    }
    let n = hashes.first().map_or(0, |h| h.n_cols());
    let mut ids = Vec::with_capacity(t * n);
    for h in hashes {
        match h.layer(layer) {
            Some(v) => ids.extend_from_slice(v),
            None => candle_core::bail!("EngramIds: layer {layer} is not an Engram layer"),
        }
    }
    Tensor::from_vec(ids, (t, n), device)
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
    /// The expert-parallel group every block's MoE exchanges in ([`Model::expert_parallel`]).
    group: Option<Arc<dyn Collective>>,
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
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| DecoderLayer::with_engram(cfg, l, numerics, vb.pp("layers").pp(l), engram))
            .collect::<Result<Vec<_>>>()?;
        Self::with_layers(cfg, numerics, token_map, vb, layers, None)
    }

    fn with_layers(
        cfg: &Config,
        numerics: Numerics,
        token_map: Option<TokenMap>,
        vb: VarBuilder,
        layers: Vec<DecoderLayer>,
        group: Option<Arc<dyn Collective>>,
    ) -> Result<Self> {
        let embed = candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, vb.pp("embed"))?;
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
            group,
        })
    }

    /// [`Model::with_engram`] as rank `placement.rank()` of an expert-parallel group: every block
    /// holds only the routed experts `placement.range()` (the other experts' tensors are not
    /// read) and its MoE calls exchange slots with the other ranks of `comm`, which must run the
    /// same calls ([`crate::parallel`]: each rank forwards its own sequences; the attention and
    /// everything else are replicated). The paths that need the whole MoE (`DecoderLayer::moe`,
    /// the decode step) report an error.
    ///
    /// Every call is a collective, started by a round ([`crate::parallel::agree`]):
    /// [`Model::forward_batch`] (and [`Model::forward`]) on a rank with tokens,
    /// [`Model::join_idle`] on a rank without, and [`Model::serve_until_done`] once on every rank
    /// after its last forward — so the ranks may make different numbers of forward calls. An
    /// error in a call leaves the group out of step: drop every rank's model (dropping a
    /// [`crate::parallel::LocalRank`] makes the others' exchanges fail instead of wait).
    pub fn expert_parallel(
        cfg: &Config,
        numerics: Numerics,
        token_map: Option<TokenMap>,
        vb: VarBuilder,
        engram: &EngramOptions,
        placement: ExpertPlacement,
        comm: Arc<dyn Collective>,
    ) -> Result<Self> {
        if comm.rank() != placement.rank() || comm.world() != placement.world() {
            candle_core::bail!("Model: rank {} of {} in the group, placed as rank {} of {}", comm.rank(), comm.world(), placement.rank(), placement.world())
        }
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| DecoderLayer::expert_parallel(cfg, l, numerics, vb.pp("layers").pp(l), engram, placement, comm.clone()))
            .collect::<Result<Vec<_>>>()?;
        Self::with_layers(cfg, numerics, token_map, vb, layers, Some(comm))
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

    /// Logits `[T, vocab]` (f32) of `tokens` at positions `cache.seq_len() ..`: a batch of one
    /// item asking for every row ([`Model::forward_batch`]).
    ///
    /// Errors with an [`InputError`] (naming the id and the vocabulary size) for an empty
    /// `tokens` or an id outside the vocabulary, before touching the cache.
    pub fn forward(&self, tokens: &[u32], cache: &mut ModelCache) -> Result<Tensor> {
        self.check_tokens(tokens)?;
        Ok(self.forward_batch(&mut [BatchItem::new(tokens, cache).with_logits(LogitRows::All)])?.logits)
    }

    /// One round of an expert-parallel rank ([`Model::expert_parallel`]) with no sequence to
    /// forward now: it tells the group it is idle ([`crate::parallel::Turn::Idle`]) and, if
    /// another rank forwards in this call, joins every block's exchange with no tokens so that
    /// rank gets its experts' outputs. Returns whether a rank forwarded. Errors on a model that
    /// is not expert-parallel (there is no group to join).
    pub fn join_idle(&self) -> Result<bool> {
        self.round(Turn::Idle)
    }

    /// The end of an expert-parallel rank's work: joins the other ranks' calls (as
    /// [`Model::join_idle`]) until every rank of the group has called this, then returns. Every
    /// rank calls it once, after its last forward. Errors on a model that is not expert-parallel.
    pub fn serve_until_done(&self) -> Result<()> {
        loop {
            let g = self.group()?;
            let round = agree(g, Turn::Done)?;
            if round.all_done {
                return Ok(());
            }
            if round.forward {
                self.join_blocks()?;
            }
        }
    }

    fn group(&self) -> Result<&dyn Collective> {
        match &self.group {
            Some(g) => Ok(g.as_ref()),
            None => candle_core::bail!("Model: the model is not expert-parallel (it has no group to exchange with; see Model::expert_parallel)"),
        }
    }

    fn round(&self, turn: Turn) -> Result<bool> {
        let round = agree(self.group()?, turn)?;
        if round.forward && turn != Turn::Forward {
            self.join_blocks()?;
        }
        Ok(round.forward)
    }

    /// Every block's MoE exchange with no tokens, in block order.
    fn join_blocks(&self) -> Result<()> {
        let (dev, d) = (self.head.device(), self.embed.hidden_size());
        let empty = Tensor::zeros((0, d), self.dtype, dev)?;
        for layer in &self.layers {
            if let Ffn::Sharded(moe, comm) = &layer.ffn {
                moe.forward(&empty, &RowGroups::from_lens([]), comm.as_ref())?;
            }
        }
        Ok(())
    }

    /// One forward over several sequences, each an item: a chunk of tokens (a prefill chunk or
    /// one decode token, mixed freely) at positions `item.cache.seq_len() ..` of its own cache.
    /// Returns the logits of the rows each item asks for ([`LogitRows`], default its last token).
    ///
    /// The embedding, Engram lookups, mHC mixes, norms, every MoE linear and the head run once
    /// over the concatenated rows of all items (the head only over the requested rows); the
    /// attention runs per item on its rows and its cache, as do the Engram n-gram history and
    /// everything else held per sequence. On the CPU every item's logits are bit for bit those
    /// of [`Model::forward`] of its chunk alone: each row-wise product multiplies an item's rows
    /// in a product that takes the kernel of the item's own call ([`crate::nn::grouped_matmul`];
    /// `tests/batched.rs`); a batch of one is the plain product.
    ///
    /// Errors before touching any cache with a [`BatchError`](super::BatchError) for an empty
    /// batch, an empty chunk or a logit row outside its chunk, and with an [`InputError`] for a token id outside the
    /// vocabulary. The same cache cannot be passed twice (each item borrows it mutably).
    pub fn forward_batch(&self, items: &mut [BatchItem]) -> Result<BatchOutput> {
        let plan = BatchPlan::new(self, items)?;
        if self.group.is_some() {
            // Expert parallel: the other ranks learn that this call forwards and join it.
            self.round(Turn::Forward)?;
        }
        let tokens: Vec<u32> = items.iter().flat_map(|it| it.tokens.iter().copied()).collect();
        let t = tokens.len();
        let dev = self.head.device().clone();
        let ids = Tensor::new(tokens.as_slice(), &dev)?;
        let h0 = self.embed.forward(&ids)?.to_dtype(self.dtype)?;
        let d = h0.dim(1)?;
        let mut x = h0.unsqueeze(1)?.broadcast_as((t, self.hc, d))?.contiguous()?;
        let mut one_hot = vec![0f32; self.hc];
        one_hot[0] = 1.0;
        let mut pre = Tensor::new(one_hot, &dev)?.unsqueeze(0)?.broadcast_as((t, self.hc))?.contiguous()?;
        let hashes = match &self.engram {
            Some(hasher) => Some(items.iter_mut().map(|it| hasher.hash(it.tokens, &mut it.cache.engram)).collect::<Result<Vec<_>>>()?),
            None => None,
        };
        let mut segs: Vec<Segment> = items
            .iter_mut()
            .zip(&plan.spans)
            .map(|(it, rows)| Segment { rows: rows.clone(), start: it.cache.seq_len(), cache: &mut it.cache.attention })
            .collect();
        // Every Engram layer's ids are known now; the tables in host memory start reading their
        // rows on threads of their own (page faults and copies into the staging buffers overlap
        // the launches and device work of the layers before), each block uploads its rows.
        let ids: Vec<Option<Tensor>> = self
            .layers
            .iter()
            .map(|layer| match (&hashes, &layer.engram) {
                (Some(hs), Some(e)) => engram_ids(hs, layer.layer, t, &e.table().ids_device(&dev)).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;
        std::thread::scope(|scope| -> Result<()> {
            let mut gathers = Vec::with_capacity(self.layers.len());
            for (layer, ids) in self.layers.iter().zip(&ids) {
                let host = layer.engram.as_ref().and_then(|e| e.table().host_rows());
                gathers.push(match (host, ids) {
                    (Some(host), Some(ids)) => {
                        let ids = ids.flatten_all()?.to_vec1::<u32>()?;
                        Some((host, scope.spawn(move || host.gather(&ids))))
                    }
                    _ => None,
                });
            }
            for ((layer, ids), gather) in self.layers.iter().zip(&ids).zip(gathers) {
                if let Some(h) = ids {
                    record(&mut segs, || format!("L{}.engram_hash", layer.layer), h)?;
                }
                let input = match gather {
                    Some((host, g)) => {
                        let g = g.join().map_err(|_| candle_core::Error::Msg(format!("layer {}: the Engram row gather panicked", layer.layer)))??;
                        Some(EngramInput::Rows(host.upload(g)?))
                    }
                    None => ids.as_ref().map(EngramInput::Ids),
                };
                (x, pre) = layer.forward_segments(&x, &pre, input, &mut segs)?;
            }
            Ok(())
        })?;
        // Only the requested rows go on (every part from here is row-wise).
        let every_row = plan.logit_rows.len() == t && plan.logit_rows.iter().enumerate().all(|(i, &r)| r as usize == i);
        if !every_row {
            let rows = Tensor::new(plan.logit_rows.as_slice(), &dev)?;
            (x, pre) = (x.index_select(&rows, 0)?, pre.index_select(&rows, 0)?);
        }
        let h = collapse_norm(&x, &pre, &self.norm)?;
        // Each item's head rows as in its own call, which multiplies all its chunk's rows.
        let head_groups = RowGroups::new(plan.out_rows.iter().zip(&plan.spans).map(|(o, s)| RowGroup { len: o.len(), alone: s.len().max(o.len()) }).collect())?;
        let logits = self.head.forward_grouped(&h, &head_groups)?;
        for (seg, rows) in segs.iter_mut().zip(&plan.out_rows) {
            if seg.cache.is_tracing() {
                seg.cache.record(|| "logits".to_string(), &logits.narrow(0, rows.start, rows.len())?);
            }
        }
        Ok(BatchOutput { logits, rows: plan.out_rows })
    }

    /// The token embedding (`embed`).
    pub fn embedding(&self) -> &Embedding {
        &self.embed
    }

    /// The final RMSNorm (`norm`).
    pub fn final_norm(&self) -> &RmsNorm {
        &self.norm
    }

    /// The f32 output head (`head`).
    pub fn head(&self) -> &Linear {
        &self.head
    }

    /// The Engram hasher (`None` without Engram layers).
    pub fn engram_hasher(&self) -> Option<&EngramHasher> {
        self.engram.as_ref()
    }

    /// `hc_mult`: the copies of the residual stream.
    pub fn hc_mult(&self) -> usize {
        self.hc
    }

    /// The activations' dtype (the var builder's).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The decoder blocks, in layer order (e.g. to run or time one block's parts alone).
    pub fn layers(&self) -> &[DecoderLayer] {
        &self.layers
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
