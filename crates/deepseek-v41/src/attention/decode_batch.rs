//! The single-token decode step of one attention layer for B sequences at once
//! (`docs/architecture.md`, "The batched decode step"): the computation of
//! [`Attention::forward`] for one token of each sequence, over the caller-owned pooled caches
//! of [`BatchedLayerCache`], with every position-dependent value read from the fixed-shape
//! device tensors of [`DecodeStepInputs`]. The ops, their launch shapes and arguments are the
//! same every step, so the step can be captured into a CUDA graph once and replayed after each
//! [`DecodeStepInputs::update`]; nothing inside reads the device from the host.
//!
//! | phase ([`DecodeStep`] method) | ops (B sequences, one token each) |
//! |---|---|
//! | [`projections`](DecodeStep::projections) | `wq_a` + `q_norm`, `wkv` + `kv_norm`, `wq_b`: `[B, hidden]` products |
//! | [`inserts`](DecodeStep::inserts) | q RoPE in place; window rows (`cuda::window_insert`, packed: `cuda::packed_insert`, format A) at the window slots; kv sources: `compressor.wkv` of all B rows (ratio 2: also `wgate` and the softmax pooling with the carried token), `compressor.norm`, `indexer.wk`, then the compressed entry and index key (`compressed_insert` / `index_key_insert`, packed: B / E) at the entry slots, −1 (skipped) for sequences that close no group; ratio 2: the carry takes this token's projections where no group closes (`where_cond`) |
//! | [`selection`](DecodeStep::selection) | index sources (kv + index sources, `Reindex` layers): `indexer.wq_b`, index-query RoPE and FP4 fake quant, head weights, `cuda::index_select` over the key owner's index keys (through the page table, per-sequence visible counts; a candidate consumer's scores masked to the published blocks, the candidate source's blocks returned), the top-k mapped to pool rows through the page table (a gather, −1 kept); reuse layers: the top-k their index source returned; window-only layers: none |
//! | [`attention`](DecodeStep::attention) | sparse attention with sink over the window pool (the window indices) and the kv source's compressed pool (the top-k rows) |
//! | [`output`](DecodeStep::output) | inverse RoPE, grouped `wo_a`, `wo_b` |
//!
//! The ops are the `cuda` feature's fused ops (`attention/decode_ops.rs`; on the CPU they run
//! their references), or without the feature the same CPU references called directly.
//!
//! Layers composed ([`DecodeLayerKind`], spec §1.4): window-only layers, kv + index sources of
//! ratio 1 or 2 (`TopkRole::Full`), index sources over another layer's keys
//! (`TopkRole::Reindex`) and top-k reuse layers; an index source may publish candidate blocks
//! (the candidate source) or consume them (spec §6.4, [`DecodeLayer::candidates`]). What a layer
//! reads from earlier layers of the same step — the top-k of its index source, the candidate
//! source's blocks — is passed in [`Published`] (the caller runs the layers in order).
//!
//! On the CPU the ops run their references and every product multiplies each sequence's row as
//! its own call does ([`RowGroups`]), so the step gives, bit for bit, what
//! [`Attention::forward`] gives each sequence alone (`tests/decode_batch.rs`); on CUDA the
//! products of B rows sum in another order than B products of one row.
//!
//! **The compressor at ratio 1** pools one token: every step writes an entry at every sequence's
//! entry slot (entry p's slot in its page), `norm(compressor.wkv x)` with `wkv` a bf16 product, no carry (the
//! carry pools of a ratio-1 source are not read).
//!
//! **The compressor at ratio 2.** A group is two tokens: a sequence at an even position opens one
//! (its projections are carried), at the next odd position it closes it. The pooling runs for all
//! B rows with each row's carry; the latent, key and inserts of rows that close no group are
//! computed and not stored (entry slot −1), so which sequences close never changes the launched
//! ops. The carry keeps its value where a group closes and takes the token's projections
//! elsewhere: a repeated step at the same positions (a warm-up before a capture) changes nothing.

use candle_core::{DType, Module, Result, Tensor};

