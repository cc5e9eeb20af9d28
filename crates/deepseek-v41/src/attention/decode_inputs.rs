//! The per-step inputs of the batched decode step ([`super::decode_batch`]): everything that
//! depends on the sequences' positions, as device tensors of fixed shapes (`[B]`, `[B, ..]`)
//! that [`DecodeStepInputs::update`] rewrites in place from the host positions, with one
//! host→device copy. The step's kernels read only these tensors and the caches, so their launch
//! shapes and arguments never change between steps: a step captured into a CUDA graph replays
//! correctly after each `update` (`docs/architecture.md`, "The batched decode step").
//!
//! | tensor | shape | value for sequence b at position p |
//! |---|---|---|
//! | positions | `[B]` i64 | p |
//! | window slots | `[B]` i64 | `b·W' + p mod W` |
//! | window indices | `[B, W]` i64 | the ring slots of positions `p − W + 1 ..= p` ascending, −1 for those below 0 (spec §4.6) |
//! | cos, sin, −sin | `[B, R/2]` f32 | the layer's RoPE rows at p (spec §2.2) |
//! | entry slots | `[B]` i64 | the pool slot of entry `p div r` (`table[b][j / P]·P + j mod P`) when p closes a group (`(p + 1) mod r = 0`), else −1 (no insert) |
//! | entry cos, sin | `[B, R/2]` f32 | RoPE rows at `(p div r)·r`, the closing entry's position |
//! | closing | `[B, 1]` u8 | 1 when p closes a group |
//! | visible | `[B]` u32 | `(p + 1) div r`, the entries p sees (spec §6.3) |
//! | page table | `[B, max_pages]` i64 | the kv source's [`PageTable`]: sequence b's pages, −1 past those it holds |
//!
//! The host computes the integer rows and takes the pages the new entries need from the kv
//! source's page table ([`PageTable::grow`]); one upload carries the `[5, B]` i64 rows and, at
//! the first update or when more than a quarter of the sequences' pages changed, the whole
//! `[B, max_pages]` page table — otherwise each changed table row is one small copy (a sequence
//! takes a page every 64·r steps); the device derives the rest (RoPE rows from
//! [`RopeTable::rows_at`], the same f32 arithmetic as the one-sequence path).

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor};

use super::batch_cache::BatchedLayerCache;
use super::decode_batch::DecodeLayer;
use super::decode_error::DecodeStepError;
use super::page_table::PageTable;
use crate::host_upload::HostUpload;
use crate::nn::RopeTable;

/// Rows of the uploaded `[ROWS, B]` i64 table (followed by the `[B, max_pages]` page table).
const ROW_POSITION: usize = 0;
const ROW_WINDOW_SLOT: usize = 1;
const ROW_ENTRY_SLOT: usize = 2;
const ROW_ENTRY_POSITION: usize = 3;
const ROW_VISIBLE: usize = 4;
const ROWS: usize = 5;
/// The largest position [`DecodeStepInputs::update`] takes (the kernels' 32-bit counts).
pub const MAX_POSITION: usize = i32::MAX as usize;

/// The inputs of layers that read compressed entries (kv sources and their reuse layers).
#[derive(Debug, Clone)]
pub struct CompressedInputs {
    /// Compress ratio r.
    pub ratio: usize,
    /// Entries per sequence (the kv source's capacity E).
    pub entries: usize,
    /// The kv source's page table (host side, shared with its cache).
    pub pages: PageTable,
    /// `[B, max_pages]` i64: its device copy, kept equal to the table by each update.
    pub page_table: Tensor,
    /// `[B]` i64 view: the closing entry's pool slot, −1 for sequences that close no group.
    pub entry_slots: Tensor,
    /// `[B, R/2]` f32: RoPE rows at the closing entry's position.
    pub entry_cos: Tensor,
    /// `[B, R/2]` f32.
    pub entry_sin: Tensor,
    /// `[B, 1]` u8: 1 for sequences closing a group this step.
    pub closing: Tensor,
    /// `[B]` u32: entries visible to each sequence's query.
    pub visible: Tensor,
    /// The page table's row versions ([`PageTable::row_versions`]) last written to `page_table`
    /// (shared by clones, which share the tensor); `None` before the first write.
    uploaded: Arc<Mutex<Option<Vec<u64>>>>,
}

