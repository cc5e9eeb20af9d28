//! The single-token decode step of a whole [`Model`] for B sequences at once
//! (`docs/architecture.md`, "The whole-model decode step"): the computation of
//! [`Model::forward_batch`] with one token per sequence, over the pooled caches
//! of the attention's batched step ([`crate::attention::decode_batch`]), with every value
//! that changes between steps in a fixed-shape device tensor written by
//! [`ModelDecodeStep::update`]:
//!
//! | input | shape | written by `update` |
//! |---|---|---|
//! | tokens and Engram row ids | `[B + E·B·cols]` u32 (views `[B]` and, per Engram layer, `[B, cols]`) | one host→device copy; the ids hashed on the host from each sequence's [`EngramHistory`] (spec §9.4) |
//! | positions, slots, RoPE rows, page tables, ... | [`DecodeStepInputs`], one per RoPE set and entry geometry | one copy each (`[5, B]`; the page table whole when many rows changed, else its changed rows); the step derives the rest on the device ([`DecodeStepInputs::derive`], inside its graph) |
//! | Engram rows of a table in host memory | `[B, cols·head_dim]` bf16 per such layer | gathered on the host from the ids, one copy (and the device decode of stored FP8 rows) |
//!
//! The kv sources' compressed entries and index keys live in pages shared by the B sequences
//! ([`PageTable`]): [`ModelDecodeStep::new`] sizes each pool for B sequences at the capacity,
//! [`ModelDecodeStep::with_pool_tokens`] for a chosen number of tokens in all; pages are taken
//! as sequences grow ([`ModelDecodeStep::update`]) or are loaded, and returned by
//! [`ModelDecodeStep::release`]; [`ModelDecodeStep::page_occupancy`] reports them. A step whose
//! new entries find no free page is [`DecodeStepError::PoolFull`] and changes nothing.
//!
//! [`ModelDecodeStep::forward`] runs embedding → per layer (Engram, `hc_attn` mixes, collapse,
//! `attn_norm`, [`DecodeStep::forward`], post, `hc_ffn` mixes, collapse, `ffn_norm`, MoE, post)
//! → collapse, `norm`, head, with the decoder layer's own modules. Nothing in it depends on the
//! positions or tokens through the host: on CUDA, with MXFP4 routed
//! experts (the MoE then runs inside `cuda::with_device_routing`, which the step sets) and the
//! layers the fused attention kernels take, it reads nothing back and launches the same ops every
//! step, so it can be captured into a CUDA graph once per batch size and replayed after each
//! `update` ([`ModelDecodeStep::host_reads`] names what prevents it).
//!
//! On the CPU every product multiplies each sequence's row as its own call does, so the logits
//! are bit for bit those of [`Model::forward_batch`] of one token per sequence
//! (`tests/model_decode_step.rs`).
//!
//! An Engram table read from host memory ([`super::EngramTable::Rows`] / `Host`, the released
//! ~100 GB tables) has its rows gathered by `update` (the ids are known once the tokens are) into
//! a fixed device tensor the step reads ([`super::Engram::forward_rows`]), so that the step itself
//! still reads nothing from the host. The layers the attention step does not compose are refused
//! by [`DecodeLayer::new`].

use candle_core::{DType, Device, Module, Result, Tensor};

use super::decoder::{Model, ModelCache};
use super::engram::EngramTable;
use super::engram_hash::EngramHistory;
use super::engram_next::NextIds;
use super::mhc::{collapse_norm, post, post_collapse_norm, HcSublayer};
use super::side_work::SideWork;
use crate::attention::{
    BatchStorage, BatchedLayerCache, DecodeLayer, DecodeLayerKind, DecodeStep, DecodeStepError, DecodeStepInputs, PageTable, PageUse, Published,
    StepOptions,
};
use crate::config::{CandidateRole, Config};
use crate::host_upload::HostUpload;
use crate::nn::RowGroups;
use crate::sampling::{sample_batch, SamplingBatch};

