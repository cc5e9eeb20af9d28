//! The caller-owned cache storage of one attention layer for the batched decode step
//! ([`super::decode_batch`]): every sequence of the batch owns a fixed region of the window pool,
//! and a kv source's compressed entries and index keys live in pages shared by the batch
//! ([`PageTable`]; `docs/architecture.md`, "The batched decode step", "The cache pool").
//!
//! | pool | rows | sequence b's rows |
//! |---|---|---|
//! | window rings (every layer) | `[B·W', D]` | region `b·W' .. b·W' + W`, slot `b·W' + p mod W` |
//! | compressed entries (kv sources) | `[N·P, D]`: N pages of P = [`PACKED_PAGE_TOKENS`] | entry j at `table[b][j / P]·P + j mod P` |
//! | index keys (kv sources) | `[N·P, d_I]` | the same slots |
//! | compressor carry (kv sources) | `[B, D]` f32 kv and gate score | row b: the open group's token (ratio 2; unused at ratio 1) |
//!
//! Each pool is bf16 rows or the packed format of its kind ([`PoolRows`], spec §7.2: A for the
//! window, B for the compressed entries, E for the index keys; packed needs the `cuda` feature),
//! chosen per kind ([`BatchStorage`]); a packed page of the entry pools is one table page. The
//! window stride `W'` is W, rounded up to whole pages for a packed pool. A sequence holds at most
//! `ceil(E / P)` pages (E: entries per sequence, a position whose entries exceed it is an error of
//! [`super::DecodeStepInputs::update`]); the N pages (by default `B·ceil(E / P)`, what fixed
//! regions took) are taken as entries grow and returned by [`BatchedLayerCache::release`].

use candle_core::{DType, Device, Result, Tensor};

use super::cache::SequenceCache;
use super::decode_batch::{DecodeLayer, DecodeLayerKind};
use super::decode_error::{check_tensor, DecodeStepError};
use super::page_table::PageTable;
use super::storage::{CacheKind, CacheStorage, PACKED_PAGE_TOKENS};
#[cfg(feature = "cuda")]
use crate::cuda::{IndexKeys, KvRows, PackedLayout};

/// The storage of each kind of pool of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchStorage {
    /// The window rings.
    pub window: CacheStorage,
    /// The compressed entries.
    pub compressed: CacheStorage,
    /// The index keys.
    pub index_keys: CacheStorage,
}

impl BatchStorage {
    /// bf16 rows everywhere.
    pub const BF16: Self = Self::uniform(CacheStorage::Bf16);
    /// The packed formats A / B / E everywhere.
    pub const PACKED: Self = Self::uniform(CacheStorage::Packed);
    /// Packed (MXFP4) index keys, bf16 window rows and compressed entries.
    pub const PACKED_KEYS: Self = Self { window: CacheStorage::Bf16, compressed: CacheStorage::Bf16, index_keys: CacheStorage::Packed };

    /// `storage` for every pool.
    pub const fn uniform(storage: CacheStorage) -> Self {
        Self { window: storage, compressed: storage, index_keys: storage }
    }

    /// Whether any pool is packed.
    pub fn any_packed(&self) -> bool {
        self.window.is_packed() || self.compressed.is_packed() || self.index_keys.is_packed()
    }
}

/// One pool: bf16 rows `[slots, width]`, or packed pages `[pages, page_bytes]` u8 of a layout
/// (slot s = row s).
#[derive(Debug, Clone)]
pub enum PoolRows {
    /// `[slots, width]` bf16.
    Bf16(Tensor),
    /// `[pages, layout.page_bytes()]` u8, contiguous (feature `cuda`).
    #[cfg(feature = "cuda")]
    Packed(Tensor, PackedLayout),
}

impl PoolRows {
    /// A zeroed pool of `slots` slots of `width` values of `kind` stored as `storage` (packed:
    /// pages of [`PACKED_PAGE_TOKENS`]).
    pub fn zeros(kind: CacheKind, storage: CacheStorage, slots: usize, width: usize, device: &Device) -> Result<Self> {
        Ok(match storage {
            CacheStorage::Bf16 => Self::Bf16(Tensor::zeros((slots, width), DType::BF16, device)?),
            #[cfg(feature = "cuda")]
            CacheStorage::Packed => {
                let layout = PackedLayout::new(kind.packed_format(), width, PACKED_PAGE_TOKENS)?;
                Self::Packed(layout.zeros(slots.div_ceil(layout.page_size()), device)?, layout)
            }
            #[cfg(not(feature = "cuda"))]
            CacheStorage::Packed => match storage.packing(kind, width)? {
                None => Self::Bf16(Tensor::zeros((slots, width), DType::BF16, device)?),
                Some(p) => match p {},
            },
        })
    }