use super::batch_cache::{BatchedLayerCache, PoolRows};
use super::compress_pool::compress_pool;
use super::page_table::page_rows;
use super::decode_error::{check_tensor, DecodeStepError};
use super::decode_inputs::DecodeStepInputs;
#[cfg(feature = "cuda")]
use super::decode_ops::packed_insert;
use super::decode_ops::{attend, compressed_insert, fake_quant_device, index_key_insert, q_rope_inplace, select_topk, window_insert, SelectKeys};
use super::indexer::{CandidateShape, Candidates};
use super::layer::{Attention, AttentionParams};
use crate::config::{AttentionRole, CandidateRole, Config, TopkRole};
use crate::nn::{RopeTable, RowGroups};
use crate::quant::fake_quant::QatFormat;

/// What a layer's step does besides the projections, the window and the output (spec §1.4).
/// Index sources (`Source`, `Reindex`) also publish or consume candidate blocks as
/// [`DecodeLayer::candidates`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeLayerKind {
    /// Attention over the window only.
    WindowOnly,
    /// A kv and index source (ratio 1 or 2, `TopkRole::Full`): compressor, compressed entries
    /// and index keys, index scores and top-k over its own keys.
    Source,
    /// An index source over the index keys of the kv source `key_owner` (`TopkRole::Reindex`):
    /// index scores and top-k, attention over `key_owner`'s compressed entries.
    Reindex {
        /// The kv source whose index keys are scored and whose compressed entries are read.
        key_owner: usize,
    },
    /// Attention over the window and the compressed entries of `kv_source` selected by the
    /// top-k of `index_source` (the same step).
    Reuse {
        /// The layer whose compressed entries are read.
        kv_source: usize,
        /// The layer whose top-k is reused.
        index_source: usize,
    },
}

/// One attention layer as the batched decode step runs it: its parameters (borrowed from the
/// [`Attention`] module) and shapes.
#[derive(Debug, Clone)]
pub struct DecodeLayer<'a> {
    layer: usize,
    kind: DecodeLayerKind,
    candidates: CandidateRole,
    /// `candidate_block_size`, `candidate_topk_blocks`.
    candidate_block: usize,
    candidate_blocks: usize,
    params: AttentionParams<'a>,
    ratio: usize,
    hidden: usize,
    heads: usize,
    head_dim: usize,
    o_groups: usize,
    index_heads: usize,
    index_head_dim: usize,
    topk: usize,
    window: usize,
    /// Why the fused CUDA kernels cannot run the layer (`None`: they can).
    unfused: Option<String>,
}

impl<'a> DecodeLayer<'a> {
    /// The batched step of `attn`, a layer of `cfg`. Errors for a layer kind the step does not
    /// compose (module docs) or a config whose role for the layer differs from the module's.
    pub fn new(cfg: &Config, attn: &'a Attention) -> Result<Self> {
        let (layer, role) = (attn.layer(), attn.role());
        let unsupported = || DecodeStepError::UnsupportedLayer { layer, role: format!("{role:?}") };
        if cfg.layers.get(layer).map(|r| r.attention) != Some(role) {
            Err(DecodeStepError::Mismatch { layer, why: format!("the config's role of layer {layer} is not the module's {role:?}") })?
        }
        let p = attn.params();
        let (kind, ratio) = match role {
            AttentionRole::WindowOnly => (DecodeLayerKind::WindowOnly, 0),
            AttentionRole::Compressed { ratio, .. } if !(1..=2).contains(&ratio) => Err(unsupported())?,
            AttentionRole::Compressed { ratio, kv_source, topk: TopkRole::Full { .. } } if kv_source == layer => {
                // Ratio 1 pools one token (no gate, no carry); ratio 2 gates the pair (spec §5).
                let complete = p.compressor.is_some_and(|c| c.ratio() == ratio && c.wgate().is_some() == (ratio > 1))
                    && p.key_projection.is_some()
                    && p.indexer.is_some();
                if !complete {
                    Err(DecodeStepError::Mismatch { layer, why: "a kv + index source without its compressor, key projection or indexer".into() })?
                }
                (DecodeLayerKind::Source, ratio)
            }
            AttentionRole::Compressed { ratio, kv_source, topk: TopkRole::Reindex { key_owner, .. } } if key_owner == kv_source => {
                if p.indexer.is_none() {
                    Err(DecodeStepError::Mismatch { layer, why: "an index source without its indexer".into() })?
                }
                (DecodeLayerKind::Reindex { key_owner }, ratio)
            }
            AttentionRole::Compressed { ratio, kv_source, topk: TopkRole::Reuse { index_source } } => {
                (DecodeLayerKind::Reuse { kv_source, index_source }, ratio)
            }
            _ => Err(unsupported())?,
        };
        let candidates = role_candidates(role);
        Ok(Self {
            layer,
            kind,
            candidates,
            candidate_block: cfg.candidate_block_size,
            candidate_blocks: cfg.candidate_topk_blocks,
            params: p,
            ratio,
            hidden: cfg.hidden_size,
            heads: cfg.num_attention_heads,
            head_dim: cfg.head_dim,
            o_groups: cfg.o_groups,
            index_heads: cfg.index_n_heads,
            index_head_dim: cfg.index_head_dim,
            topk: cfg.index_topk,
            window: cfg.sliding_window,
            unfused: attn.fused_limits().map(str::to_string),
        })
    }

