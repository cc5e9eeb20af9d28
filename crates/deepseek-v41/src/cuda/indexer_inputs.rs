//! What the indexer kernels score against: the index-key cache (bf16 rows or packed MXFP4 68 B
//! rows, spec §7.2 E), where each query's entries lie in it (from a first row, or through a page
//! table), and which entries each query sees (spec §6.3 step 5, §0.1b.2). Shared by [`super::index_scores`],
//! [`super::index_topk`] / [`super::candidate_blocks`] and [`super::index_select`].

use candle_core::{DType, Device, Result, Tensor};

use super::packed_insert::PackedLayout;
use crate::quant::fake_quant::QatFormat;

/// Index head dim the CUDA kernels support (`index_head_dim` of V4.1).
pub const INDEX_HEAD_DIM: usize = 128;
/// Most index heads the CUDA kernels support (`index_n_heads` of V4.1-Flash).
pub const MAX_INDEX_HEADS: usize = 32;

/// An index-key cache.
#[derive(Debug, Clone, Copy)]
pub enum IndexKeys<'a> {
    /// `[R, 128]` bf16 rows (fake-quantized values), last dim contiguous.
    Rows(&'a Tensor),
    /// Packed MXFP4 rows in pages: `cache` `[pages, layout.page_bytes()]` u8 contiguous, `layout`
    /// of format `Fp4Ue8m0B32` with head dim 128 (see [`PackedLayout`]); slot s = row s. The CUDA
    /// kernel takes fewer than 2^32 slots and pages under 4 GiB (else a shape error).
    Packed {
        /// `[pages, page_bytes]` u8.
        cache: &'a Tensor,
        /// The packed geometry.
        layout: PackedLayout,
    },
}

impl IndexKeys<'_> {
    /// Rows (slots) the cache holds.
    pub fn rows(&self) -> Result<usize> {
        Ok(match self {
            Self::Rows(k) => k.dim(0)?,
            Self::Packed { cache, layout } => cache.dim(0)? * layout.page_size(),
        })
    }

    /// The device of the cache.
    pub fn device(&self) -> &Device {
        match self {
            Self::Rows(k) => k.device(),
            Self::Packed { cache, .. } => cache.device(),
        }
    }

    /// Validates shape, dtype and format (`op` names the caller in errors).
    pub(crate) fn check(&self, op: &str) -> Result<()> {
        match self {
            Self::Rows(k) => {
                if k.rank() != 2 || k.dim(1)? != INDEX_HEAD_DIM || k.dtype() != DType::BF16 {
                    candle_core::bail!("{op}: keys must be [R, {INDEX_HEAD_DIM}] bf16, got {:?} {:?}", k.shape(), k.dtype())
                }
            }
            Self::Packed { cache, layout } => {
                if layout.format() != QatFormat::Fp4Ue8m0B32 || layout.head_dim() != INDEX_HEAD_DIM {
                    candle_core::bail!("{op}: packed keys must be Fp4Ue8m0B32 rows of {INDEX_HEAD_DIM}, got {layout:?}")
                }
                if cache.dtype() != DType::U8
                    || cache.rank() != 2
                    || cache.dim(1)? != layout.page_bytes()
                    || !cache.is_contiguous()
                {
                    candle_core::bail!(
                        "{op}: packed cache must be a contiguous [pages, {}] u8 tensor, got {:?} {:?}",
                        layout.page_bytes(),
                        cache.shape(),
                        cache.dtype()
                    )
                }
            }
        }
        Ok(())
    }

    /// `[rows, 128]` f32 on the CPU: the rows `first .. first + n` (packed: dequantized).
    pub(crate) fn host_rows(&self, first: usize, n: usize) -> Result<Tensor> {
        match self {
            Self::Rows(k) => k.narrow(0, first, n)?.to_device(&Device::Cpu)?.to_dtype(DType::F32),
            Self::Packed { cache, layout } => layout.unpack(cache, &(first..first + n).collect::<Vec<_>>()),
        }
    }

    /// `[slots.len(), 128]` f32 on the CPU: the rows at `slots` (each below [`IndexKeys::rows`]).
    pub(crate) fn host_slots(&self, slots: &[usize]) -> Result<Tensor> {
        match self {
            Self::Rows(k) => {
                let idx = Tensor::from_vec(slots.iter().map(|&s| s as u32).collect::<Vec<_>>(), slots.len(), &Device::Cpu)?;
                k.to_device(&Device::Cpu)?.index_select(&idx, 0)?.to_dtype(DType::F32)
            }
            Self::Packed { cache, layout } => layout.unpack(cache, slots),
        }
    }
}

/// Which entries each query sees: entry j of query t is visible iff `j < L_t`.
#[derive(Debug, Clone, Copy)]
pub enum Visibility<'a> {
    /// One sequence's causal rule: query t sits at position `start + t` and sees
    /// `L_t = min(N, (start + t + 1) div ratio)` entries (`ratio` ≥ 1).
    Causal {
        /// Position of query 0.
        start: usize,
        /// Compression ratio of the key owner.
        ratio: usize,
    },
    /// Per-query counts `[T]` u32 on the queries' device (`L_t = min(N, counts[t])`).
    Counts(&'a Tensor),
}

