//! Engram tables kept in host memory (spec §9.5; storage spec §2.4): the table stays in the
//! memory-mapped checkpoint and each call reads only the rows its hash ids select.
//!
//! A call with `n` row ids (T tokens × `(max_ngram_size − 1) · n_heads` ids, 24 per token in the
//! release):
//! 1. gathers the rows in their **stored** form — `width` e4m3 code bytes and `width / 32` e8m0
//!    scale bytes each (256 + 8 in the release) — from the memory map into the layer's staging
//!    buffer, all codes first, then all scales ([`RowTable::gather_stored`]);
//! 2. copies that buffer to the device in one copy (on CUDA from page-locked memory,
//!    `cuda::PinnedStaging`, falling back to a pageable buffer if none can be allocated);
//! 3. decodes on the device with integer ops and one gather, no float arithmetic: entry
//!    `scale byte · 256 + code byte` of a 65536-entry bf16 table holding every product
//!    `e4m3(code) · 2^(scale − 127)` ([`crate::loader::fp8_rows_products`], cast to bf16 on the
//!    host as the resident table is). The result is bit for bit [`RowTable::lookup`] in bf16, and
//!    so the resident table's rows. (The bytes are widened to u32 by casts, not by a gather with
//!    u8 ids: candle's index ops read an id equal to its dtype's maximum — u8 255, a valid code
//!    and scale byte — as "no row" and return zeros.)
//!
//! Step 1 ([`HostRows::gather`]) and steps 2–3 ([`HostRows::upload`]) can run apart: a step's
//! hash ids are known from its tokens, so `Model::forward_batch` starts the gathers of all its
//! host tables on threads when the step begins, and each Engram block uploads its rows (no read
//! of the device; the page faults of rows not in the page cache overlap the blocks before).
//!
//! The staging buffer belongs to the layer and is reused: it grows to the largest call seen
//! (a power of two) and never shrinks, so decode steps allocate no host memory. Tables stored
//! otherwise (unquantized, or a width that is not a multiple of 32) take [`RowTable::rows`]:
//! dequantized on the host, then copied.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Result, Tensor};

use crate::loader::{fp8_rows_products, RowTable, WeightFormat};

/// Columns per e8m0 scale of an FP8 row (spec §2.4).
const BLOCK: usize = 32;

/// The device table of the row decoder (see the module doc).
#[derive(Debug, Clone)]
struct Decoder {
    /// `[65536]` bf16: entry `s · 256 + c` is `e4m3(c) · 2^(s − 127)`.
    products: Tensor,
}

impl Decoder {
    /// Device bytes of the table.
    const BYTES: u64 = 65536 * 2;

    fn new(device: &Device) -> Result<Self> {
        let products = Tensor::from_vec(fp8_rows_products()?, 65536, &Device::Cpu)?.to_dtype(DType::BF16)?.to_device(device)?;
        Ok(Self { products })
    }

    /// `[n, width]` bf16 from the staged bytes `[n · (width + width/32)]` u8 (codes, then
    /// scales) on the device; `width` is a multiple of 32. Five launches on CUDA: two casts, the
    /// scale offsets (`· 256`), the broadcast add, the gather.
    fn decode(&self, staged: &Tensor, n: usize, width: usize) -> Result<Tensor> {
        let sb = width / BLOCK;
        let codes = staged.narrow(0, 0, n * width)?.to_dtype(DType::U32)?.reshape((n, sb, BLOCK))?;
        let scales = staged.narrow(0, n * width, n * sb)?.to_dtype(DType::U32)?.affine(256.0, 0.0)?.reshape((n, sb, 1))?;
        let idx = codes.broadcast_add(&scales)?.flatten_all()?;
        self.products.index_select(&idx, 0)?.reshape((n, width))
    }
}