    /// The layer's index.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// What the step does for this layer.
    pub fn kind(&self) -> DecodeLayerKind {
        self.kind
    }

    /// The candidate blocks the layer publishes (the candidate source) or consumes (index
    /// sources after it), spec §6.4; [`CandidateRole::None`] for other layers.
    pub fn candidates(&self) -> CandidateRole {
        self.candidates
    }

    /// `candidate_topk_blocks`: the blocks a candidate source publishes per sequence.
    pub fn candidate_blocks(&self) -> usize {
        self.candidate_blocks
    }

    /// The layer's parameters.
    pub fn params(&self) -> &AttentionParams<'a> {
        &self.params
    }

    /// The compress ratio (0: window-only).
    pub fn ratio(&self) -> usize {
        self.ratio
    }

    /// `head_dim` (the width of window rows and compressed entries).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// `index_head_dim` (the width of index keys).
    pub fn index_head_dim(&self) -> usize {
        self.index_head_dim
    }

    /// `index_topk`.
    pub fn topk(&self) -> usize {
        self.topk
    }

    /// `sliding_window` (W).
    pub fn window(&self) -> usize {
        self.window
    }

    /// The layer's RoPE table.
    pub fn rope(&self) -> &RopeTable {
        self.params.rope
    }

    /// The kv source whose compressed entries the layer reads (itself for a kv source, `None`
    /// for a window-only layer).
    pub fn kv_source(&self) -> Option<usize> {
        match self.kind {
            DecodeLayerKind::WindowOnly => None,
            DecodeLayerKind::Source => Some(self.layer),
            DecodeLayerKind::Reindex { key_owner: s } | DecodeLayerKind::Reuse { kv_source: s, .. } => Some(s),
        }
    }

    /// The cache holding the compressed entries this layer reads: its own for a kv source,
    /// `kv_source` for a reindex or reuse layer (it must be the cache of the layer's kv source),
    /// none for a window-only layer.
    pub(super) fn kv_cache<'c>(
        &self,
        own: &'c BatchedLayerCache,
        kv_source: Option<&'c BatchedLayerCache>,
    ) -> std::result::Result<Option<&'c BatchedLayerCache>, DecodeStepError> {
        let l = self.layer;
        let mismatch = |why: String| DecodeStepError::Mismatch { layer: l, why };
        if own.layer() != l {
            return Err(mismatch(format!("its own cache was built for layer {}", own.layer())));
        }
        let reads_other = matches!(self.kind, DecodeLayerKind::Reindex { .. } | DecodeLayerKind::Reuse { .. });
        match (self.kind, self.kv_source(), kv_source) {
            (DecodeLayerKind::WindowOnly, _, None) => Ok(None),
            (DecodeLayerKind::Source, _, None) => Ok(Some(own)),
            (_, Some(s), Some(kv)) if reads_other && kv.layer() == s && kv.source().is_some() => Ok(Some(kv)),
            (_, Some(s), Some(kv)) if reads_other => {
                Err(mismatch(format!("pass the cache of its kv source, layer {s}, not the cache of layer {}", kv.layer())))
            }
            (_, Some(s), None) if reads_other => Err(mismatch(format!("pass the cache of its kv source, layer {s}"))),
            (_, _, Some(kv)) => {
                Err(mismatch(format!("only reindex and reuse layers take a kv source's cache, got the cache of layer {}", kv.layer())))
            }
            (_, _, None) => Err(mismatch("a layer without a kv source".into())),
        }
    }
}