impl Visibility<'_> {
    /// Host copy of `L_t` for `t` in `0..tokens` (clamped to `n`).
    pub(crate) fn host(&self, tokens: usize, n: usize) -> Result<Vec<usize>> {
        Ok(match self {
            Self::Causal { start, ratio } => (0..tokens).map(|t| ((start + t + 1) / ratio).min(n)).collect(),
            Self::Counts(c) => c.to_dtype(DType::U32)?.to_vec1::<u32>()?.into_iter().map(|v| (v as usize).min(n)).collect(),
        })
    }

    pub(crate) fn check(&self, op: &str, tokens: usize, device: &Device) -> Result<()> {
        match self {
            Self::Causal { ratio, .. } if *ratio == 0 => candle_core::bail!("{op}: visibility ratio must be >= 1"),
            Self::Counts(c) => {
                if c.dims() != [tokens] || c.dtype() != DType::U32 || !c.device().same_device(device) {
                    candle_core::bail!(
                        "{op}: visible counts must be [{tokens}] u32 on {device:?}, got {:?} {:?} on {:?}",
                        c.shape(),
                        c.dtype(),
                        c.device()
                    )
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// A page table over an index-key cache: entry j of query t is row (slot)
/// `table[t][j / page_size]·page_size + j mod page_size` (the batched decode step's pools,
/// `attention::page_table`).
#[derive(Debug, Clone, Copy)]
pub struct KeyPages<'a> {
    /// `[T, max_pages]` i64, last dim contiguous: each query's pages in entry order. Every
    /// visible entry's page must be a page of the cache; for others the scores are unspecified
    /// (the kernel reads a row of the cache, never past it; the CPU path scores them −inf).
    pub table: &'a Tensor,
    /// Entries a page holds (a power of two).
    pub page_size: usize,
}

/// The keys of a batch of queries: the cache, where each query's entries lie in it (a first row,
/// or a page table), the number of entries N (score columns) and the visibility rule.
#[derive(Debug, Clone, Copy)]
pub struct KeySource<'a> {
    /// The index-key cache.
    pub keys: IndexKeys<'a>,
    /// `[T]` u32: entry j of query t is row (slot) `base[t] + j`; `None`: row j for every query
    /// (one sequence), or the page table's rows. A query's rows past the cache are treated as
    /// invisible.
    pub base: Option<&'a Tensor>,
    /// A page table instead of `base` (`base` must then be `None`).
    pub pages: Option<KeyPages<'a>>,
    /// N: entries per query (score columns); at most the cache rows when `base` is `None`.
    pub entries: usize,
    /// Visible entries per query.
    pub visibility: Visibility<'a>,
}

impl KeySource<'_> {
    /// One sequence's cache: every entry of `keys`, causal visibility from `start` / `ratio`.
    pub fn sequence(keys: IndexKeys<'_>, start: usize, ratio: usize) -> Result<KeySource<'_>> {
        let entries = keys.rows()?;
        Ok(KeySource { keys, base: None, pages: None, entries, visibility: Visibility::Causal { start, ratio } })
    }

    pub(crate) fn check(&self, op: &str, tokens: usize, device: &Device) -> Result<()> {
        self.keys.check(op)?;
        if !self.keys.device().same_device(device) {
            candle_core::bail!("{op}: keys are on {:?}, queries on {device:?}", self.keys.device())
        }
        self.visibility.check(op, tokens, device)?;
        if let Some(p) = self.pages {
            let t = p.table;
            let ok = t.rank() == 2 && t.dim(0)? == tokens && t.dtype() == DType::I64 && t.device().same_device(device);
            if !ok || (t.dim(1)? > 1 && t.stride()[1] != 1) {
                candle_core::bail!("{op}: the page table must be [{tokens}, pages] i64 on {device:?} (rows contiguous), got {:?} {:?}", t.shape(), t.dtype())
            }
            if !p.page_size.is_power_of_two() || p.page_size > 1 << 30 {
                candle_core::bail!("{op}: the page size must be a power of two below 2^30, got {}", p.page_size)
            }
            if self.base.is_some() {
                candle_core::bail!("{op}: give a key base or a page table, not both")
            }
            if self.entries > t.dim(1)? * p.page_size {
                candle_core::bail!("{op}: {} entries but the page table holds {} pages of {}", self.entries, t.dim(1)?, p.page_size)
            }
        } else if let Some(b) = self.base {
            if b.dims() != [tokens] || b.dtype() != DType::U32 || !b.device().same_device(device) {
                candle_core::bail!("{op}: key base must be [{tokens}] u32 on {device:?}, got {:?} {:?}", b.shape(), b.dtype())
            }
        } else if self.entries > self.keys.rows()? {
            candle_core::bail!("{op}: {} entries but the key cache holds {} rows", self.entries, self.keys.rows()?)
        }
        if self.entries > i32::MAX as usize {
            candle_core::bail!("{op}: {} entries exceed the kernels' i32 range", self.entries)
        }
        Ok(())
    }

    /// Host copy of each query's rows of entries `0 .. n` through the page table (`None` without
    /// one): a query's rows end at its first page below 0 or past the cache.
    pub(crate) fn host_paged_rows(&self, tokens: usize) -> Result<Option<Vec<Vec<usize>>>> {
        let Some(p) = self.pages else { return Ok(None) };
        let rows = self.keys.rows()?;
        let table = p.table.to_device(&Device::Cpu)?.to_vec2::<i64>()?;
        let ps = p.page_size;
        Ok(Some(
            table
                .into_iter()
                .take(tokens)
                .map(|pages| {
                    pages
                        .into_iter()
                        .map_while(|pg| usize::try_from(pg).ok().filter(|pg| (pg + 1) * ps <= rows))
                        .flat_map(|pg| pg * ps..(pg + 1) * ps)
                        .take(self.entries)
                        .collect()
                })
                .collect(),
        ))
    }

    /// Host copy of the per-query first rows.
    pub(crate) fn host_base(&self, tokens: usize) -> Result<Vec<usize>> {
        match self.base {
            Some(b) => Ok(b.to_vec1::<u32>()?.into_iter().map(|v| v as usize).collect()),
            None => Ok(vec![0; tokens]),
        }
    }
}