/// The decode step of a whole model for B sequences (see the module docs): the per-layer
/// batched attention steps and pooled caches, the shared step inputs, the token / Engram-id
/// buffer and each sequence's Engram history (host).
#[derive(Debug)]
pub struct ModelDecodeStep<'m> {
    model: &'m Model,
    batch: usize,
    capacity: usize,
    layers: Vec<DecodeLayer<'m>>,
    caches: Vec<BatchedLayerCache>,
    /// The distinct step inputs and, per layer, which one it reads.
    inputs: Vec<DecodeStepInputs>,
    input_of: Vec<usize>,
    /// `[B + E·B·cols]` u32: the tokens, then each Engram layer's `[B, cols]` row ids.
    ids: Tensor,
    /// Writes `ids` (page-locked, one asynchronous copy on CUDA).
    ids_writer: HostUpload,
    tokens: Tensor,
    /// Per layer, its Engram ids view `[B, cols]` (Engram layers only).
    engram_ids: Vec<Option<Tensor>>,
    /// Per layer with an Engram table in host memory: where its `B·cols` ids start in the
    /// buffer and the `[B, cols·head_dim]` bf16 rows `update` stages for the step.
    staged_rows: Vec<Option<(usize, Tensor)>>,
    /// Engram ids per token.
    engram_cols: usize,
    /// `[B, hc]` f32: the carried pre of the embedding (one-hot on copy 0).
    pre0: Tensor,
    histories: Vec<EngramHistory>,
    /// Engram's largest n-gram (an empty history's width).
    ngram: usize,
    rows: RowGroups,
    options: StepOptions,
    /// Per row whether it holds a sequence (loaded or stepped, not released since).
    live: Vec<bool>,
    /// Rows the last update gave tokens to (the rest idle).
    updated: usize,
    /// The device hash of a step following the last one ([`ModelDecodeStep::update_next`]); `Err`:
    /// why there is none (an Engram table in host memory needs the ids on the host).
    next: std::result::Result<NextIds, String>,
    /// The positions of the last step's rows, while [`ModelDecodeStep::update_next`] may follow it
    /// (no load or release since).
    last_positions: Option<Vec<usize>>,
    /// Per row whether its device history is ahead of `histories` (steps followed on the device).
    stale: Vec<bool>,
}

impl<'m> ModelDecodeStep<'m> {
    /// A step for `batch` sequences of `model` (built from `cfg`) of up to `capacity` tokens each
    /// (positions `0 .. capacity`), with zeroed pools on `device` stored as `storage` says. Every
    /// sequence starts empty at position 0 until [`ModelDecodeStep::load`]. Errors for a layer the
    /// attention step does not compose (on CUDA also one whose shapes the fused kernels do not
    /// take), an Engram table not resident on `device`, or a model whose activations are not bf16.
    ///
    /// Each kv source of ratio r gets `batch·ceil(ceil(capacity / r) / P)` pages of
    /// P = [`PageTable::PAGE`] entries: every sequence can reach the capacity at once.
    pub fn new(cfg: &Config, model: &'m Model, batch: usize, capacity: usize, storage: BatchStorage, device: &Device) -> Result<Self> {
        Self::build(cfg, model, batch, capacity, None, storage, device)
    }

    /// [`ModelDecodeStep::new`] with page pools sized for `pool_tokens` tokens in all (summed over
    /// the sequences) instead of `batch·capacity`: each kv source of ratio r gets
    /// `ceil(ceil(pool_tokens / r) / P)` pages (each sequence's last page may be partly used, so
    /// the sequences fit when their entries rounded up to pages do). Fewer tokens than
    /// `batch·capacity` save device memory when the sequences are not all long at once; a step
    /// that finds no free page is [`DecodeStepError::PoolFull`]. Errors for `pool_tokens` = 0.
    #[allow(clippy::too_many_arguments)]
    pub fn with_pool_tokens(
        cfg: &Config,
        model: &'m Model,
        batch: usize,
        capacity: usize,
        pool_tokens: usize,
        storage: BatchStorage,
        device: &Device,
    ) -> Result<Self> {
        if pool_tokens == 0 {
            candle_core::bail!("ModelDecodeStep::with_pool_tokens: the page pools must hold at least 1 token, got 0")
        }
        Self::build(cfg, model, batch, capacity, Some(pool_tokens), storage, device)
    }

