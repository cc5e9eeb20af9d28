//! The sliding-window cache of one layer (spec §4.3, §4.6): a ring of `W` rows (slot = position
//! mod W) holding the window KV rows (K = V, RoPE'd, FP8-fake-quantized in reference numerics).
//!
//! A query at position p attends to positions `max(0, p − W + 1) ..= p`, its own row included,
//! so a call first assembles "ring rows still in the window ++ this call's rows" and the per-query
//! index lists into that tensor, then stores the call's rows into the ring.

use candle_core::{DType, Device, Result, Tensor};

/// Ring of the last `window` window-KV rows of one layer and one sequence.
#[derive(Debug, Clone)]
pub struct WindowCache {
    /// `[window, head_dim]` in the activation dtype; slot s holds the latest position ≡ s mod W
    /// (zeros where never written).
    ring: Tensor,
    window: usize,
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
    /// An empty ring of `window` rows of width `head_dim`.
    pub fn new(window: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<Self> {
        if window == 0 {
            candle_core::bail!("WindowCache: sliding_window must be > 0")
        }
        Ok(Self { ring: Tensor::zeros((window, head_dim), dtype, device)?, window })
    }

    /// `[window, head_dim]`: the ring as the reference lays it out (slot = position mod W).
    pub fn ring(&self) -> &Tensor {
        &self.ring
    }

    /// Assembles the window rows for queries at `start .. start + T` (`rows`: `[T, head_dim]`,
    /// this call's window KV) and stores `rows` into the ring.
    pub fn extend(&mut self, rows: &Tensor, start: usize) -> Result<WindowRows> {
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
    /// slots (at most two contiguous runs, in-place copies).
    fn store(&mut self, rows: &Tensor, start: usize) -> Result<()> {
        let (t, w) = (rows.dim(0)?, self.window);
        let keep = t.min(w);
        let first = start + t - keep;
        let mut done = 0;
        while done < keep {
            let slot = (first + done) % w;
            let run = (w - slot).min(keep - done);
            let src = rows.narrow(0, t - keep + done, run)?.to_dtype(self.ring.dtype())?;
            self.ring.slice_set(&src.contiguous()?, 0, slot)?;
            done += run;
        }
        Ok(())
    }

    /// Replaces the ring's rows by `ring` (`[window, head_dim]`, slot = position mod W).
    pub fn restore(&mut self, ring: &Tensor) -> Result<()> {
        if ring.dims() != self.ring.dims() {
            candle_core::bail!("WindowCache::restore: ring {:?}, want {:?}", ring.shape(), self.ring.shape())
        }
        self.ring.slice_set(&ring.to_dtype(self.ring.dtype())?.to_device(self.ring.device())?.contiguous()?, 0, 0)
    }

    /// Number of rows in the ring (`sliding_window`).
    pub fn window(&self) -> usize {
        self.window
    }
}

/// The window source of one call on the fused (device) path: rows and per-query indices as
/// device tensors, ready for [`crate::cuda::sparse_attention_two_source`].
#[cfg(feature = "cuda")]
#[derive(Debug, Clone)]
pub struct WindowSource {
    /// `[n, head_dim]` bf16: the ring itself (decode) or the call's window rows.
    pub kv: Tensor,
    /// `[T, window]` i64 indices into `kv` per query (ascending positions, −1 = none).
    pub indices: Tensor,
    /// `[T, head_dim]` bf16: this call's window-KV rows (RoPE'd, Q1-fake-quantized).
    pub rows: Tensor,
}

#[cfg(feature = "cuda")]
impl WindowCache {
    /// Inserts the window KV of the tokens at `start .. start + T` with the fused window-insert
    /// kernel ([`crate::cuda::window_insert`]: RoPE at `cos`/`sin`, Q1 when `fake_quant`) and
    /// returns the rows and indices the queries attend to.
    ///
    /// * `kv`: `[T, head_dim]` bf16, the `kv_norm`'ed window KV (pre-RoPE).
    /// * `cos`, `sin`: `[T, rope_dim/2]` f32 angles of the tokens' positions.
    ///
    /// Decode (`T = 1`) writes straight into the ring and attends over it (indices = ring slots);
    /// a longer call writes its rows after a copy of the ring rows still in the window (one
    /// buffer of `≤ W − 1 + T` rows), attends over that, then copies its last `min(T, W)` rows
    /// into the ring. Indices are computed on the device from two `arange`s (no per-token host
    /// work); the values equal [`WindowCache::extend`]'s.
    pub fn insert_fused(&mut self, kv: &Tensor, start: usize, cos: &Tensor, sin: &Tensor, fake_quant: bool) -> Result<WindowSource> {
        let (t, d) = kv.dims2()?;
        let (w, ring_d) = self.ring.dims2()?;
        if d != ring_d {
            candle_core::bail!("WindowCache: row width {d} != cache width {ring_d}")
        }
        let dev = self.ring.device().clone();
        if t == 1 {
            let slot = Tensor::new(&[(start % w) as i64], &dev)?;
            crate::cuda::window_insert(&self.ring, kv, cos, sin, &slot, fake_quant)?;
            // Positions lo ..= start at their slots p mod W, ascending, −1 padded.
            let lo = start.saturating_sub(w - 1);
            let mut idx: Vec<i64> = (lo..=start).map(|p| (p % w) as i64).collect();
            idx.resize(w, -1);
            let rows = self.ring.narrow(0, start % w, 1)?;
            return Ok(WindowSource { kv: self.ring.clone(), indices: Tensor::from_vec(idx, (1, w), &dev)?, rows });
        }
        let base = start.saturating_sub(w - 1);
        let n_old = start - base;
        let buf = Tensor::zeros((n_old + t, d), self.ring.dtype(), &dev)?;
        // Ring rows of positions base .. start (at most two runs of slots).
        let mut done = 0;
        while done < n_old {
            let slot = (base + done) % w;
            let run = (w - slot).min(n_old - done);
            buf.slice_set(&self.ring.narrow(0, slot, run)?, 0, done)?;
            done += run;
        }
        let slots = Tensor::arange(n_old as i64, (n_old + t) as i64, &dev)?;
        crate::cuda::window_insert(&buf, kv, cos, sin, &slots, fake_quant)?;
        // Query t (position start + t) sees buffer rows t + k + start − W + 1 − base, k < W;
        // negative ones are positions before 0 (only when base = 0) and become −1.
        let tt = Tensor::arange(0i64, t as i64, &dev)?.reshape((t, 1))?;
        let kk = Tensor::arange(0i64, w as i64, &dev)?.reshape((1, w))?;
        let shift = start as i64 - w as i64 + 1 - base as i64;
        let indices = tt.broadcast_add(&kk)?.affine(1.0, shift as f64)?.maximum(-1i64)?;
        let rows = buf.narrow(0, n_old, t)?;
        self.store(&rows, start)?;
        Ok(WindowSource { kv: buf, indices, rows })
    }
}

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