/// Above this share of changed sequences an update rewrites the whole device page table in its
/// one upload; below it only the changed rows, one small copy each.
const WHOLE_TABLE_SHARE: usize = 4;

/// The position-dependent inputs of a batched decode step for one RoPE frequency set and cache
/// geometry: one object serves every layer of the same kind and geometry (a kv source and its
/// reuse layers share one; window-only layers another). See the module docs for the tensors.
#[derive(Debug, Clone)]
pub struct DecodeStepInputs {
    batch: usize,
    window: usize,
    window_stride: usize,
    rope: RopeTable,
    /// `[ROWS·B + B·max_pages]` i64: the rows (rewritten by each update), then the page table.
    upload: Tensor,
    /// Writes `upload` (page-locked, one asynchronous copy on CUDA).
    writer: HostUpload,
    /// `[ROWS, B]` i64 view of `upload`.
    table: Tensor,
    /// `[B]` i64 views of `table`.
    positions: Tensor,
    window_slots: Tensor,
    /// `[B, W]` i64.
    window_indices: Tensor,
    /// `[B, R/2]` f32.
    cos: Tensor,
    sin: Tensor,
    neg_sin: Tensor,
    /// `[B, 0]` i64: no compressed index (window-only layers).
    no_extra: Tensor,
    /// Constants of the window indices: `[1, W]` i64 `1..=W`, `[1, 1]` i64 W, `[B, 1]` i64 `b·W'`,
    /// `[B, W]` i64 −1.
    window_offsets: Tensor,
    window_len: Tensor,
    window_base: Tensor,
    window_none: Tensor,
    compressed: Option<CompressedInputs>,
    /// A view of the first rows of other inputs ([`DecodeStepInputs::leading`]): stepped, never
    /// updated.
    view: bool,
}

impl DecodeStepInputs {
    /// Inputs for `layer`'s step over `own` (the layer's cache: its window geometry and batch)
    /// and, for a reuse layer, `kv_source` (the cache of its kv source: the entries' geometry;
    /// `None` for other layers). All positions start at 0 (taking no page: no entry slot) until
    /// the first [`DecodeStepInputs::update`].
    pub fn new(layer: &DecodeLayer, own: &BatchedLayerCache, kv_source: Option<&BatchedLayerCache>) -> Result<Self> {
        let (b, w, ws) = (own.batch(), layer.window(), own.window_stride());
        let dev = own.window_rows().tensor().device().clone();
        let kv = layer.kv_cache(own, kv_source)?;
        let half = layer.rope().rope_dim() / 2;
        let mut page_rows = 0;
        let mut pages = None;
        if let Some(kv) = kv {
            let p = kv.pages().ok_or_else(|| DecodeStepError::Mismatch {
                layer: layer.layer(),
                why: format!("layer {} is not a kv source (no compressed pools)", kv.layer()),
            })?;
            page_rows = p.max_pages();
            pages = Some(p.clone());
        }
        let upload = Tensor::zeros(ROWS * b + b * page_rows, DType::I64, &dev)?;
        let table = upload.narrow(0, 0, ROWS * b)?.reshape((ROWS, b))?;
        let row = |r: usize| table.get(r);
        let compressed = match (kv, pages) {
            (Some(kv), Some(pages)) => {
                let src = kv.source().ok_or_else(|| DecodeStepError::Mismatch {
                    layer: layer.layer(),
                    why: format!("layer {} is not a kv source (no compressed pools)", kv.layer()),
                })?;
                Some(CompressedInputs {
                    ratio: layer.ratio(),
                    entries: src.entries,
                    page_table: upload.narrow(0, ROWS * b, b * page_rows)?.reshape((b, page_rows))?,
                    pages,
                    entry_slots: row(ROW_ENTRY_SLOT)?,
                    entry_cos: Tensor::zeros((b, half), DType::F32, &dev)?,
                    entry_sin: Tensor::zeros((b, half), DType::F32, &dev)?,
                    closing: Tensor::zeros((b, 1), DType::U8, &dev)?,
                    visible: Tensor::zeros(b, DType::U32, &dev)?,
                    uploaded: Arc::default(),
                })
            }
            _ => None,
        };
        let inputs = Self {
            batch: b,
            window: w,
            window_stride: ws,
            rope: layer.rope().clone(),
            positions: row(ROW_POSITION)?,
            window_slots: row(ROW_WINDOW_SLOT)?,
            window_indices: Tensor::zeros((b, w), DType::I64, &dev)?,
            cos: Tensor::zeros((b, half), DType::F32, &dev)?,
            sin: Tensor::zeros((b, half), DType::F32, &dev)?,
            neg_sin: Tensor::zeros((b, half), DType::F32, &dev)?,
            no_extra: Tensor::zeros((b, 0), DType::I64, &dev)?,
            window_offsets: Tensor::arange(1i64, w as i64 + 1, &dev)?.reshape((1, w))?,
            window_len: Tensor::full(w as i64, (1, 1), &dev)?,
            window_base: Tensor::from_vec((0..b).map(|i| (i * ws) as i64).collect::<Vec<_>>(), (b, 1), &dev)?,
            window_none: Tensor::full(-1i64, (b, w), &dev)?,
            upload,
            writer: HostUpload::default(),
            table,
            compressed,
            view: false,
        };
        inputs.write(&vec![0; b], false)?;
        inputs.derive()?;
        Ok(inputs)
    }