    fn build(cfg: &Config, model: &'m Model, batch: usize, capacity: usize, pool_tokens: Option<usize>, storage: BatchStorage, device: &Device) -> Result<Self> {
        if batch == 0 {
            Err(DecodeStepError::EmptyBatch)?
        }
        if capacity == 0 {
            candle_core::bail!("ModelDecodeStep: the capacity must be at least 1 token per sequence, got 0")
        }
        if model.dtype() != DType::BF16 {
            candle_core::bail!("ModelDecodeStep: the model's activations are {:?}; the batched decode step runs bf16 (load the model in bf16)", model.dtype())
        }
        if !model.head().device().same_device(device) {
            candle_core::bail!("ModelDecodeStep: the model is on {:?}, the step was asked for {device:?}", model.head().device())
        }
        let blocks = model.layers();
        let layers = blocks.iter().map(|b| DecodeLayer::new(cfg, b.attention())).collect::<Result<Vec<_>>>()?;
        let caches = layers
            .iter()
            .map(|l| {
                let (r, page) = (l.ratio().max(1), PageTable::PAGE);
                let pages = pool_tokens.map_or(batch * capacity.div_ceil(r).div_ceil(page), |t| t.div_ceil(r).div_ceil(page));
                BatchedLayerCache::zeros_paged(l, batch, capacity.div_ceil(r), pages, storage, device)
            })
            .collect::<Result<Vec<_>>>()?;
        // One inputs object per RoPE set and entry geometry: window-only layers share one, the
        // compressed layers one per kv source (a reuse layer reads its kv source's entries).
        let mut keys: Vec<Option<usize>> = Vec::new();
        let mut inputs = Vec::new();
        let mut input_of = Vec::with_capacity(layers.len());
        for (l, layer) in layers.iter().enumerate() {
            let kv = kv_source(layer);
            let i = match keys.iter().position(|k| *k == kv) {
                Some(i) => i,
                None => {
                    inputs.push(DecodeStepInputs::new(layer, &caches[l], kv_cache(layer, &caches))?);
                    keys.push(kv);
                    inputs.len() - 1
                }
            };
            input_of.push(i);
        }
        // Every layer's step fits its caches and inputs (on CUDA: shapes the fused kernels take).
        for (l, layer) in layers.iter().enumerate() {
            DecodeStep::new(layer, &caches[l], kv_cache(layer, &caches), &inputs[input_of[l]])?;
        }
        // The token and Engram-id buffer.
        let n_cols = model.engram_hasher().map_or(0, |h| h.layout().n_cols());
        let mut width = batch;
        let mut offsets = Vec::with_capacity(blocks.len());
        let mut staged_rows = Vec::with_capacity(blocks.len());
        for b in blocks {
            let offset = b.engram().map(|_| width);
            staged_rows.push(match (b.engram(), offset) {
                (Some(e), Some(o)) => match e.table() {
                    EngramTable::Resident(t) if t.device().same_device(device) => None,
                    EngramTable::Resident(t) => candle_core::bail!(
                        "ModelDecodeStep: layer {}'s Engram table is on {:?}, not on the step's device {device:?}",
                        b.layer(),
                        t.device()
                    ),
                    table => Some((o, Tensor::zeros((batch, n_cols * table.dims().1), DType::BF16, device)?)),
                },
                _ => None,
            });
            if offset.is_some() {
                width += batch * n_cols;
            }
            offsets.push(offset);
        }
        let engram_layers: Vec<usize> = blocks.iter().filter(|b| b.engram().is_some()).map(|b| b.layer()).collect();
        let next = if staged_rows.iter().any(Option::is_some) {
            Err("an Engram table in host memory: the step gathers its rows on the host from the ids".to_string())
        } else {
            NextIds::new(model.engram_hasher(), &engram_layers, batch, model.vocab_size(), device).map_err(|e| e.to_string())
        };
        // The history region after the Engram ids (`engram_next`): B·(max_ngram − 1) ids.
        let ngram = cfg.engram.as_ref().map_or(1, |e| e.max_ngram_size);
        if model.engram_hasher().is_some() {
            width += batch * (ngram - 1);
        }
        if let Ok(n) = &next {
            if n.geometry().len() != width {
                candle_core::bail!("ModelDecodeStep: the id buffer holds {width} ids, the device hash expects {}", n.geometry().len())
            }
        }
        let ids = Tensor::zeros(width, DType::U32, device)?;
        let engram_ids = offsets
            .iter()
            .map(|o| o.map(|o| ids.narrow(0, o, batch * n_cols)?.reshape((batch, n_cols))).transpose())
            .collect::<Result<Vec<_>>>()?;
        let hc = model.hc_mult();
        let mut one_hot = vec![0f32; batch * hc];
        one_hot.iter_mut().step_by(hc).for_each(|v| *v = 1.0);
        Ok(Self {
            model,
            batch,
            capacity,
            layers,
            caches,
            inputs,
            input_of,
            tokens: ids.narrow(0, 0, batch)?,
            ids,
            ids_writer: HostUpload::default(),
            engram_ids,
            staged_rows,
            engram_cols: n_cols,
            pre0: Tensor::from_vec(one_hot, (batch, hc), device)?,
            histories: vec![EngramHistory::new(ngram); batch],
            ngram,
            rows: RowGroups::from_lens(std::iter::repeat_n(1, batch)),
            options: StepOptions::default(),
            live: vec![false; batch],
            updated: batch,
            next,
            last_positions: None,
            stale: vec![false; batch],
        })
    }

