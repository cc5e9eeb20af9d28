//! The caller-owned cache of one sequence (spec §4.9, §3.4).
//!
//! Per layer it holds the sliding-window ring; per kv source the compressed entries, the index
//! keys and the compressor carry. It also carries what layers hand to later layers within one
//! forward call: the top-k sets of index sources and the candidate blocks of the candidate
//! source. Nothing is global: several sequences are several `SequenceCache`s, so a batched
//! forward can take a slice of them later without changing this type.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};

use super::compressor::CompressorCarry;
use super::indexer::Candidates;
use super::trace::Trace;
use super::window::WindowCache;
use crate::config::{AttentionRole, Config};

/// Rows appended over time (`[len, width]`), stored in a buffer that grows by doubling.
#[derive(Debug, Clone)]
pub struct RowStore {
    buf: Tensor,
    len: usize,
}

impl RowStore {
    /// An empty store of rows `width` wide (with room for [`RowStore::INITIAL_ROWS`] rows, so
    /// that no zero-sized device allocation is ever made).
    pub fn new(width: usize, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self { buf: Tensor::zeros((Self::INITIAL_ROWS, width), dtype, device)?, len: 0 })
    }

    /// Rows allocated by [`RowStore::new`].
    pub const INITIAL_ROWS: usize = 16;

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no row was appended.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `rows` `[n, width]`.
    pub fn append(&mut self, rows: &Tensor) -> Result<()> {
        let (n, w) = rows.dims2()?;
        let (cap, width) = self.buf.dims2()?;
        if w != width {
            candle_core::bail!("RowStore: row width {w} != store width {width}")
        }
        if self.len + n > cap {
            let new_cap = (self.len + n).max(2 * cap).max(16);
            let grown = Tensor::zeros((new_cap, width), self.buf.dtype(), self.buf.device())?;
            if self.len > 0 {
                grown.slice_set(&self.buf.narrow(0, 0, self.len)?.contiguous()?, 0, 0)?;
            }
            self.buf = grown;
        }
        if n > 0 {
            self.buf.slice_set(&rows.to_dtype(self.buf.dtype())?.contiguous()?, 0, self.len)?;
        }
        self.len += n;
        Ok(())
    }

    /// `[len, width]`: all rows.
    pub fn rows(&self) -> Result<Tensor> {
        self.buf.narrow(0, 0, self.len)
    }
}

// ---- In-place appends for the device path (issue 6, layer helper) ----------------------------

impl RowStore {
    /// Grows the buffer (by doubling) to hold `n` more rows.
    fn reserve(&mut self, n: usize) -> Result<()> {
        let (cap, width) = self.buf.dims2()?;
        if self.len + n > cap {
            let new_cap = (self.len + n).max(2 * cap).max(Self::INITIAL_ROWS);
            let grown = Tensor::zeros((new_cap, width), self.buf.dtype(), self.buf.device())?;
            if self.len > 0 {
                grown.slice_set(&self.buf.narrow(0, 0, self.len)?.contiguous()?, 0, 0)?;
            }
            self.buf = grown;
        }
        Ok(())
    }

    /// Appends `n` rows written in place by `write(buffer, first)`: `buffer` is the whole
    /// `[capacity, width]` storage (capacity ≥ `len + n`) and `write` must fill rows
    /// `first .. first + n` (`first` = the current `len`), e.g. with a fused insert kernel
    /// ([`crate::cuda::compressed_insert`]) at slots `first ..`. The rows count as appended only
    /// if `write` succeeds.
    pub fn append_in_place(&mut self, n: usize, write: impl FnOnce(&Tensor, usize) -> Result<()>) -> Result<()> {
        self.reserve(n)?;
        if n > 0 {
            write(&self.buf, self.len)?;
        }
        self.len += n;
        Ok(())
    }
}

/// Long-range state owned by a kv source.
#[derive(Debug, Clone)]
pub struct SourceState {
    /// Compressed entries `[N, head_dim]` (RoPE'd at j·r, FP4-fake-quantized in reference numerics).
    pub compressed: RowStore,
    /// Index keys `[N, index_head_dim]` (RoPE'd at j·r, FP4-fake-quantized).
    pub index_keys: RowStore,
    /// The compressor's open group (ratio > 1).
    pub carry: CompressorCarry,
}

/// State of one layer.
#[derive(Debug, Clone)]
pub struct LayerState {
    /// The layer's sliding-window ring.
    pub window: WindowCache,
    /// `Some` on kv sources.
    pub source: Option<SourceState>,
    /// The position the next call of this layer must start at.
    pub next_pos: usize,
}