    /// Writes the inputs of the sequences at `positions` (one per sequence, in batch order) into
    /// the existing tensors: the pages the sequences' new entries need are taken from the kv
    /// source's page table, then one host→device copy of the integer rows and the page table,
    /// then device ops (RoPE rows, window indices, counts) written in place (on CUDA with Candle's
    /// upload cache on, so that their shape descriptors are uploaded at the first update only).
    /// Errors, changing nothing, for a wrong number of positions, a position whose compressed
    /// entries exceed a sequence's capacity, or a full page pool ([`DecodeStepError::PoolFull`]).
    ///
    /// Call it outside a graph capture, and not while Candle's host-upload cache
    /// (`CudaDevice::enable_cuda_graph_htod_cache`) is on: that cache keeps every distinct
    /// upload.
    pub fn update(&self, positions: &[usize]) -> Result<()> {
        self.check_count(positions, true)?;
        self.update_first(positions)
    }

    /// [`DecodeStepInputs::update`] of the first n = `positions.len()` ≤ B sequences; rows
    /// n.. are written idle: position 0, no compressed entry visible, none inserted, no page
    /// taken. A step over idle rows writes only their own window region's first slot and
    /// compressor carry (meaningless values), so idle rows must hold no sequence: a step over the
    /// first m ≥ n rows ([`DecodeStepInputs::leading`]) after this update is the step of the n
    /// sequences. Errors as `update` does, and for more positions than sequences.
    pub fn update_first(&self, positions: &[usize]) -> Result<()> {
        self.stage_first(positions)?;
        self.derive()
    }

    /// The host part of [`DecodeStepInputs::update_first`]: the pages taken and the one
    /// host→device copy of the integer rows (and page table), without the device ops that derive
    /// the rest from them. Run [`DecodeStepInputs::derive`] before the step reads the inputs — a
    /// captured step may run it inside its graph (it reads only the uploaded rows), which saves
    /// the update its launches.
    pub fn stage_first(&self, positions: &[usize]) -> Result<()> {
        self.check_count(positions, false)?;
        self.write(positions, true)
    }

