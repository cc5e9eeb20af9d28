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
use super::storage::{CacheKind, CacheStorage, Packing};
use super::trace::Trace;
use super::window::WindowCache;
use crate::config::{AttentionRole, Config};

/// Rows appended over time (`[len, width]`), stored as rows in the activation dtype or packed
/// in pages ([`CacheStorage`]), in a buffer that grows by doubling (whole pages when packed).
#[derive(Debug, Clone)]
pub struct RowStore {
    /// bf16: `[capacity, width]` rows; packed: `[pages, page_bytes]` u8.
    buf: Tensor,
    len: usize,
    width: usize,
    /// The dtype of [`RowStore::rows`] (the activation dtype).
    dtype: DType,
    packing: Option<Packing>,
}

impl RowStore {
    /// An empty store of rows `width` wide in `dtype` (with room for [`RowStore::INITIAL_ROWS`]
    /// rows, so that no zero-sized device allocation is ever made).
    pub fn new(width: usize, dtype: DType, device: &Device) -> Result<Self> {
        Self::build(width, dtype, None, device)
    }

    /// An empty store of rows `width` wide for a cache of `kind` in `storage` (packed: the
    /// kind's format in pages of [`super::storage::PACKED_PAGE_TOKENS`]); [`RowStore::rows`]
    /// returns `dtype`. Errors for packed storage without the `cuda` feature or a width the
    /// format does not take.
    pub fn with_storage(width: usize, storage: CacheStorage, kind: CacheKind, dtype: DType, device: &Device) -> Result<Self> {
        Self::build(width, dtype, storage.packing(kind, width)?, device)
    }

    fn build(width: usize, dtype: DType, packing: Option<Packing>, device: &Device) -> Result<Self> {
        let buf = alloc_rows(packing.as_ref(), width, dtype, device, Self::INITIAL_ROWS)?;
        Ok(Self { buf, len: 0, width, dtype, packing })
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

    /// How the rows are stored.
    pub fn storage(&self) -> CacheStorage {
        CacheStorage::of(self.packing.as_ref())
    }

    /// The whole storage: `[capacity, width]` rows in the store's dtype (bf16 storage), or the
    /// `[pages, page_bytes]` u8 pages (packed storage; row i at slot i). Rows past
    /// [`RowStore::len`] are zeros or stale.
    pub fn buffer(&self) -> &Tensor {
        &self.buf
    }

    /// The packed geometry (`None` for rows in the activation dtype).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn packing(&self) -> Option<Packing> {
        self.packing
    }

    /// Appends `rows` `[n, width]` (bf16 storage only: packed rows are written by the fused
    /// inserts through [`RowStore::append_in_place`]).
    pub fn append(&mut self, rows: &Tensor) -> Result<()> {
        let (n, w) = rows.dims2()?;
        if w != self.width {
            candle_core::bail!("RowStore: row width {w} != store width {}", self.width)
        }
        if self.packing.is_some() {
            candle_core::bail!("RowStore::append: the store is packed; its rows are written by the packed inserts (Attention::forward_fused)")
        }
        self.reserve(n)?;
        if n > 0 {
            self.buf.slice_set(&rows.to_dtype(self.buf.dtype())?.contiguous()?, 0, self.len)?;
        }
        self.len += n;
        Ok(())
    }

    /// Keeps the first `len` rows (no-op when it holds fewer); the storage is kept, later
    /// appends overwrite the dropped rows.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// `[len, width]`: all rows in the store's dtype (packed storage: dequantized with
    /// `PackedLayout::unpack`, a host round trip; the values are exactly those stored).
    pub fn rows(&self) -> Result<Tensor> {
        match &self.packing {
            None => self.buf.narrow(0, 0, self.len),
            Some(p) => p.unpack_rows(&self.buf, 0..self.len, self.dtype),
        }
    }
}

/// What the device ops read of a [`RowStore`]: its `[len, width]` rows (bf16 storage), or all of
/// its `[pages, page_bytes]` u8 packed pages (packed storage; the index lists name slots `< len`).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone)]
pub(crate) enum StoredRows {
    Rows(Tensor),
    Packed(Tensor, Packing),
}

#[cfg(feature = "cuda")]
impl StoredRows {
    /// As a source of the sparse attention ([`crate::cuda::SparseAttentionInputs`]).
    pub(crate) fn kv_rows(&self) -> crate::cuda::KvRows<'_> {
        match self {
            Self::Rows(rows) => crate::cuda::KvRows::Bf16(rows),
            Self::Packed(pages, layout) => crate::cuda::KvRows::Packed(pages, *layout),
        }
    }

    /// As the key cache of the index scores ([`crate::cuda::index_select`]).
    pub(crate) fn index_keys(&self) -> crate::cuda::IndexKeys<'_> {
        match self {
            Self::Rows(rows) => crate::cuda::IndexKeys::Rows(rows),
            Self::Packed(pages, layout) => crate::cuda::IndexKeys::Packed { cache: pages, layout: *layout },
        }
    }
}

#[cfg(feature = "cuda")]
impl RowStore {
    /// The store as the device ops read it ([`StoredRows`]; bf16 rows are a view, no copy).
    pub(crate) fn stored_rows(&self) -> Result<StoredRows> {
        Ok(match self.packing {
            None => StoredRows::Rows(self.rows()?),
            Some(p) => StoredRows::Packed(self.buf.clone(), p),
        })
    }
}

// ---- In-place appends for the device path (issue 6) ------------------------------------------

impl RowStore {
    /// Rows per allocation unit of `buf`: 1 (rows) or the page size (packed).
    fn unit(&self) -> usize {
        self.packing.as_ref().map_or(1, |p| p.page_size())
    }

