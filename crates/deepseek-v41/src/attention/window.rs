//! The sliding-window cache of one layer (spec §4.3, §4.6): a ring of `W` rows (slot = position
//! mod W) holding the window KV rows (K = V, RoPE'd, FP8-fake-quantized in reference numerics).
//!
//! A query at position p attends to positions `max(0, p − W + 1) ..= p`, its own row included,
//! so a call first assembles "ring rows still in the window ++ this call's rows" and the per-query
//! index lists into that tensor, then stores the call's rows into the ring.

use candle_core::{DType, Device, Result, Tensor};

use super::history::{read_slots, write_slots, PositionRing};
use super::storage::{CacheKind, CacheStorage, Packing};

/// Ring of the last `window` window-KV rows of one layer and one sequence, as rows in the
/// activation dtype or packed in format A ([`CacheStorage`]).
#[derive(Debug, Clone)]
pub struct WindowCache {
    /// bf16 storage: `[window, head_dim]` in the activation dtype; slot s holds the latest
    /// position ≡ s mod W (zeros where never written). Packed storage: `[pages, page_bytes]` u8,
    /// format A pages with the same slots.
    ring: Tensor,
    window: usize,
    /// The dtype of [`WindowCache::ring_rows`].
    dtype: DType,
    packing: Option<Packing>,
    /// Rows evicted from the ring, kept for [`WindowCache::truncate`] (capacity = the cache's
    /// rollback depth, 0 by default).
    spill: PositionRing,
    /// The position after the last row [`WindowCache::store`] wrote (the fused decode step
    /// writes the ring in place and does not advance it).
    stored: usize,
    /// The fused path's decode table (`window_fused.rs`, built at the first device decode step):
    /// the decode token's ring slot and window indices are views of it, so a step uploads
    /// nothing for them.
    #[cfg(feature = "cuda")]
    pub(super) decode_table: Option<Tensor>,
}

/// The window part of one call: the rows it can attend to and, per query, their indices.
#[derive(Debug, Clone)]
pub struct WindowRows {
    /// `[n, head_dim]`: rows of positions `base .. base + n`.
    pub kv: Tensor,
    /// Position of row 0 of `kv`.
    pub base: usize,
    /// `[T][window]` indices into `kv` per query (ascending, `-1` padded).
    pub indices: Vec<Vec<i64>>,
}