/// The host staging memory of one table (see the module doc).
#[derive(Default)]
struct Staging {
    /// Pageable buffer: the CPU device, or CUDA when no page-locked memory could be had.
    host: Vec<u8>,
    /// Page-locked buffer for a CUDA device (created on the first call).
    #[cfg(feature = "cuda")]
    pinned: Option<crate::cuda::PinnedStaging>,
    /// Page-locked memory was refused once: stage in `host` from then on.
    #[cfg(feature = "cuda")]
    pinned_failed: bool,
    /// Counts the fills: a [`GatheredRows`] is uploaded from the buffer only while no other
    /// fill came after its own (a clone of the model sharing the table may gather in between).
    fills: u64,
}

impl Staging {
    /// Fills the first `len` bytes of the buffer (page-locked on CUDA when it can be had) with
    /// `fill`, once the previous copy has read them.
    fn fill(&mut self, len: usize, device: &Device, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<()> {
        self.fills += 1;
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            if !self.pinned_failed {
                let pinned = self.pinned.get_or_insert_with(|| crate::cuda::PinnedStaging::new(dev));
                match pinned.reserve(len) {
                    Ok(()) => return pinned.fill(len, fill),
                    Err(_) => self.pinned_failed = true,
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        if self.host.len() < len {
            self.host.resize(len.checked_next_power_of_two().unwrap_or(len), 0);
        }
        fill(&mut self.host[..len])
    }

    /// The `len` bytes the last [`Staging::fill`] wrote, as a `[len]` u8 tensor on `device`.
    fn copy(&mut self, len: usize, device: &Device) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(_), false, Some(pinned)) = (device, self.pinned_failed, self.pinned.as_mut()) {
            return pinned.copy(len);
        }
        match self.host.get(..len) {
            Some(buf) => Tensor::from_slice(buf, len, device),
            None => candle_core::bail!("Engram staging: copy of {len} bytes from a buffer of {}", self.host.len()),
        }
    }

    /// The staging bytes held (host and page-locked).
    fn capacity(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(p) = &self.pinned {
            return self.host.len() + p.capacity();
        }
        self.host.len()
    }

    /// Whether the last calls staged in page-locked memory.
    fn pinned(&self) -> bool {
        #[cfg(feature = "cuda")]
        if !self.pinned_failed && self.pinned.is_some() {
            return true;
        }
        false
    }
}

/// One Engram table kept in host memory: rows read from the checkpoint per call, decoded on the
/// model's device (see the module doc). Cloning shares the staging buffer.
#[derive(Clone)]
pub struct HostRows {
    table: RowTable,
    device: Device,
    /// The device decoder when the table is FP8 rows with 1×32 scales and a width that is a
    /// multiple of 32; `None`: rows dequantized on the host ([`RowTable::rows`]).
    decoder: Option<Decoder>,
    staging: Arc<Mutex<Staging>>,
}

impl std::fmt::Debug for HostRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostRows({}, {:?}, device decode: {})", self.table.name(), self.device, self.decoder.is_some())
    }
}

impl HostRows {
    /// Host rows of `table` decoded on `device`; marks the table's pages as read at random
    /// ([`RowTable::advise_random`]). Reads no row.
    pub fn new(table: RowTable, device: &Device) -> Result<Self> {
        let staged = table.format() == WeightFormat::Fp8Rows && table.width().is_multiple_of(BLOCK);
        let decoder = if staged { Some(Decoder::new(device)?) } else { None };
        table.advise_random();
        Ok(Self { table, device: device.clone(), decoder, staging: Arc::default() })
    }

    /// The checkpoint table.
    pub fn table(&self) -> &RowTable {
        &self.table
    }

    /// The device the rows are decoded on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the rows are gathered in their stored form and decoded on the device (FP8 rows
    /// with 1×32 scales, width a multiple of 32), rather than dequantized on the host.
    pub fn decodes_on_device(&self) -> bool {
        self.decoder.is_some()
    }