    /// The same step with these attention options.
    pub fn with_options(self, options: StepOptions) -> Self {
        Self { options, ..self }
    }

    /// The device of the pools and of the step's outputs.
    pub fn device(&self) -> &Device {
        self.ids.device()
    }

    /// The model the step runs.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Sequences of the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens each sequence can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Every layer's pooled caches, by layer.
    pub fn caches(&self) -> &[BatchedLayerCache] {
        &self.caches
    }

    /// The distinct step inputs (one per RoPE set and entry geometry).
    pub fn inputs(&self) -> &[DecodeStepInputs] {
        &self.inputs
    }

    /// The kv sources' page pools: pages held and total, by kv source.
    pub fn page_occupancy(&self) -> Vec<PageUse> {
        self.caches.iter().filter_map(|c| c.pages().map(|p| p.occupancy())).collect()
    }

    /// Returns the pages batch row `seq` holds in every kv source's pools and empties its Engram
    /// history: the row can take another sequence ([`ModelDecodeStep::load`]). Until then it
    /// still steps with the batch (its outputs are meaningless): step it as a new sequence from
    /// position 0, where it holds at most one page per ratio-1 kv source. Errors for a row
    /// outside the batch.
    pub fn release(&mut self, seq: usize) -> Result<()> {
        if seq >= self.batch {
            Err(DecodeStepError::BatchMismatch { what: "the sequence index", batch: self.batch, got: seq + 1 })?
        }
        self.sync_histories()?;
        for c in &self.caches {
            c.release(seq)?;
        }
        self.histories[seq] = EngramHistory::new(self.ngram);
        (self.stale[seq], self.last_positions) = (false, None);
        self.live[seq] = false;
        Ok(())
    }

    /// Whether row `seq` holds a sequence (loaded or stepped since its last release).
    pub fn is_live(&self, seq: usize) -> bool {
        self.live.get(seq).copied().unwrap_or(false)
    }

    /// Copies sequence `cache` (prefilled with [`Model::forward`] or [`Model::forward_batch`])
    /// into row `seq` of every layer's pools (the kv sources' entries into the pages the row
    /// holds or takes), and its Engram history; its next step runs at position
    /// `cache.seq_len()`. Errors, changing nothing, when `seq` is outside the batch, the sequence
    /// does not fit the capacity or a page pool is full ([`DecodeStepError::PoolFull`]).
    pub fn load(&mut self, seq: usize, cache: &ModelCache) -> Result<()> {
        if seq >= self.batch {
            Err(DecodeStepError::BatchMismatch { what: "the sequence index", batch: self.batch, got: seq + 1 })?
        }
        if cache.seq_len() >= self.capacity {
            candle_core::bail!(
                "ModelDecodeStep::load: sequence {seq} holds {} tokens, its next step would pass the capacity of {} tokens",
                cache.seq_len(),
                self.capacity
            )
        }
        for c in &self.caches {
            c.check_load(seq, &cache.attention)?;
        }
        self.sync_histories()?;
        for c in &self.caches {
            c.load_sequence(seq, &cache.attention)?;
        }
        self.histories[seq] = cache.engram.clone();
        (self.stale[seq], self.last_positions) = (false, None);
        self.live[seq] = true;
        Ok(())
    }

    /// Writes the step's inputs: sequence b decodes `tokens[b]` at `positions[b]` (the tokens it
    /// holds so far). The tokens and Engram ids (hashed on the host against each sequence's
    /// history, which then takes the token) go up in one copy, the position tables in one copy
    /// per inputs object (with the kv sources' page tables, after taking the pages the new entries
    /// need). Errors, changing nothing, for a wrong count, a token outside the vocabulary, a
    /// position at or past the capacity, a full page pool ([`DecodeStepError::PoolFull`]), or
    /// (Engram models) a position other than the length of the sequence's Engram history.
    ///
    /// Call it outside a graph capture and with Candle's host-upload cache off (see
    /// [`DecodeStepInputs::update`]).
    pub fn update(&mut self, tokens: &[u32], positions: &[usize]) -> Result<()> {
        let b = self.batch;
        for (what, got) in [("tokens", tokens.len()), ("positions", positions.len())] {
            if got != b {
                Err(DecodeStepError::BatchMismatch { what, batch: b, got })?
            }
        }
        self.update_first(tokens, positions)
    }