    /// The pool's tensor (rows or pages).
    pub fn tensor(&self) -> &Tensor {
        match self {
            Self::Bf16(t) => t,
            #[cfg(feature = "cuda")]
            Self::Packed(t, _) => t,
        }
    }

    /// How the pool stores its rows.
    pub fn storage(&self) -> CacheStorage {
        match self {
            Self::Bf16(_) => CacheStorage::Bf16,
            #[cfg(feature = "cuda")]
            Self::Packed(..) => CacheStorage::Packed,
        }
    }

    /// Slots the pool holds (packed: pages × slots a page).
    pub fn slots(&self) -> Result<usize> {
        Ok(match self {
            Self::Bf16(t) => t.dim(0)?,
            #[cfg(feature = "cuda")]
            Self::Packed(t, l) => t.dim(0)? * l.page_size(),
        })
    }

    /// Slots a page holds when packed (`None`: bf16 rows).
    fn page_slots(&self) -> Option<usize> {
        match self {
            Self::Bf16(_) => None,
            #[cfg(feature = "cuda")]
            Self::Packed(_, l) => Some(l.page_size()),
        }
    }

    /// The stride of regions of `capacity` slots: the capacity, rounded up to whole pages when
    /// packed.
    pub fn region_stride(&self, capacity: usize) -> usize {
        match self {
            Self::Bf16(_) => capacity,
            #[cfg(feature = "cuda")]
            Self::Packed(_, l) => capacity.div_ceil(l.page_size()) * l.page_size(),
        }
    }

    /// As a source of the sparse attention.
    #[cfg(feature = "cuda")]
    pub(crate) fn kv_rows(&self) -> KvRows<'_> {
        match self {
            Self::Bf16(t) => KvRows::Bf16(t),
            Self::Packed(t, l) => KvRows::Packed(t, *l),
        }
    }

    /// As the key cache of the index scores.
    #[cfg(feature = "cuda")]
    pub(crate) fn index_keys(&self) -> IndexKeys<'_> {
        match self {
            Self::Bf16(t) => IndexKeys::Rows(t),
            Self::Packed(t, l) => IndexKeys::Packed { cache: t, layout: *l },
        }
    }

    /// Checks that the pool holds `slots` slots of `width` values of `kind` (`what` names it).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn check(&self, what: &'static str, kind: CacheKind, slots: usize, width: usize) -> std::result::Result<(), DecodeStepError> {
        match self {
            Self::Bf16(t) => check_tensor(what, t, DType::BF16, &[slots, width]),
            #[cfg(feature = "cuda")]
            Self::Packed(t, l) => {
                let expected = format!(
                    "{} pages of {} B ({:?} rows of {width}, {} slots a page) u8, contiguous",
                    slots / l.page_size(),
                    l.page_bytes(),
                    kind.packed_format(),
                    l.page_size()
                );
                let ok = l.format() == kind.packed_format()
                    && l.head_dim() == width
                    && t.dtype() == DType::U8
                    && t.dims() == [slots / l.page_size(), l.page_bytes()]
                    && t.is_contiguous();
                if ok {
                    Ok(())
                } else {
                    Err(DecodeStepError::Tensor { what, expected, got: format!("{:?} {:?} for {l:?}", t.dtype(), t.dims()) })
                }
            }
        }
    }

    /// Writes `rows` (`[n, width]`, values the pool's format holds exactly) at slots
    /// `first .. first + n`; `first` is a region start (a page start when packed).
    fn write(&self, rows: &Tensor, first: usize) -> Result<()> {
        match self {
            Self::Bf16(t) => t.slice_set(&rows.to_dtype(DType::BF16)?.to_device(t.device())?.contiguous()?, 0, first),
            #[cfg(feature = "cuda")]
            Self::Packed(t, l) => {
                if rows.dim(0)? == 0 {
                    return Ok(());
                }
                t.slice_set(&l.pack(rows)?.to_device(t.device())?, 0, first / l.page_size())
            }
        }
    }
}