    /// Device bytes of the decoder's table (the 65536 bf16 products, 128 KiB), 0 without a
    /// device decoder.
    pub fn decoder_bytes(&self) -> u64 {
        self.decoder.as_ref().map_or(0, |_| Decoder::BYTES)
    }

    /// The bytes the staging buffer holds now (it grows to the largest call and is kept).
    pub fn staging_bytes(&self) -> usize {
        self.staging().capacity()
    }

    /// Whether the staging buffer is page-locked host memory (CUDA, once a call has run and the
    /// allocation succeeded).
    pub fn staging_pinned(&self) -> bool {
        self.staging().pinned()
    }

    fn staging(&self) -> MutexGuard<'_, Staging> {
        self.staging.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The rows `ids` (may repeat, any order) as `[ids.len(), width]` bf16 on the device: bit for
    /// bit [`RowTable::lookup`] in bf16. Errors (naming the table) on an id ≥ the table's rows.
    /// [`HostRows::gather`] then [`HostRows::upload`].
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let g = self.gather(ids)?;
        self.upload(g)
    }

    /// The host half of [`HostRows::rows`]: reads the rows `ids` from the memory-mapped table
    /// into the staging buffer (stored bytes; or dequantized rows for a table without a device
    /// decoder). It may run on another thread, ahead of the layer that needs the rows
    /// (`Model::forward_batch` starts the gathers of every host table when a step begins, so
    /// the page faults of rows not in the page cache overlap the layers before); the staging
    /// buffer is then busy until [`HostRows::upload`] of the result.
    pub fn gather(&self, ids: &[u32]) -> Result<GatheredRows> {
        let n = ids.len();
        let Some(row_bytes) = self.decoder.as_ref().and_then(|_| self.table.stored_row_bytes()) else {
            let rows: Vec<usize> = ids.iter().map(|&r| r as usize).collect();
            return Ok(GatheredRows(Gathered::Host(self.table.rows(&rows, DType::BF16, &Device::Cpu)?)));
        };
        let mut staging = self.staging();
        if n > 0 {
            staging.fill(n * row_bytes, &self.device, |buf| Ok(self.table.gather_stored(ids, buf)?))?;
        }
        Ok(GatheredRows(Gathered::Staged { ids: ids.to_vec(), bytes: n * row_bytes, fill: staging.fills }))
    }

    /// The device half of [`HostRows::rows`]: the rows a [`HostRows::gather`] of this table read,
    /// as `[n, width]` bf16 on the device (one host → device copy, decoded there).
    pub fn upload(&self, g: GatheredRows) -> Result<Tensor> {
        let width = self.table.width();
        match g.0 {
            Gathered::Host(t) => t.to_device(&self.device),
            Gathered::Staged { ids, .. } if ids.is_empty() => Tensor::zeros((0, width), DType::BF16, &self.device),
            Gathered::Staged { ids, bytes, fill } => {
                let Some(decoder) = &self.decoder else {
                    candle_core::bail!("Engram table `{}`: staged rows without a device decoder", self.table.name())
                };
                let mut staging = self.staging();
                if staging.fills != fill {
                    // Another gather refilled the buffer since: read these rows again.
                    staging.fill(bytes, &self.device, |buf| Ok(self.table.gather_stored(&ids, buf)?))?;
                }
                let staged = staging.copy(bytes, &self.device)?;
                decoder.decode(&staged, ids.len(), width)
            }
        }
    }
}

/// Rows read by [`HostRows::gather`], waiting for [`HostRows::upload`] on the table that read them.
#[derive(Debug)]
pub struct GatheredRows(Gathered);

#[derive(Debug)]
enum Gathered {
    /// Rows dequantized on the host (a table without a device decoder).
    Host(Tensor),
    /// The stored bytes of the rows `ids` in the table's staging buffer, written by its
    /// `fill`-th fill.
    Staged { ids: Vec<u32>, bytes: usize, fill: u64 },
}