/// The candidate role of a layer of role `role` (spec §6.4).
fn role_candidates(role: AttentionRole) -> CandidateRole {
    match role {
        AttentionRole::Compressed { topk, .. } => topk.candidates(),
        AttentionRole::WindowOnly => CandidateRole::None,
    }
}

/// The options of the step's sparse attention on CUDA (the CPU reference has none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepOptions {
    /// The kernel (`SparseAttentionKernel::Auto`: the launcher's choice).
    #[cfg(feature = "cuda")]
    pub kernel: crate::cuda::SparseAttentionKernel,
    /// KV splits (`None`: the launcher's choice).
    pub num_splits: Option<usize>,
}

/// The outputs of [`DecodeStep::projections`].
#[derive(Debug, Clone)]
pub struct Projections {
    /// `[B, hidden]` bf16: the layer input.
    pub x: Tensor,
    /// `[B, q_lora]` bf16: the q-LoRA activation (after `q_norm`).
    pub qr: Tensor,
    /// `[B, head_dim]` bf16: the `kv_norm`'ed window KV (pre-RoPE).
    pub kv: Tensor,
    /// `[B, heads, head_dim]` bf16: the queries (RoPE'd in place by [`DecodeStep::inserts`]).
    pub q: Tensor,
    /// `[B, H_I·d_I]` bf16: the index queries' projection, where the layer computes it with `q`
    /// (`wq_b` and `indexer.wq_b` stacked: one launch; RoPE'd in place by
    /// [`DecodeStep::selection`]); else `None` and the selection computes it.
    pub iq: Option<Tensor>,
}

/// The result of [`DecodeStep::selection`].
#[derive(Debug, Clone, Default)]
pub struct StepSelection {
    /// `[B, index_topk]` i64 rows of the kv source's compressed pool the layer attends (−1:
    /// none): what the reuse layers of an index source take; `None` for window-only layers.
    pub topk: Option<Tensor>,
    /// `[B, candidate_topk_blocks]` i64: the candidate source's kept blocks of each sequence's
    /// entries (block ids of `candidate_block_size` entries, ascending, −1 padded; spec §6.4),
    /// what the candidate consumers take; `None` for other layers.
    pub candidates: Option<Tensor>,
}

/// What earlier layers of the same step published for this one: the top-k of its index source
/// (reuse layers) and the candidate blocks of the candidate source (candidate consumers).
#[derive(Debug, Clone, Copy, Default)]
pub struct Published<'t> {
    /// The index source's [`StepSelection::topk`] (reuse layers only).
    pub topk: Option<&'t Tensor>,
    /// The candidate source's [`StepSelection::candidates`] (candidate consumers only).
    pub candidates: Option<&'t Tensor>,
}

/// The result of [`DecodeStep::forward`].
#[derive(Debug, Clone)]
pub struct DecodeStepOutput {
    /// `[B, hidden]` bf16.
    pub y: Tensor,
    /// `[B, index_topk]` i64 rows of the kv source's compressed pool the layer attended (−1:
    /// none): what the reuse layers of an index source take; `None` for window-only layers.
    pub topk: Option<Tensor>,
    /// The candidate source's published blocks ([`StepSelection::candidates`]); `None` for other
    /// layers.
    pub candidates: Option<Tensor>,
}

/// The decode step of one layer for the B sequences of its caches (see the module docs): the
/// layer, its caches and the step inputs, checked to fit together. Cheap to build; the phases
/// can be called one by one (per-phase timing) or all at once ([`DecodeStep::forward`]).
#[derive(Debug, Clone)]
pub struct DecodeStep<'s> {
    layer: &'s DecodeLayer<'s>,
    own: &'s BatchedLayerCache,
    kv: Option<&'s BatchedLayerCache>,
    inputs: &'s DecodeStepInputs,
    rows: RowGroups,
    options: StepOptions,
}