/// The region stride of `capacity` slots in a pool of `storage` made by [`PoolRows::zeros`].
fn region_stride(storage: CacheStorage, capacity: usize) -> usize {
    match storage {
        CacheStorage::Bf16 => capacity,
        CacheStorage::Packed => capacity.div_ceil(PACKED_PAGE_TOKENS) * PACKED_PAGE_TOKENS,
    }
}

/// The pools of a kv source: compressed entries, index keys and the compressor carry.
#[derive(Debug, Clone)]
pub struct BatchedSource {
    /// Entries per sequence (the capacity E).
    pub entries: usize,
    /// `[N·P, head_dim]` compressed entries: N pages of [`PACKED_PAGE_TOKENS`] slots.
    pub compressed: PoolRows,
    /// `[N·P, index_head_dim]` index keys, the same slots.
    pub index_keys: PoolRows,
    /// `[B, head_dim]` f32: each sequence's carried `compressor.wkv` projection (the open
    /// group's first token).
    pub carry_kv: Tensor,
    /// `[B, head_dim]` f32: its `compressor.wgate` score.
    pub carry_score: Tensor,
}

/// The batched cache storage of one attention layer (see the module docs). Cloning gives
/// another handle to the same tensors.
#[derive(Debug, Clone)]
pub struct BatchedLayerCache {
    layer: usize,
    batch: usize,
    /// The layer's compress ratio (0: window-only).
    ratio: usize,
    window_stride: usize,
    rows: PoolRows,
    source: Option<BatchedSource>,
    /// The kv source's page table (shared by clones).
    pages: Option<PageTable>,
}

impl BatchedLayerCache {
    /// Zeroed pools for `batch` sequences of `layer`: a window pool for every layer, and for a
    /// kv source up to `entries` compressed entries and index keys per sequence in
    /// `batch·ceil(entries / P)` pages (every sequence can hold `entries`) and the carry; stored
    /// as `storage` says. `entries` is ignored by other layers.
    pub fn zeros(layer: &DecodeLayer, batch: usize, entries: usize, storage: BatchStorage, device: &Device) -> Result<Self> {
        Self::zeros_paged(layer, batch, entries, batch * entries.div_ceil(PACKED_PAGE_TOKENS), storage, device)
    }

    /// [`BatchedLayerCache::zeros`] with a kv source's entry pools of `pages` pages of
    /// [`PACKED_PAGE_TOKENS`] entries shared by the batch (fewer than `batch·ceil(entries / P)`:
    /// the sequences cannot all hold `entries` at once, a step that needs more pages than are
    /// free is [`DecodeStepError::PoolFull`]).
    pub fn zeros_paged(layer: &DecodeLayer, batch: usize, entries: usize, pages: usize, storage: BatchStorage, device: &Device) -> Result<Self> {
        if batch == 0 {
            Err(DecodeStepError::EmptyBatch)?
        }
        let (w, hd) = (layer.window(), layer.head_dim());
        let rows = PoolRows::zeros(CacheKind::Window, storage.window, batch * region_stride(storage.window, w), hd, device)?;
        let source = match layer.kind() {
            DecodeLayerKind::Source => {
                if entries == 0 || pages == 0 {
                    Err(DecodeStepError::Mismatch {
                        layer: layer.layer(),
                        why: format!("a kv source needs at least 1 compressed entry per sequence and 1 page, got {entries} and {pages}"),
                    })?
                }
                let slots = pages * PACKED_PAGE_TOKENS;
                Some(BatchedSource {
                    entries,
                    compressed: PoolRows::zeros(CacheKind::Compressed, storage.compressed, slots, hd, device)?,
                    index_keys: PoolRows::zeros(CacheKind::IndexKeys, storage.index_keys, slots, layer.index_head_dim(), device)?,
                    carry_kv: Tensor::zeros((batch, hd), DType::F32, device)?,
                    carry_score: Tensor::zeros((batch, hd), DType::F32, device)?,
                })
            }
            _ => None,
        };
        Ok(Self::from_parts(layer, batch, rows, source)?)
    }