    /// Grows the buffer (by doubling; whole pages when packed) to hold `n` more rows.
    fn reserve(&mut self, n: usize) -> Result<()> {
        let cap = self.buf.dim(0)? * self.unit();
        if self.len + n > cap {
            let rows = (self.len + n).max(2 * cap).max(Self::INITIAL_ROWS);
            let grown = alloc_rows(self.packing.as_ref(), self.width, self.dtype, self.buf.device(), rows)?;
            let used = self.len.div_ceil(self.unit());
            if used > 0 {
                grown.slice_set(&self.buf.narrow(0, 0, used)?.contiguous()?, 0, 0)?;
            }
            self.buf = grown;
        }
        Ok(())
    }

    /// Appends `n` rows written in place by `write(buffer, first)`: `buffer` is the whole
    /// storage ([`RowStore::buffer`]: `[capacity, width]` rows, or `[pages, page_bytes]` u8 pages
    /// with capacity `pages · page_size` slots; capacity ≥ `len + n`) and `write` must fill rows
    /// (slots) `first .. first + n` (`first` = the current `len`), e.g. with a fused insert
    /// kernel (`cuda::compressed_insert`, `cuda::packed_insert`) at slots
    /// `first ..`. The rows count as appended only if `write` succeeds.
    pub fn append_in_place(&mut self, n: usize, write: impl FnOnce(&Tensor, usize) -> Result<()>) -> Result<()> {
        self.reserve(n)?;
        if n > 0 {
            write(&self.buf, self.len)?;
        }
        self.len += n;
        Ok(())
    }
}

/// A zeroed store buffer with room for at least `rows` rows: `[rows, width]` in `dtype`, or
/// `ceil(rows / page_size)` packed pages.
fn alloc_rows(packing: Option<&Packing>, width: usize, dtype: DType, device: &Device, rows: usize) -> Result<Tensor> {
    match packing {
        None => Tensor::zeros((rows, width), dtype, device),
        Some(p) => p.zeros(rows.div_ceil(p.page_size()), device),
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
    storage: CacheStorage,
    /// Compress ratio of each layer that is a kv source (0 for the others).
    pub(super) source_ratios: Vec<usize>,
    /// Positions a truncation may go back ([`SequenceCache::set_rollback_depth`]).
    pub(super) rollback_depth: usize,
}

impl SequenceCache {
    /// An empty cache for `cfg`, rows held in `dtype` (the activation dtype) on `device`
    /// ([`CacheStorage::Bf16`]).
    pub fn new(cfg: &Config, dtype: DType, device: &Device) -> Result<Self> {
        Self::with_storage(cfg, CacheStorage::Bf16, dtype, device)
    }

    /// An empty cache for `cfg` on `device` whose window rings, compressed entries and index
    /// keys are stored as `storage` says: rows in `dtype` (the activation dtype), or the packed
    /// formats A / B / E of spec §7.2 (see [`super::storage`]; needs the `cuda` feature, and the
    /// layers run with `Numerics::cache_fake_quant`). Rows read back from a packed cache
    /// ([`RowStore::rows`], [`WindowCache::ring_rows`]) come in `dtype`.
    pub fn with_storage(cfg: &Config, storage: CacheStorage, dtype: DType, device: &Device) -> Result<Self> {
        Self::build(cfg, storage, dtype, device, None)
    }

    /// An empty cache whose window rings are `rings` (one per layer, zeroed: the pages of a
    /// [`super::pool::CachePool`]).
    pub(crate) fn with_rings(cfg: &Config, storage: CacheStorage, dtype: DType, device: &Device, rings: Vec<Tensor>) -> Result<Self> {
        if rings.len() != cfg.layers.len() {
            candle_core::bail!("SequenceCache: {} rings for {} layers", rings.len(), cfg.layers.len())
        }
        Self::build(cfg, storage, dtype, device, Some(rings))
    }

    fn build(cfg: &Config, storage: CacheStorage, dtype: DType, device: &Device, rings: Option<Vec<Tensor>>) -> Result<Self> {
        let store = |width, kind| RowStore::with_storage(width, storage, kind, dtype, device);
        let mut rings = rings.map(|r| r.into_iter());
        let layers = cfg
            .layers
            .iter()
            .map(|role| {
                let is_source = matches!(role.attention, AttentionRole::Compressed { kv_source, .. } if kv_source == role.layer);
                let source = if is_source {
                    Some(SourceState {
                        compressed: store(cfg.head_dim, CacheKind::Compressed)?,
                        index_keys: store(cfg.index_head_dim, CacheKind::IndexKeys)?,
                        carry: CompressorCarry::default(),
                    })
                } else {
                    None
                };
                let window = match rings.as_mut().and_then(|r| r.next()) {
                    Some(ring) => WindowCache::from_ring(ring, cfg.sliding_window, storage.packing(CacheKind::Window, cfg.head_dim)?, dtype)?,
                    None => WindowCache::with_storage(cfg.sliding_window, cfg.head_dim, storage, dtype, device)?,
                };
                Ok(LayerState { window, source, next_pos: 0 })
            })
            .collect::<Result<Vec<_>>>()?;
        let source_ratios = cfg
            .layers
            .iter()
            .map(|role| match role.attention {
                AttentionRole::Compressed { ratio, kv_source, .. } if kv_source == role.layer => ratio,
                _ => 0,
            })
            .collect();
        Ok(Self {
            layers,
            topk: HashMap::new(),
            candidates: None,
            trace: None,
            storage,
            source_ratios,
            rollback_depth: 0,
        })
    }

    /// How the caches store their rows.
    pub fn storage(&self) -> CacheStorage {
        self.storage
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

    /// Forgets the top-k sets and candidate blocks published within the last call.
    pub(super) fn clear_published(&mut self) {
        self.topk.clear();
        self.candidates = None;
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