impl<'s> DecodeStep<'s> {
    /// The step of `layer` over its cache `own`, the cache of its kv source for a reuse layer
    /// (`kv_source`; `None` for other layers) and `inputs` (built for this layer's kind and
    /// caches, [`DecodeStepInputs::new`]). Errors name what does not fit.
    pub fn new(
        layer: &'s DecodeLayer<'s>,
        own: &'s BatchedLayerCache,
        kv_source: Option<&'s BatchedLayerCache>,
        inputs: &'s DecodeStepInputs,
    ) -> Result<Self> {
        let l = layer.layer;
        let mismatch = |why: String| DecodeStepError::Mismatch { layer: l, why };
        let kv = layer.kv_cache(own, kv_source)?;
        let b = own.batch();
        for (what, got) in [("the step inputs", inputs.batch()), ("the kv source's cache", kv.map_or(b, |k| k.batch()))] {
            if got != b {
                Err(DecodeStepError::BatchMismatch { what, batch: b, got })?
            }
        }
        if inputs.window_stride() != own.window_stride() || inputs.window_indices().dim(1)? != layer.window {
            Err(mismatch("the step inputs were built for another window geometry".into()))?
        }
        if inputs.rope().rope_dim() != layer.rope().rope_dim() {
            Err(mismatch(format!("the step inputs' RoPE rows have {} dims, the layer rotates {}", inputs.rope().rope_dim(), layer.rope().rope_dim())))?
        }
        match (kv, inputs.compressed()) {
            (None, None) => {}
            (Some(kv), Some(c)) => {
                let src = kv.source().ok_or_else(|| mismatch(format!("layer {} has no compressed pools", kv.layer())))?;
                if c.ratio != layer.ratio || c.entries != src.entries {
                    Err(mismatch(format!(
                        "the step inputs were built for ratio {} and {} entries per sequence, the layer has ratio {} and its kv source {}",
                        c.ratio, c.entries, layer.ratio, src.entries
                    )))?
                }
                if !kv.pages().is_some_and(|p| p.same(&c.pages)) {
                    Err(mismatch(format!("the step inputs were built over another page table than layer {}'s; build them over its cache", kv.layer())))?
                }
            }
            (None, Some(_)) => Err(mismatch("the step inputs are a compressed layer's; build them for this window-only layer".into()))?,
            (Some(_), None) => Err(mismatch("the step inputs are a window-only layer's; build them for this compressed layer".into()))?,
        }
        let packed = own.window_rows().storage().is_packed()
            || kv.and_then(|k| k.source()).is_some_and(|s| s.compressed.storage().is_packed() || s.index_keys.storage().is_packed());
        if packed && !layer.params.numerics.cache_fake_quant {
            Err(mismatch("packed pools need Numerics.cache_fake_quant = true (the packed formats are the cache quantization)".into()))?
        }
        if let (Some(why), true) = (&layer.unfused, inputs.device().is_cuda()) {
            Err(mismatch(format!("the fused CUDA kernels do not take this layer's shapes: {why}")))?
        }
        Ok(Self { layer, own, kv, inputs, rows: RowGroups::from_lens(std::iter::repeat_n(1, b)), options: StepOptions::default() })
    }

    /// The same step with these attention options.
    pub fn with_options(self, options: StepOptions) -> Self {
        Self { options, ..self }
    }

    /// Sequences of the batch.
    pub fn batch(&self) -> usize {
        self.own.batch()
    }

    /// The step inputs.
    pub fn inputs(&self) -> &DecodeStepInputs {
        self.inputs
    }