    /// A cache over caller-made pools (e.g. pools shared by two caches that differ in one kind's
    /// storage): `window` holds `batch` regions of the layer's window (stride
    /// [`PoolRows::region_stride`]), `source` (kv sources only) two entry pools of the same
    /// whole number of pages of [`PACKED_PAGE_TOKENS`] slots (packed pools: pages of that size)
    /// and `[batch, head_dim]` f32 carries. The cache gets a new, empty page table over them.
    pub fn from_parts(
        layer: &DecodeLayer,
        batch: usize,
        window: PoolRows,
        source: Option<BatchedSource>,
    ) -> std::result::Result<Self, DecodeStepError> {
        let l = layer.layer();
        if batch == 0 {
            return Err(DecodeStepError::EmptyBatch);
        }
        let (w, hd) = (layer.window(), layer.head_dim());
        let window_stride = window.region_stride(w);
        window.check("the window pool", CacheKind::Window, batch * window_stride, hd)?;
        let is_source = layer.kind() == DecodeLayerKind::Source;
        let mismatch = |why: String| DecodeStepError::Mismatch { layer: l, why };
        let pages = match (&source, is_source) {
            (Some(s), true) => {
                let slots = |p: &PoolRows| p.slots().map_err(|e| mismatch(format!("an entry pool's shape: {e}")));
                let (n_c, n_k) = (slots(&s.compressed)?, slots(&s.index_keys)?);
                let paged = |n: usize, p: &PoolRows| {
                    n > 0 && n.is_multiple_of(PACKED_PAGE_TOKENS) && p.page_slots().is_none_or(|ps| ps == PACKED_PAGE_TOKENS)
                };
                if n_c != n_k || !paged(n_c, &s.compressed) || !paged(n_k, &s.index_keys) {
                    return Err(mismatch(format!(
                        "the compressed-entry and index-key pools must hold the same whole number of pages of {PACKED_PAGE_TOKENS} slots, \
                         got {n_c} and {n_k} slots"
                    )));
                }
                s.compressed.check("the compressed-entry pool", CacheKind::Compressed, n_c, hd)?;
                s.index_keys.check("the index-key pool", CacheKind::IndexKeys, n_k, layer.index_head_dim())?;
                check_tensor("the carried kv", &s.carry_kv, DType::F32, &[batch, hd])?;
                check_tensor("the carried score", &s.carry_score, DType::F32, &[batch, hd])?;
                Some(PageTable::new(l, batch, s.entries, n_c / PACKED_PAGE_TOKENS)?)
            }
            (None, false) => None,
            (Some(_), false) => return Err(mismatch("compressed pools given for a layer that is not a kv source".into())),
            (None, true) => return Err(mismatch("a kv source needs its compressed pools".into())),
        };
        Ok(Self { layer: l, batch, ratio: layer.ratio(), window_stride, rows: window, source, pages })
    }

    /// The caches of the first `rows` sequences, for a step over those rows (a batch-size
    /// bucket, with [`super::DecodeStepInputs::leading`]): the same pools and page table, the
    /// carries narrowed to their first `rows` rows (views: writes show through). Errors for 0
    /// rows or more than the batch.
    pub fn leading(&self, rows: usize) -> Result<Self> {
        if rows == 0 || rows > self.batch {
            Err(DecodeStepError::BatchMismatch { what: "the leading rows", batch: self.batch, got: rows })?
        }
        let source = match &self.source {
            Some(s) => Some(BatchedSource { carry_kv: s.carry_kv.narrow(0, 0, rows)?, carry_score: s.carry_score.narrow(0, 0, rows)?, ..s.clone() }),
            None => None,
        };
        Ok(Self { batch: rows, source, ..self.clone() })
    }

    /// The layer these pools belong to.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// Sequences (regions) of every pool.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The window pool.
    pub fn window_rows(&self) -> &PoolRows {
        &self.rows
    }

    /// Slots between two sequences' window regions (W, or W rounded up to a page).
    pub fn window_stride(&self) -> usize {
        self.window_stride
    }

    /// The kv source's pools (`None` for other layers).
    pub fn source(&self) -> Option<&BatchedSource> {
        self.source.as_ref()
    }

    /// The kv source's page table of its entry pools (`None` for other layers).
    pub fn pages(&self) -> Option<&PageTable> {
        self.pages.as_ref()
    }