impl WindowCache {
    /// An empty ring of `window` rows of width `head_dim` in `dtype`.
    pub fn new(window: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<Self> {
        Self::with_storage(window, head_dim, CacheStorage::Bf16, dtype, device)
    }

    /// An empty ring of `window` rows of width `head_dim` stored as `storage` says (packed:
    /// format A, `ceil(window / PACKED_PAGE_TOKENS)` pages); [`WindowCache::ring_rows`] returns
    /// `dtype`. Errors for packed storage without the `cuda` feature.
    pub fn with_storage(window: usize, head_dim: usize, storage: CacheStorage, dtype: DType, device: &Device) -> Result<Self> {
        if window == 0 {
            candle_core::bail!("WindowCache: sliding_window must be > 0")
        }
        let packing = storage.packing(CacheKind::Window, head_dim)?;
        let ring = match &packing {
            None => Tensor::zeros((window, head_dim), dtype, device)?,
            Some(p) => p.zeros(window.div_ceil(p.page_size()), device)?,
        };
        Self::from_ring(ring, window, packing, dtype)
    }

    /// A ring over `ring` (zeroed, `[window, head_dim]` or the format-A pages of `packing`), e.g.
    /// a page of a [`super::pool::CachePool`]: every write goes to `ring`'s storage.
    pub(crate) fn from_ring(ring: Tensor, window: usize, packing: Option<Packing>, dtype: DType) -> Result<Self> {
        Ok(Self {
            ring,
            window,
            dtype,
            packing,
            spill: PositionRing::new(0),
            stored: 0,
            #[cfg(feature = "cuda")]
            decode_table: None,
        })
    }

    /// The ring's storage: `[window, head_dim]` rows as the reference lays them out (slot =
    /// position mod W), or for packed storage the `[pages, page_bytes]` u8 format-A pages with
    /// the same slots (see [`WindowCache::ring_rows`] for the values).
    pub fn ring(&self) -> &Tensor {
        &self.ring
    }

    /// `[window, head_dim]` in the cache's dtype: the ring's rows (slot = position mod W);
    /// packed storage: dequantized with `PackedLayout::unpack` (a host round trip, exact).
    pub fn ring_rows(&self) -> Result<Tensor> {
        match &self.packing {
            None => Ok(self.ring.clone()),
            Some(p) => p.unpack_rows(&self.ring, 0..self.window, self.dtype),
        }
    }

    /// How the ring stores its rows.
    pub fn storage(&self) -> CacheStorage {
        CacheStorage::of(self.packing.as_ref())
    }

    fn check_rows(&self, op: &str) -> Result<()> {
        if self.packing.is_some() {
            candle_core::bail!("WindowCache::{op}: the ring is packed (format A); its rows are written by the fused window insert (Attention::forward_fused)")
        }
        Ok(())
    }

    /// Assembles the window rows for queries at `start .. start + T` (`rows`: `[T, head_dim]`,
    /// this call's window KV) and stores `rows` into the ring.
    /// Bf16 storage only (the reference path).
    pub fn extend(&mut self, rows: &Tensor, start: usize) -> Result<WindowRows> {
        self.check_rows("extend")?;
        let (t, d) = rows.dims2()?;
        let (w, ring_d) = self.ring.dims2()?;
        if d != ring_d {
            candle_core::bail!("WindowCache: row width {d} != cache width {ring_d}")
        }
        let base = start.saturating_sub(w - 1);
        let kv = if base < start {
            let slots: Vec<u32> = (base..start).map(|p| (p % w) as u32).collect();
            let slots = Tensor::new(slots, self.ring.device())?;
            Tensor::cat(&[self.ring.index_select(&slots, 0)?, rows.to_dtype(self.ring.dtype())?], 0)?
        } else {
            rows.to_dtype(self.ring.dtype())?
        };
        let indices = (start..start + t)
            .map(|p| {
                let lo = p.saturating_sub(w - 1);
                let mut v: Vec<i64> = (lo..=p).map(|q| (q - base) as i64).collect();
                v.resize(w, -1);
                v
            })
            .collect();
        self.store(rows, start)?;
        Ok(WindowRows { kv, base, indices })
    }

    /// Stores the last `min(T, W)` of `rows` (`[T, head_dim]`, positions `start ..`) at their
    /// slots (at most two contiguous runs, in-place copies). With a rollback depth, the rows
    /// leaving the window (old ring rows, and call rows that never enter it) go to the spill.
    pub(super) fn store(&mut self, rows: &Tensor, start: usize) -> Result<()> {
        let (t, w) = (rows.dim(0)?, self.window);
        let end = start + t;
        if self.spill_capacity() > 0 {
            // Leaving: positions max(0, start − W) .. end − W; the ring holds those < start
            // only if it was written up to `start` by this function.
            let leaving = start.saturating_sub(w)..end.saturating_sub(w);
            if !leaving.is_empty() {
                let old = leaving.start..leaving.end.min(start);
                let mut parts = Vec::new();
                if self.stored == start && !old.is_empty() {
                    parts.push(read_slots(&self.ring, old.clone())?);
                }
                let first = if parts.is_empty() { old.end } else { old.start };
                if leaving.end > start {
                    parts.push(rows.narrow(0, 0, leaving.end - start)?.to_dtype(self.ring.dtype())?);
                }
                if !parts.is_empty() {
                    self.spill.write(&Tensor::cat(&parts, 0)?, first)?;
                }
            }
        }
        let keep = t.min(w);
        write_slots(&self.ring, &rows.narrow(0, t - keep, keep)?, end - keep)?;
        self.stored = end;
        Ok(())
    }

    fn spill_capacity(&self) -> usize {
        self.spill.capacity()
    }

    /// Keeps the rows of up to `depth` positions evicted from the ring, so that the cache can be
    /// truncated up to `depth` positions back ([`WindowCache::truncate`]); forgets what was kept.
    pub fn set_rollback_depth(&mut self, depth: usize) {
        self.spill = PositionRing::new(depth);
    }

    /// Rolls the ring back from `len` to `new_len` positions (`new_len <= len`): the rows of
    /// positions `new_len − W .. new_len` come back into their slots from the spill. Fails,
    /// changing nothing, when a needed row left the ring and the spill (a rollback deeper than
    /// the depth, or rows written by the fused decode step, which keeps no spill).
    pub fn truncate(&mut self, len: usize, new_len: usize) -> Result<()> {
        if new_len > len {
            candle_core::bail!("window ring: cannot truncate {len} positions to {new_len}")
        }
        let missing = self.rollback_gap(len, new_len);
        if let Some(gap) = missing {
            candle_core::bail!(
                "window ring: positions {}..{} left the window and are not held for rollback (held: {:?})",
                gap.start,
                gap.end,
                self.spill.held()
            )
        }
        let w = self.window;
        let from_spill = new_len.saturating_sub(w)..new_len.min(len.saturating_sub(w));
        if let Some(rows) = self.spill.read(from_spill.clone())? {
            write_slots(&self.ring, &rows, from_spill.start)?;
        }
        self.spill.truncate(new_len.saturating_sub(w));
        self.stored = new_len;
        Ok(())
    }

    /// The positions a rollback from `len` to `new_len` needs back in the ring but cannot get
    /// (`None`: it can be done).
    pub(super) fn rollback_gap(&self, len: usize, new_len: usize) -> Option<std::ops::Range<usize>> {
        let w = self.window;
        // Needed in the ring afterwards: new_len − W .. new_len; still there: len − W .. len.
        let from_spill = new_len.saturating_sub(w)..new_len.min(len.saturating_sub(w));
        if from_spill.is_empty() || (self.stored == len && self.spill.holds(&from_spill)) {
            None
        } else {
            Some(from_spill)
        }
    }

    /// Replaces the ring's rows by `ring` (`[window, head_dim]`, slot = position mod W); bf16
    /// storage only.
    pub fn restore(&mut self, ring: &Tensor) -> Result<()> {
        self.check_rows("restore")?;
        if ring.dims() != self.ring.dims() {
            candle_core::bail!("WindowCache::restore: ring {:?}, want {:?}", ring.shape(), self.ring.shape())
        }
        self.ring.slice_set(&ring.to_dtype(self.ring.dtype())?.to_device(self.ring.device())?.contiguous()?, 0, 0)?;
        // The spill no longer continues the ring's rows.
        self.spill = PositionRing::new(self.spill.capacity());
        self.stored = usize::MAX;
        Ok(())
    }

    /// Number of rows in the ring (`sliding_window`).
    pub fn window(&self) -> usize {
        self.window
    }
}

#[cfg(feature = "cuda")]
#[path = "window_fused.rs"]
mod fused;
#[cfg(feature = "cuda")]
pub use fused::WindowSource;

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(start: usize, t: usize) -> Tensor {
        // Row of position p is filled with p + 1.
        let v: Vec<f32> = (start..start + t).flat_map(|p| [p as f32 + 1.0; 2]).collect();
        Tensor::from_vec(v, (t, 2), &Device::Cpu).unwrap()
    }