/// The top-k of an index source for the tokens of the current call.
#[derive(Debug, Clone)]
pub struct PublishedTopk {
    /// Start position of the call the top-k belongs to.
    pub start: usize,
    /// `[T, index_topk]` i64 on the activations' device: entry ids ascending, −1 padded.
    pub topk: Tensor,
}

/// Caller-owned cache of one sequence for every layer of the model.
#[derive(Debug, Clone)]
pub struct SequenceCache {
    layers: Vec<LayerState>,
    topk: HashMap<usize, PublishedTopk>,
    candidates: Option<(usize, Candidates)>,
    trace: Option<Trace>,
}

impl SequenceCache {
    /// An empty cache for `cfg`, rows held in `dtype` (the activation dtype) on `device`.
    pub fn new(cfg: &Config, dtype: DType, device: &Device) -> Result<Self> {
        let layers = cfg
            .layers
            .iter()
            .map(|role| {
                let is_source = matches!(role.attention, AttentionRole::Compressed { kv_source, .. } if kv_source == role.layer);
                let source = if is_source {
                    Some(SourceState {
                        compressed: RowStore::new(cfg.head_dim, dtype, device)?,
                        index_keys: RowStore::new(cfg.index_head_dim, dtype, device)?,
                        carry: CompressorCarry::default(),
                    })
                } else {
                    None
                };
                Ok(LayerState { window: WindowCache::new(cfg.sliding_window, cfg.head_dim, dtype, device)?, source, next_pos: 0 })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers, topk: HashMap::new(), candidates: None, trace: None })
    }

    /// Number of tokens layer 0 has processed (the sequence length so far).
    pub fn seq_len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.next_pos)
    }

    /// State of `layer`.
    pub fn layer(&self, layer: usize) -> Result<&LayerState> {
        self.layers.get(layer).ok_or_else(|| candle_core::Error::Msg(format!("cache has no layer {layer}")))
    }

    pub(crate) fn layer_mut(&mut self, layer: usize) -> Result<&mut LayerState> {
        self.layers.get_mut(layer).ok_or_else(|| candle_core::Error::Msg(format!("cache has no layer {layer}")))
    }

    /// The kv-source state of `layer` (error if `layer` is not a kv source).
    pub fn source(&self, layer: usize) -> Result<&SourceState> {
        self.layer(layer)?
            .source
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg(format!("layer {layer} is not a kv source")))
    }

    pub(crate) fn source_mut(&mut self, layer: usize) -> Result<&mut SourceState> {
        self.layer_mut(layer)?
            .source
            .as_mut()
            .ok_or_else(|| candle_core::Error::Msg(format!("layer {layer} is not a kv source")))
    }

    /// Publishes the top-k `[T, index_topk]` i64 (device tensor) of index source `layer` for the
    /// call starting at `start`.
    pub(crate) fn publish_topk(&mut self, layer: usize, start: usize, topk: Tensor) {
        self.topk.insert(layer, PublishedTopk { start, topk });
    }

    /// The top-k `[T, index_topk]` i64 (on the activations' device) that index source `layer`
    /// published for the call starting at `start` with `tokens` tokens.
    pub fn published_topk(&self, layer: usize, start: usize, tokens: usize) -> Result<&Tensor> {
        match self.topk.get(&layer) {
            Some(p) if p.start == start && p.topk.dims().first() == Some(&tokens) => Ok(&p.topk),
            _ => candle_core::bail!(
                "no top-k published by index source {layer} for the call at position {start} ({tokens} tokens): run the layers in order"
            ),
        }
    }

    /// Publishes the candidate blocks (kept blocks `[T, n_keep]` i64 on the activations'
    /// device) of the candidate source for the call starting at `start`.
    pub(crate) fn publish_candidates(&mut self, start: usize, c: Candidates) {
        self.candidates = Some((start, c));
    }

    /// The candidate blocks published for the call starting at `start` (kept blocks
    /// `[T, n_keep]` i64, −1 padded, on the activations' device).
    pub fn published_candidates(&self, start: usize) -> Option<&Candidates> {
        self.candidates.as_ref().filter(|(s, _)| *s == start).map(|(_, c)| c)
    }

    /// Installs (or removes) a recorder of intermediate tensors.
    pub fn set_trace(&mut self, trace: Option<Trace>) {
        self.trace = trace;
    }

    /// The recorder, if installed.
    pub fn trace(&self) -> Option<&Trace> {
        self.trace.as_ref()
    }

    /// Whether a recorder is installed (callers skip building trace-only tensors otherwise).
    pub fn is_tracing(&self) -> bool {
        self.trace.is_some()
    }

    /// Records `t` under `name` when a recorder is installed.
    pub fn record(&mut self, name: impl FnOnce() -> String, t: &Tensor) {
        if let Some(tr) = self.trace.as_mut() {
            tr.push(name(), t);
        }
    }
}