    /// [`ModelDecodeStep::update`] of the first n = `tokens.len()` ≤ B rows; the rows after them
    /// are written idle ([`DecodeStepInputs::update_first`]: they take no page, no Engram token)
    /// and must hold no sequence, so that a step over any first m ≥ n rows
    /// ([`ModelDecodeStep::forward_rows`], a batch-size bucket) steps exactly the n sequences.
    /// Sequences take the lowest rows: load or start new ones in the lowest free rows. Errors,
    /// changing nothing, as `update` does, for n = 0 or n > B, and for a row at or past n that
    /// holds a sequence ([`DecodeStepError::RowInUse`]).
    pub fn update_first(&mut self, tokens: &[u32], positions: &[usize]) -> Result<()> {
        if tokens.is_empty() {
            Err(DecodeStepError::EmptyBatch)?
        }
        self.write_first(tokens, positions)
    }

    /// Writes every row idle: a step then changes no sequence's state (what
    /// [`super::GraphedDecodeStep::capture_buckets`] captures over). Errors for a row that holds
    /// a sequence ([`DecodeStepError::RowInUse`]).
    pub fn idle(&mut self) -> Result<()> {
        self.write_first(&[], &[])
    }

    /// [`ModelDecodeStep::update_first`], n = 0 included.
    fn write_first(&mut self, tokens: &[u32], positions: &[usize]) -> Result<()> {
        let (b, n) = (self.batch, tokens.len());
        for (what, got) in [("tokens", n), ("positions", positions.len())] {
            if got > b || got != n {
                Err(DecodeStepError::BatchMismatch { what, batch: b, got })?
            }
        }
        if let Some(row) = (n..b).find(|&r| self.live[r]) {
            Err(DecodeStepError::RowInUse { row, given: n })?
        }
        if n > 0 {
            self.model.check_tokens(tokens)?;
        }
        if let Some((s, &p)) = positions.iter().enumerate().find(|&(_, &p)| p >= self.capacity) {
            candle_core::bail!("ModelDecodeStep::update: sequence {s} at position {p}, the step holds {} tokens per sequence", self.capacity)
        }
        self.sync_histories()?;
        // The buffer: B tokens (idle rows 0), then per Engram layer B·cols ids (idle rows 0),
        // then the histories after this step (`engram_next`).
        let cols = self.engram_cols;
        let mut host = vec![0u32; self.ids.elem_count()];
        host[..n].copy_from_slice(tokens);
        // The stepped rows' histories, committed only once every check has passed.
        let mut histories = self.histories[..n].to_vec();
        if let Some(hasher) = self.model.engram_hasher() {
            let mut hashed = Vec::with_capacity(n);
            for (s, ((&t, &p), h)) in tokens.iter().zip(positions).zip(&mut histories).enumerate() {
                if h.seq_len() != p {
                    candle_core::bail!(
                        "ModelDecodeStep::update: sequence {s} at position {p}, its Engram history holds {} tokens (load the sequence, or pass its length)",
                        h.seq_len()
                    )
                }
                hashed.push(hasher.hash(&[t], h)?);
            }
            let mut at = b;
            for (block, ids) in self.model.layers().iter().zip(&self.engram_ids) {
                if ids.is_none() {
                    continue;
                }
                for (s, h) in hashed.iter().enumerate() {
                    match h.layer(block.layer()) {
                        Some(v) if v.len() == cols => host[at + s * cols..at + (s + 1) * cols].copy_from_slice(v),
                        Some(v) => candle_core::bail!("ModelDecodeStep::update: the Engram hasher gave {} ids for layer {}, expected {cols}", v.len(), block.layer()),
                        None => candle_core::bail!("ModelDecodeStep::update: the Engram hasher has no ids for layer {}", block.layer()),
                    }
                }
                at += b * cols;
            }
            let (g, pad) = (self.ngram - 1, hasher.pad_compressed());
            for s in 0..b {
                let recent = histories.get(s).map_or(&[][..], |h| h.recent());
                let kept = &recent[recent.len().saturating_sub(g)..];
                let row = &mut host[at + s * g..at + (s + 1) * g];
                row[..g - kept.len()].fill(pad);
                row[g - kept.len()..].copy_from_slice(kept);
            }
        }
        // Every page pool can serve the step before anything is written.
        for inputs in &self.inputs {
            inputs.check_first(positions)?;
        }
        let dev = self.ids.device();
        // Rows of host tables: gathered now (the ids are known), staged for the step.
        let mut staged = Vec::new();
        for (block, rows) in self.model.layers().iter().zip(&self.staged_rows) {
            if let (Some(e), Some((o, _)), true) = (block.engram(), rows, n > 0) {
                let ids = Tensor::from_slice(&host[*o..*o + n * cols], n * cols, &Device::Cpu)?;
                staged.push(e.table().rows(&ids, dev)?.reshape((n, ()))?);
            }
        }
        self.ids_writer.write(&self.ids, &host)?;
        // The host part only: the step derives the rest on the device (inside its graph).
        for inputs in &self.inputs {
            inputs.stage_first(positions)?;
        }
        for ((_, rows), new) in self.staged_rows.iter().flatten().zip(&staged) {
            rows.slice_set(new, 0, 0)?;
        }
        for (kept, new) in self.histories.iter_mut().zip(histories) {
            *kept = new;
        }
        self.live[..n].iter_mut().for_each(|l| *l = true);
        self.updated = n;
        self.last_positions = (n > 0).then(|| positions.to_vec());
        Ok(())
    }