    #[test]
    fn prefill_then_decode_sees_exactly_the_window() -> Result<()> {
        let mut c = WindowCache::new(4, 2, DType::F32, &Device::Cpu)?;
        let a = c.extend(&rows(0, 6), 0)?;
        assert_eq!(a.base, 0);
        assert_eq!(a.indices[0], vec![0, -1, -1, -1]);
        assert_eq!(a.indices[5], vec![2, 3, 4, 5]);
        // Ring: slot s = latest p ≡ s (mod 4): p 4, 5, 2, 3.
        let ring: Vec<f32> = c.ring().narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
        assert_eq!(ring, vec![5.0, 6.0, 3.0, 4.0]);
        // Decode p = 6: rows of positions 3, 4, 5 come from the ring, then 6.
        let b = c.extend(&rows(6, 1), 6)?;
        assert_eq!(b.base, 3);
        let kv: Vec<f32> = b.kv.narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
        assert_eq!(kv, vec![4.0, 5.0, 6.0, 7.0]);
        assert_eq!(b.indices[0], vec![0, 1, 2, 3]);
        Ok(())
    }

    #[test]
    fn chunk_wraps_the_ring() -> Result<()> {
        let mut c = WindowCache::new(4, 2, DType::F32, &Device::Cpu)?;
        c.extend(&rows(0, 3), 0)?;
        let r = c.extend(&rows(3, 3), 3)?; // positions 3..6, wraps slots 3, 0, 1
        assert_eq!(r.base, 0);
        assert_eq!(r.indices[2], vec![2, 3, 4, 5]); // p = 5 sees 2..=5
        let ring: Vec<f32> = c.ring().narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
        assert_eq!(ring, vec![5.0, 6.0, 3.0, 4.0]);
        Ok(())
    }
}