    /// [`DecodeStepInputs::update`] of `positions.len()` ≤ B sequences, rows past them idle,
    /// except the derived rows ([`DecodeStepInputs::derive`]); `take_pages` false (the inputs'
    /// construction) takes no page: an entry without a page gets slot −1 (no insert).
    fn write(&self, positions: &[usize], take_pages: bool) -> Result<()> {
        if self.view {
            candle_core::bail!("DecodeStepInputs: a leading view is not updated: update the inputs it was taken from")
        }
        let needs = self.check_positions(positions)?;
        let b = self.batch;
        let (w, ws) = (self.window, self.window_stride);
        if let (Some(c), Some(needs), true) = (&self.compressed, &needs, take_pages) {
            c.pages.grow(needs)?;
        }
        let mut host = vec![-1i64; ROWS * b];
        for s in 0..b {
            let Some(&p) = positions.get(s) else {
                // Idle: position 0 in its own window region, nothing visible, nothing inserted.
                host[ROW_POSITION * b + s] = 0;
                host[ROW_WINDOW_SLOT * b + s] = (s * ws) as i64;
                host[ROW_ENTRY_POSITION * b + s] = 0;
                host[ROW_VISIBLE * b + s] = 0;
                continue;
            };
            host[ROW_POSITION * b + s] = p as i64;
            host[ROW_WINDOW_SLOT * b + s] = (s * ws + p % w) as i64;
            if let Some(c) = &self.compressed {
                let r = c.ratio;
                if (p + 1) % r == 0 {
                    // Held after the grow above (which gave every sequence the pages of its visible
                    // entries); −1 only before the first update.
                    host[ROW_ENTRY_SLOT * b + s] = c.pages.slot(s, p / r).map_or(-1, |v| v as i64);
                }
                host[ROW_ENTRY_POSITION * b + s] = (p / r * r) as i64;
                host[ROW_VISIBLE * b + s] = ((p + 1) / r) as i64;
            }
        }
        let dev = self.table.device();
        // The page table: whole with the rows when many sequences' pages changed (or at the first
        // write), else only the changed rows (a sequence takes a page every 64·r steps).
        let mut page_rows = Vec::new();
        let mut uploaded = None;
        if let Some(c) = &self.compressed {
            // Rows whose version moved since the last upload (the table itself is built only
            // when it goes up whole).
            let now = c.pages.row_versions();
            let last = c.uploaded.lock().unwrap_or_else(|e| e.into_inner());
            match last.as_ref() {
                Some(old) if old.len() == now.len() => {
                    let changed: Vec<usize> = (0..b).filter(|&s| old[s] != now[s]).collect();
                    if changed.len() * WHOLE_TABLE_SHARE > b {
                        host.extend_from_slice(&c.pages.host_rows());
                    } else {
                        page_rows = changed.into_iter().map(|s| (s, c.pages.host_row(s))).collect();
                    }
                }
                _ => host.extend_from_slice(&c.pages.host_rows()),
            }
            uploaded = Some((&c.uploaded, now));
        }
        self.writer.write(&self.upload, &host)?;
        if let Some(c) = &self.compressed {
            for (s, r) in page_rows {
                let m = r.len();
                c.page_table.slice_set(&Tensor::from_vec(r, (1, m), dev)?, 0, s)?;
            }
        }
        if let Some((cell, new)) = uploaded {
            *cell.lock().unwrap_or_else(|e| e.into_inner()) = Some(new);
        }
        Ok(())
    }

    /// Derives on the device, from the rows the last update uploaded, the RoPE rows, the window
    /// indices and (compressed layers) the closing entry's RoPE rows, the closing flags and the
    /// visible counts, written in place. It launches the same ops with the same arguments every
    /// time and reads nothing back, so it may run inside a captured step (also on a
    /// [`DecodeStepInputs::leading`] view, deriving its rows only). On CUDA it runs with Candle's
    /// host-upload cache on: the shape descriptors of its broadcasting ops are uploaded once.
    pub fn derive(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if crate::cuda::fused_kernels(self.table.device()) {
            // One launch (`kernels/step_inputs.cu`), bit for bit the ops of `derive_ref`.
            let (entry_positions, visible) = (self.table.get(ROW_ENTRY_POSITION)?, self.table.get(ROW_VISIBLE)?);
            let entry = self.compressed.as_ref().map(|c| crate::cuda::EntryRows {
                positions: &entry_positions,
                slots: &c.entry_slots,
                visible_in: &visible,
                cos: &c.entry_cos,
                sin: &c.entry_sin,
                closing: &c.closing,
                visible: &c.visible,
            });
            let (cos, sin, neg_sin) = (&self.cos, &self.sin, &self.neg_sin);
            return crate::cuda::step_inputs_device(&self.positions, self.rope.inv_freq(), self.window_stride, cos, sin, neg_sin, &self.window_indices, entry);
        }
        self.derive_ref()
    }