    /// Writes the inputs of the step that follows the last one: each of its n rows decodes the
    /// token `sampled[r]` (`[n]` u32 on the step's device: the ids the last step sampled, e.g.
    /// [`ModelDecodeStep::forward_sampled`]'s) at its next position, with nothing read back — the
    /// tokens and their Engram ids are written on the device (`model::engram_next`: the Engram
    /// hash there, against the histories the step keeps on the device), the position tables
    /// copied up as [`ModelDecodeStep::update`] does. The host learns the tokens later, if at
    /// all: the histories it keeps are brought up to date from the device by the next
    /// `update` or `load`. Errors, changing nothing, when the last change was not a step's update
    /// (a load, a release, or none yet: give the tokens with `update`), for a wrong count, a
    /// position reaching the capacity, a full page pool, or a model whose Engram tables are in
    /// host memory (their rows are gathered on the host from the ids).
    pub fn update_next(&mut self, sampled: &Tensor) -> Result<()> {
        let next = self.next.as_ref().map_err(|why| candle_core::Error::Msg(format!("ModelDecodeStep::update_next: not available for this model: {why}")))?;
        let Some(last) = &self.last_positions else {
            candle_core::bail!("ModelDecodeStep::update_next: no step to follow (none yet, or a sequence was loaded or released since): give the tokens with update")
        };
        let n = last.len();
        if sampled.dims() != [n] || sampled.dtype() != DType::U32 || !sampled.device().same_device(self.ids.device()) {
            candle_core::bail!("ModelDecodeStep::update_next: the last step had {n} rows: sampled must be [{n}] u32 on the step's device, got {:?} {:?}", sampled.dtype(), sampled.shape())
        }
        let positions: Vec<usize> = last.iter().map(|&p| p + 1).collect();
        if let Some((s, &p)) = positions.iter().enumerate().find(|&(_, &p)| p >= self.capacity) {
            candle_core::bail!("ModelDecodeStep::update_next: sequence {s} would step at position {p}, the step holds {} tokens per sequence", self.capacity)
        }
        for inputs in &self.inputs {
            inputs.check_first(&positions)?;
        }
        next.apply(&self.ids, sampled)?;
        for inputs in &self.inputs {
            inputs.stage_first(&positions)?;
        }
        if next.geometry().layers > 0 {
            self.stale[..n].iter_mut().for_each(|s| *s = true);
        }
        self.updated = n;
        self.last_positions = Some(positions);
        Ok(())
    }

    /// Why [`ModelDecodeStep::update_next`] is not available for this model (`None`: it is):
    /// Engram tables in host memory, whose rows are gathered on the host from the ids.
    pub fn next_unavailable(&self) -> Option<&str> {
        self.next.as_ref().err().map(String::as_str)
    }