    /// Returns the pages sequence `seq` holds in this layer's entry pools (nothing for layers
    /// that are not kv sources); its window region stays. The row can then take another sequence
    /// ([`BatchedLayerCache::load_sequence`]). Errors for a sequence outside the batch.
    pub fn release(&self, seq: usize) -> Result<()> {
        if seq >= self.batch {
            Err(DecodeStepError::BatchMismatch { what: "the sequence index", batch: self.batch, got: seq + 1 })?
        }
        if let Some(p) = &self.pages {
            p.release(seq)?;
        }
        Ok(())
    }

    /// `Err` unless [`BatchedLayerCache::load_sequence`] of `cache` into `seq` would find its
    /// pages (and fit a sequence's entries); changes nothing.
    pub fn check_load(&self, seq: usize, cache: &SequenceCache) -> Result<()> {
        if seq >= self.batch {
            Err(DecodeStepError::BatchMismatch { what: "the sequence index", batch: self.batch, got: seq + 1 })?
        }
        let (Some(src), Some(pages)) = (&self.source, &self.pages) else { return Ok(()) };
        let n = cache.source(self.layer)?.compressed.len();
        if n > src.entries {
            let pos = cache.layer(self.layer)?.next_pos;
            Err(DecodeStepError::BeyondCapacity { seq, position: pos, needed: n, entries: src.entries, limit: src.entries * self.ratio })?
        }
        Ok(pages.check_resize(seq, n)?)
    }

    /// Device bytes of the pools.
    pub fn bytes(&self) -> usize {
        let b = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        b(self.rows.tensor())
            + self.source.as_ref().map_or(0, |s| b(s.compressed.tensor()) + b(s.index_keys.tensor()) + b(&s.carry_kv) + b(&s.carry_score))
    }

    /// Copies this layer's state of one sequence (`cache`, which holds `cache.layer(l).next_pos`
    /// tokens) into row `seq`: its window ring, and for a kv source its compressed entries and
    /// index keys (into the pages the row keeps or takes: `ceil(n / P)` for n entries, surplus
    /// pages returned) and open group. The sequence's next decode step then runs in the batch at
    /// position `next_pos`. Rows are copied as they are stored (packed rows unpacked, bf16 rows
    /// packed exactly: both hold the cache-quantized values; with `Numerics::cache_fake_quant`
    /// off only bf16 pools take a sequence). Errors, changing nothing, when `seq` is outside the
    /// batch, the sequence holds more entries than a sequence can, or the page pool is full
    /// ([`DecodeStepError::PoolFull`]).
    pub fn load_sequence(&self, seq: usize, cache: &SequenceCache) -> Result<()> {
        let l = self.layer;
        self.check_load(seq, cache)?;
        let state = cache.layer(l)?;
        let ring = state.window.ring_rows()?;
        let (Some(src), Some(pages)) = (&self.source, &self.pages) else {
            return self.rows.write(&ring, seq * self.window_stride);
        };
        let own = cache.source(l)?;
        let n = own.compressed.len();
        let (entries, keys) = (own.compressed.rows()?, own.index_keys.rows()?);
        pages.resize(seq, n)?;
        self.rows.write(&ring, seq * self.window_stride)?;
        for (i, page) in pages.pages_of(seq).into_iter().enumerate() {
            let (first, len) = (i * PACKED_PAGE_TOKENS, PACKED_PAGE_TOKENS.min(n - i * PACKED_PAGE_TOKENS));
            src.compressed.write(&entries.narrow(0, first, len)?, page * PACKED_PAGE_TOKENS)?;
            src.index_keys.write(&keys.narrow(0, first, len)?, page * PACKED_PAGE_TOKENS)?;
        }
        let dev = src.carry_kv.device();
        let hd = src.carry_kv.dim(1)?;
        // Ratio 2: an open group is one carried token (odd next position); ratio 1 carries nothing
        // (every token closes its group, the carry rows stay zero and unread).
        let (kv, score) = if state.next_pos % self.ratio == 1 {
            let (kv, score) = own.carry.slots(self.ratio, hd, state.next_pos, state.window.ring().device())?;
            (kv.narrow(0, 0, 1)?.to_device(dev)?, score.narrow(0, 0, 1)?.to_device(dev)?)
        } else {
            (Tensor::zeros((1, hd), DType::F32, dev)?, Tensor::zeros((1, hd), DType::F32, dev)?)
        };
        src.carry_kv.slice_set(&kv.contiguous()?, 0, seq)?;
        src.carry_score.slice_set(&score.contiguous()?, 0, seq)?;
        Ok(())
    }
}