    /// [`DecodeStepInputs::derive`] as Candle ops (the reference, on any device).
    pub fn derive_ref(&self) -> Result<()> {
        let (b, w) = (self.batch, self.window);
        #[cfg(feature = "cuda")]
        let _descriptors = match self.table.device() {
            Device::Cuda(c) => Some(c.enable_cuda_graph_htod_cache()),
            _ => None,
        };
        let rows = self.rope.rows_at(&self.positions)?;
        self.cos.slice_set(&rows.cos, 0, 0)?;
        self.sin.slice_set(&rows.sin, 0, 0)?;
        self.neg_sin.slice_set(&rows.neg_sin, 0, 0)?;
        // The k-th window entry of position p is position p − W + 1 + k: ring slot
        // (p + 1 + k) mod W (the sum is ≥ 1, so the integer division floors), valid when
        // p + 1 + k ≥ W.
        let q = self.positions.reshape((b, 1))?.broadcast_add(&self.window_offsets)?;
        let slot = (&q - q.broadcast_div(&self.window_len)?.broadcast_mul(&self.window_len)?)?;
        let idx = q.ge(w as i64)?.where_cond(&slot.broadcast_add(&self.window_base)?, &self.window_none)?;
        self.window_indices.slice_set(&idx, 0, 0)?;
        if let Some(c) = &self.compressed {
            let rows = self.rope.rows_at(&self.table.get(ROW_ENTRY_POSITION)?)?;
            c.entry_cos.slice_set(&rows.cos, 0, 0)?;
            c.entry_sin.slice_set(&rows.sin, 0, 0)?;
            c.closing.slice_set(&c.entry_slots.ge(0i64)?.reshape((b, 1))?, 0, 0)?;
            c.visible.slice_set(&self.table.get(ROW_VISIBLE)?.to_dtype(DType::U32)?, 0, 0)?;
        }
        Ok(())
    }

    /// Checks `positions` as [`DecodeStepInputs::update`] does, the page pool included, changing
    /// nothing (a caller updating several inputs objects checks them all first).
    pub fn check(&self, positions: &[usize]) -> Result<()> {
        self.check_count(positions, true)?;
        self.check_pages(positions)
    }

    /// Checks `positions` as [`DecodeStepInputs::update_first`] does, changing nothing.
    pub fn check_first(&self, positions: &[usize]) -> Result<()> {
        self.check_count(positions, false)?;
        self.check_pages(positions)
    }

    fn check_pages(&self, positions: &[usize]) -> Result<()> {
        if let (Some(c), Some(needs)) = (&self.compressed, self.check_positions(positions)?) {
            c.pages.check_grow(&needs)?;
        }
        Ok(())
    }

    /// One position per sequence (`every`), or at most one.
    fn check_count(&self, positions: &[usize], every: bool) -> std::result::Result<(), DecodeStepError> {
        let (b, n) = (self.batch, positions.len());
        if n > b || (every && n != b) {
            return Err(DecodeStepError::BatchMismatch { what: "positions", batch: b, got: n });
        }
        Ok(())
    }