    /// Brings the host histories of rows stepped by [`ModelDecodeStep::update_next`] up to date
    /// from the device (one read of the history region, only when some row is behind).
    fn sync_histories(&mut self) -> Result<()> {
        if !self.stale.iter().any(|&s| s) {
            return Ok(());
        }
        let Ok(next) = &self.next else { return Ok(()) };
        let (b, g) = (self.batch, self.ngram - 1);
        let hist = self.ids.narrow(0, next.geometry().history_offset(), b * g)?.to_vec1::<u32>()?;
        let last = self.last_positions.as_deref().unwrap_or(&[]);
        for (r, stale) in self.stale.iter_mut().enumerate() {
            if !*stale {
                continue;
            }
            // A stale row stepped on the device since its last host update: `last` holds it.
            let seen = last.get(r).map_or(0, |&p| p + 1);
            let row = &hist[r * g..(r + 1) * g];
            self.histories[r] = EngramHistory::resume(self.ngram, &row[g - seen.min(g)..], seen);
            *stale = false;
        }
        Ok(())
    }

    /// The logits `[B, vocab]` f32 of the tokens written by the last
    /// [`ModelDecodeStep::update`], appending their attention state to the pools (a repeated
    /// step at the same inputs gives the same logits and leaves the pools as one step does).
    pub fn forward(&self) -> Result<Tensor> {
        self.forward_rows(self.batch)
    }

    /// The step of the first `rows` rows only (a batch-size bucket): logits `[rows, vocab]` f32,
    /// the rows' state appended to the pools, the other rows untouched. `rows` must cover the
    /// rows the last update gave tokens to ([`ModelDecodeStep::update_first`]; the rows past
    /// them are idle). Errors for `rows` = 0, past the batch, or below the updated rows
    /// ([`DecodeStepError::RowsNotStepped`]).
    pub fn forward_rows(&self, rows: usize) -> Result<Tensor> {
        if rows == 0 || rows > self.batch {
            Err(DecodeStepError::BatchMismatch { what: "the rows to step", batch: self.batch, got: rows })?
        }
        if rows < self.updated {
            Err(DecodeStepError::RowsNotStepped { updated: self.updated, rows })?
        }
        #[cfg(feature = "cuda")]
        if self.ids.device().is_cuda() {
            return crate::cuda::with_device_routing(|| self.run(rows));
        }
        self.run(rows)
    }

    /// [`ModelDecodeStep::forward`] and one sampled token per sequence (`[B]` u32 on the step's
    /// device; [`sample_batch`]: on CUDA with `sampling`'s table on the device, one kernel that
    /// reads nothing back). Returns `(logits, ids)`.
    pub fn forward_sampled(&self, sampling: &SamplingBatch) -> Result<(Tensor, Tensor)> {
        self.forward_sampled_rows(self.batch, sampling)
    }

    /// [`ModelDecodeStep::forward_rows`] and one sampled token per row (`sampling` has one row
    /// per stepped row, e.g. [`SamplingBatch::leading`]). Returns `(logits, ids)`.
    pub fn forward_sampled_rows(&self, rows: usize, sampling: &SamplingBatch) -> Result<(Tensor, Tensor)> {
        let logits = self.forward_rows(rows)?;
        let ids = sample_batch(&logits, sampling)?;
        Ok((logits, ids))
    }