    /// The layer.
    pub fn layer(&self) -> &DecodeLayer<'s> {
        self.layer
    }

    /// The projections of `x` (`[B, hidden]` bf16, the attn-normed layer input).
    pub fn projections(&self, x: &Tensor) -> Result<Projections> {
        let (w, b) = (&self.layer.params, self.batch());
        check_tensor("x", x, DType::BF16, &[b, self.layer.hidden])?;
        let (qa, kva) = w.wq_a_wkv.forward_grouped(x, &self.rows)?;
        let qr = w.q_norm.forward(&qa)?;
        let kv = w.kv_norm.forward(&kva)?;
        let (q, iq) = match w.wq_b_index {
            Some(pair) => {
                let (q, iq) = pair.forward_grouped(&qr, &self.rows)?;
                (q, Some(iq))
            }
            None => (w.wq_b.forward_grouped(&qr, &self.rows)?, None),
        };
        let q = q.reshape((b, self.layer.heads, self.layer.head_dim))?;
        Ok(Projections { x: x.clone(), qr, kv, q, iq })
    }

    /// Rotates the queries in place and writes the caches: the window rows and, for a kv
    /// source, the compressed entry and index key of every closing group and the carry.
    pub fn inserts(&self, pr: &Projections) -> Result<()> {
        let (s, fq) = (self.inputs, self.layer.params.numerics.cache_fake_quant);
        let (cos, sin, _) = s.rope_rows();
        q_rope_inplace(&pr.q, cos, sin, None)?;
        match self.own.window_rows() {
            PoolRows::Bf16(t) => window_insert(t, &pr.kv, cos, sin, s.window_slots(), fq)?,
            #[cfg(feature = "cuda")]
            PoolRows::Packed(t, l) => packed_insert(t, l, &pr.kv, cos, sin, s.window_slots(), None)?,
        }
        if self.layer.kind != DecodeLayerKind::Source {
            return Ok(());
        }
        let w = &self.layer.params;
        let (Some(c), Some(keys), Some(src), Some(ci)) = (w.compressor, w.key_projection, self.own.source(), s.compressed()) else {
            Err(DecodeStepError::Mismatch { layer: self.layer.layer, why: "a kv source without its compressor or pools".into() })?
        };
        let ckv = c.wkv().forward_grouped(&pr.x, &self.rows)?;
        // Spec §5. Ratio 1: every token is a group of one, `norm(wkv x)` (a bf16 product), no
        // carry. Ratio 2: the group is the carried token and this one; softmax over the two.
        // The carry: kept where a group closes, this token's projections where one opens (written
        // after the pooling has read the old carry).
        let pooled = match c.wgate() {
            None => None,
            Some(wgate) => {
                let cs = wgate.forward_grouped(&pr.x, &self.rows)?;
                let (pooled, kv, score) = compress_pool(&src.carry_kv, &src.carry_score, &ckv, &cs, &ci.closing, pr.x.dtype())?;
                src.carry_kv.slice_set(&kv, 0, 0)?;
                src.carry_score.slice_set(&score, 0, 0)?;
                Some(pooled)
            }
        };
        let latent = c.norm().forward(pooled.as_ref().unwrap_or(&ckv))?;
        let k_pre = keys.project_grouped(&latent, &self.rows)?;
        let slots = &ci.entry_slots;
        match &src.compressed {
            PoolRows::Bf16(t) => compressed_insert(t, &latent, &ci.entry_cos, &ci.entry_sin, slots, fq)?,
            #[cfg(feature = "cuda")]
            PoolRows::Packed(t, l) => packed_insert(t, l, &latent, &ci.entry_cos, &ci.entry_sin, slots, None)?,
        }
        let norm = keys.k_norm();
        match &src.index_keys {
            PoolRows::Bf16(t) => index_key_insert(t, &k_pre, norm.weight(), norm.eps(), &ci.entry_cos, &ci.entry_sin, slots, fq)?,
            #[cfg(feature = "cuda")]
            PoolRows::Packed(t, l) => packed_insert(t, l, &k_pre, &ci.entry_cos, &ci.entry_sin, slots, Some((norm.weight(), norm.eps())))?,
        }
        Ok(())
    }

    /// The compressed pool rows `[B, index_topk]` i64 (−1: none) the attention reads and the
    /// candidate blocks the layer publishes ([`StepSelection`]): computed by an index source
    /// (kv + index sources: run [`DecodeStep::inserts`] first, the step's own entry is visible;
    /// reindex layers: after their kv source's step) over its key owner's index keys, masked to
    /// `published.candidates` for a candidate consumer; `published.topk` (the index source's
    /// result of this step) for a reuse layer; none for a window-only layer.
    pub fn selection(&self, pr: &Projections, published: Published) -> Result<StepSelection> {
        let (l, b, k) = (self.layer, self.batch(), self.layer.topk);
        let mismatch = |why: String| DecodeStepError::Mismatch { layer: l.layer, why };
        match l.kind {
            DecodeLayerKind::WindowOnly => return Ok(StepSelection::default()),
            DecodeLayerKind::Reuse { index_source, .. } => {
                let Some(t) = published.topk else { Err(mismatch(format!("pass the top-k of its index source, layer {index_source}")))? };
                check_tensor("the reused top-k", t, DType::I64, &[b, k])?;
                return Ok(StepSelection { topk: Some(t.clone()), candidates: None });
            }
            DecodeLayerKind::Source | DecodeLayerKind::Reindex { .. } => {}
        }
        let (Some(ix), Some(src), Some(ci)) = (l.params.indexer, self.kv.and_then(|c| c.source()), self.inputs.compressed()) else {
            Err(mismatch("an index source without its indexer or its key owner's pools".into()))?
        };
        let consume = match l.candidates {
            CandidateRole::Consume { source } => {
                let Some(t) = published.candidates else { Err(mismatch(format!("pass the candidate blocks of layer {source}")))? };
                check_tensor("the published candidate blocks", t, DType::I64, &[b, l.candidate_blocks])?;
                Some(Candidates { block: l.candidate_block, kept: t.clone() })
            }
            _ => None,
        };
        let publish = (l.candidates == CandidateRole::Publish).then_some(CandidateShape { block: l.candidate_block, n_keep: l.candidate_blocks });
        let (cos, sin, _) = self.inputs.rope_rows();
        let iq = match &pr.iq {
            Some(iq) => iq.clone(),
            None => ix.wq_b().forward_grouped(&pr.qr, &self.rows)?,
        };
        let iq = iq.reshape((b, l.index_heads, l.index_head_dim))?;
        q_rope_inplace(&iq, cos, sin, None)?;
        let iq = if l.params.numerics.cache_fake_quant { fake_quant_device(&iq, QatFormat::Fp4Ue8m0B32)? } else { iq };
        let hw = ix.head_weights_grouped(&pr.x, &self.rows)?;
        let keys = SelectKeys { keys: &src.index_keys, page_table: &ci.page_table, entries: ci.entries, visible: &ci.visible };
        let sel = select_topk(&iq, &hw, &keys, k, consume.as_ref(), publish)?;
        // Entry j of sequence b → pool row table[b][j / P]·P + j mod P, −1 kept.
        let topk = page_rows(&sel.topk, &ci.page_table)?;
        Ok(StepSelection { topk: Some(topk), candidates: sel.candidates.map(|c| c.kept) })
    }

    /// The sparse attention `[B, heads, head_dim]` bf16 over each sequence's window and, with
    /// `topk` (pool rows of [`DecodeStep::selection`]), its selected compressed entries.
    pub fn attention(&self, pr: &Projections, topk: Option<&Tensor>) -> Result<Tensor> {
        let l = self.layer;
        let window = self.own.window_rows();
        let (extra, idx_extra) = match (topk, self.kv.and_then(|k| k.source())) {
            (Some(t), Some(src)) => (&src.compressed, t),
            (Some(_), None) => {
                Err(DecodeStepError::Mismatch { layer: l.layer, why: "a top-k was given to a layer without compressed entries".into() })?
            }
            (None, _) => (window, self.inputs.no_extra()),
        };
        let scale = (l.head_dim as f32).powf(-0.5);
        attend(&pr.q, window, self.inputs.window_indices(), extra, idx_extra, l.params.attn_sink, scale, self.options)
    }

    /// The layer output `[B, hidden]` bf16 of the attention output `o` (rotated back in place).
    pub fn output(&self, o: &Tensor) -> Result<Tensor> {
        let (l, b) = (self.layer, self.batch());
        let (cos, _, neg_sin) = self.inputs.rope_rows();
        q_rope_inplace(o, cos, neg_sin, None)?;
        let z = l.params.wo_a.forward_grouped(&o.reshape((b, l.o_groups, l.heads / l.o_groups * l.head_dim))?, &self.rows)?;
        l.params.wo_b.forward_grouped(&z, &self.rows)
    }

    /// The whole step for the layer input `x` (`[B, hidden]` bf16); a reuse layer takes the top-k
    /// its index source returned this step, a candidate consumer the blocks the candidate source
    /// returned ([`Published`]).
    pub fn forward(&self, x: &Tensor, published: Published) -> Result<DecodeStepOutput> {
        let pr = self.projections(x)?;
        self.inserts(&pr)?;
        let sel = self.selection(&pr, published)?;
        let o = self.attention(&pr, sel.topk.as_ref())?;
        Ok(DecodeStepOutput { y: self.output(&o)?, topk: sel.topk, candidates: sel.candidates })
    }
}
