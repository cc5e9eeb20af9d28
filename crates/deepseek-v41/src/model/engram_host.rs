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
}

impl Staging {
    /// `len` bytes written by `fill`, as a `[len]` u8 tensor on `device` (one host → device copy).
    fn upload(&mut self, len: usize, device: &Device, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            if !self.pinned_failed {
                let pinned = self.pinned.get_or_insert_with(|| crate::cuda::PinnedStaging::new(dev));
                match pinned.reserve(len) {
                    Ok(()) => return pinned.upload(len, fill),
                    Err(_) => self.pinned_failed = true,
                }
            }
        }
        if self.host.len() < len {
            self.host.resize(len.checked_next_power_of_two().unwrap_or(len), 0);
        }
        let buf = &mut self.host[..len];
        fill(buf)?;
        Tensor::from_slice(buf, len, device)
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
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let (n, width) = (ids.len(), self.table.width());
        let Some(decoder) = &self.decoder else {
            let rows: Vec<usize> = ids.iter().map(|&r| r as usize).collect();
            return self.table.rows(&rows, DType::BF16, &self.device);
        };
        let Some(row_bytes) = self.table.stored_row_bytes() else {
            candle_core::bail!("Engram table `{}`: device decode of a table not stored as FP8 rows", self.table.name())
        };
        if n == 0 {
            return Tensor::zeros((0, width), DType::BF16, &self.device);
        }
        let staged = self.staging().upload(n * row_bytes, &self.device, |buf| Ok(self.table.gather_stored(ids, buf)?))?;
        decoder.decode(&staged, n, width)
    }
}