    /// Checks the range of `positions` (at most one per sequence); for compressed layers returns
    /// the entries each sequence sees after this step (what its pages must hold; 0 for idle rows).
    fn check_positions(&self, positions: &[usize]) -> Result<Option<Vec<usize>>> {
        let b = self.batch;
        self.check_count(positions, false)?;
        for (s, &p) in positions.iter().enumerate() {
            if p > MAX_POSITION {
                Err(DecodeStepError::PositionOutOfRange { seq: s, position: p, max: MAX_POSITION })?
            }
        }
        let Some(c) = &self.compressed else { return Ok(None) };
        let r = c.ratio;
        let mut needs = Vec::with_capacity(b);
        for (s, &p) in positions.iter().enumerate() {
            let visible = (p + 1) / r;
            if visible > c.entries {
                Err(DecodeStepError::BeyondCapacity { seq: s, position: p, needed: visible, entries: c.entries, limit: c.entries * r })?
            }
            needs.push(visible);
        }
        needs.resize(b, 0);
        Ok(Some(needs))
    }

    /// The inputs of the first `rows` sequences: every `[B, ..]` tensor narrowed to its first
    /// `rows` rows (views of the same memory, so later updates show through), for a step over
    /// those rows (a batch-size bucket) with caches narrowed alike
    /// ([`super::BatchedLayerCache::leading`]). Errors for 0 rows or more than the batch.
    pub fn leading(&self, rows: usize) -> Result<Self> {
        if rows == 0 || rows > self.batch {
            Err(DecodeStepError::BatchMismatch { what: "the leading rows", batch: self.batch, got: rows })?
        }
        let n = |t: &Tensor| t.narrow(0, 0, rows);
        let compressed = match &self.compressed {
            Some(c) => Some(CompressedInputs {
                ratio: c.ratio,
                entries: c.entries,
                pages: c.pages.clone(),
                page_table: n(&c.page_table)?,
                entry_slots: n(&c.entry_slots)?,
                entry_cos: n(&c.entry_cos)?,
                entry_sin: n(&c.entry_sin)?,
                closing: n(&c.closing)?,
                visible: n(&c.visible)?,
                uploaded: c.uploaded.clone(),
            }),
            None => None,
        };
        Ok(Self {
            batch: rows,
            window: self.window,
            window_stride: self.window_stride,
            rope: self.rope.clone(),
            upload: self.upload.clone(),
            writer: HostUpload::default(),
            table: self.table.narrow(1, 0, rows)?,
            positions: n(&self.positions)?,
            window_slots: n(&self.window_slots)?,
            window_indices: n(&self.window_indices)?,
            cos: n(&self.cos)?,
            sin: n(&self.sin)?,
            neg_sin: n(&self.neg_sin)?,
            no_extra: n(&self.no_extra)?,
            window_offsets: self.window_offsets.clone(),
            window_len: self.window_len.clone(),
            window_base: n(&self.window_base)?,
            window_none: n(&self.window_none)?,
            compressed,
            view: true,
        })
    }

    /// Sequences of the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// `[B]` i64: the positions of the last update.
    pub fn positions(&self) -> &Tensor {
        &self.positions
    }

    /// `[B]` i64: each sequence's window-pool slot this step.
    pub fn window_slots(&self) -> &Tensor {
        &self.window_slots
    }

    /// `[B, W]` i64: each sequence's window, as window-pool slots (−1: none).
    pub fn window_indices(&self) -> &Tensor {
        &self.window_indices
    }

    /// `[B, R/2]` f32 RoPE rows at the positions: `(cos, sin, −sin)`.
    pub fn rope_rows(&self) -> (&Tensor, &Tensor, &Tensor) {
        (&self.cos, &self.sin, &self.neg_sin)
    }

    /// `[B, 0]` i64: the empty compressed index list of window-only layers.
    pub(super) fn no_extra(&self) -> &Tensor {
        &self.no_extra
    }

    /// The compressed-entry inputs (`None` for window-only layers' inputs).
    pub fn compressed(&self) -> Option<&CompressedInputs> {
        self.compressed.as_ref()
    }

    /// Slots between two sequences' window regions.
    pub fn window_stride(&self) -> usize {
        self.window_stride
    }

    /// The RoPE table the rows come from.
    pub fn rope(&self) -> &RopeTable {
        &self.rope
    }

    /// The device of the tensors.
    pub fn device(&self) -> &Device {
        self.table.device()
    }
}