    /// Why the step on this device would read the device from the host (and so could not be
    /// captured into a CUDA graph): empty when it reads nothing back. Always empty on the CPU.
    pub fn host_reads(&self) -> Vec<String> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut why = Vec::new();
        #[cfg(feature = "cuda")]
        if self.ids.device().is_cuda() {
            for block in self.model.layers() {
                let moe = match block.moe() {
                    Ok(moe) => moe,
                    Err(e) => {
                        why.push(e.to_string());
                        continue;
                    }
                };
                let k = moe.gate().top_k();
                let on_device = moe
                    .grouped_experts()
                    .is_some_and(|g| crate::cuda::moe_route_supported(g.len(), k) && k <= crate::cuda::MOE_EXPERTS_MAX_K);
                if !on_device {
                    why.push(format!("layer {}: the routed experts are not MXFP4 kept as stored (the MoE routes on the host)", block.layer()));
                }
            }
        }
        why
    }

    /// The step over the first `b` rows: every batch-shaped tensor narrowed to them (views).
    fn run(&self, b: usize) -> Result<Tensor> {
        let m = self.model;
        let whole = b == self.batch;
        let narrowed;
        let (caches, inputs, rows) = if whole {
            (&self.caches, &self.inputs, &self.rows)
        } else {
            narrowed = (
                self.caches.iter().map(|c| c.leading(b)).collect::<Result<Vec<_>>>()?,
                self.inputs.iter().map(|i| i.leading(b)).collect::<Result<Vec<_>>>()?,
                RowGroups::from_lens(std::iter::repeat_n(1, b)),
            );
            (&narrowed.0, &narrowed.1, &narrowed.2)
        };
        for i in inputs {
            i.derive()?;
        }
        let lead = |t: &Tensor| if whole { Ok(t.clone()) } else { t.narrow(0, 0, b) };
        let h0 = m.embedding().forward(&lead(&self.tokens)?)?.to_dtype(m.dtype())?;
        let d = h0.dim(1)?;
        let mut x = h0.unsqueeze(1)?.broadcast_as((b, m.hc_mult(), d))?.contiguous()?;
        let mut pre = lead(&self.pre0)?;
        // The next layer's attention input when the last post computed it with its collapse and
        // norm (one launch on CUDA: `post_collapse_norm`); not across an Engram layer, which
        // mixes the stream first.
        let mut h_next: Option<Tensor> = None;
        // The mHC mixes run beside the attention and the MoE (they are needed only at the posts).
        let mut side = SideWork::new(h0.device())?;
        let mut topk: Vec<Option<Tensor>> = Vec::with_capacity(self.layers.len());
        let mut blocks: Vec<Option<Tensor>> = Vec::with_capacity(self.layers.len());
        for (l, block) in m.layers().iter().enumerate() {
            if let (Some(e), Some((_, staged))) = (block.engram(), &self.staged_rows[l]) {
                x = e.forward_rows(&x, &lead(staged)?, rows)?;
            } else if let (Some(e), Some(ids)) = (block.engram(), &self.engram_ids[l]) {
                x = e.forward_grouped(&x, &lead(ids)?, rows)?;
            }
            let a = side.run(|| block.hc_mix(HcSublayer::Attn).mixes_grouped(&x, rows))?;
            let h = match h_next.take() {
                Some(h) => h,
                None => collapse_norm(&x, &pre, block.attn_norm())?,
            };
            let layer = &self.layers[l];
            // What earlier layers of this step published: a reuse layer's top-k, a candidate
            // consumer's blocks; reindex and reuse layers read their kv source's cache.
            let published = Published {
                topk: match layer.kind() {
                    DecodeLayerKind::Reuse { index_source, .. } => topk[index_source].as_ref(),
                    _ => None,
                },
                candidates: match layer.candidates() {
                    CandidateRole::Consume { source } => blocks[source].as_ref(),
                    _ => None,
                },
            };
            let step = DecodeStep::new(layer, &caches[l], kv_cache(layer, caches), &inputs[self.input_of[l]])?.with_options(self.options);
            let out = step.forward(&h, published)?;
            topk.push(out.topk);
            blocks.push(out.candidates);
            side.join()?;
            let (x1, h2) = post_collapse_norm(&out.y, &x, &a.post, &a.comb, &a.pre, block.ffn_norm())?;
            let f = side.run(|| block.hc_mix(HcSublayer::Ffn).mixes_grouped(&x1, rows))?;
            let z = block.moe()?.forward_grouped(&h2, rows)?;
            side.join()?;
            let next_norm = match m.layers().get(l + 1) {
                Some(next) if next.engram().is_some() => None,
                Some(next) => Some(next.attn_norm()),
                None => Some(m.final_norm()),
            };
            match next_norm {
                Some(norm) => {
                    let (xn, hn) = post_collapse_norm(&z.out, &x1, &f.post, &f.comb, &f.pre, norm)?;
                    (x, h_next) = (xn, Some(hn));
                }
                None => x = post(&z.out, &x1, &f.post, &f.comb)?,
            }
            pre = f.pre;
        }
        let h = match h_next {
            Some(h) => h,
            None => collapse_norm(&x, &pre, m.final_norm())?,
        };
        m.head().forward_grouped(&h, rows)
    }
}

/// The kv source whose entries `layer` reads (its own for a source), `None` for window-only
/// layers: layers with the same key share one [`DecodeStepInputs`].
fn kv_source(layer: &DecodeLayer) -> Option<usize> {
    layer.kv_source()
}

/// The cache a reuse or reindex layer reads its kv source's entries from (`None` for window-only
/// layers and kv sources, which read their own).
fn kv_cache<'c>(layer: &DecodeLayer, caches: &'c [BatchedLayerCache]) -> Option<&'c BatchedLayerCache> {
    match layer.kind() {
        DecodeLayerKind::Reuse { .. } | DecodeLayerKind::Reindex { .. } => layer.kv_source().map(|s| &caches[s]),
        DecodeLayerKind::WindowOnly | DecodeLayerKind::Source => None,
    }
}
