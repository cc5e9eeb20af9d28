//! The window insert of the fused (device) layer path: the call's window KV written by the fused
//! insert kernels into the ring, bf16 rows ([`crate::cuda::window_insert`]) or packed format-A
//! pages ([`crate::cuda::packed_insert`]), and the rows and per-query indices the call's
//! queries attend to, as device tensors.

use candle_core::{DType, Device, Result, Tensor};

use super::WindowCache;
use crate::cuda::{KvRows, PackedLayout};

/// The window source of one call on the fused (device) path: rows and per-query indices as
/// device tensors, ready for [`crate::cuda::SparseAttentionInputs`].
#[derive(Debug, Clone)]
pub struct WindowSource {
    /// The rows attended to: `[n, head_dim]` bf16 (the ring itself for decode, or the call's
    /// window rows), or for packed storage `[pages, page_bytes]` u8 format-A pages.
    pub kv: Tensor,
    /// `Some` when `kv` is packed.
    pub packing: Option<PackedLayout>,
    /// `[T, window]` i64 indices into `kv` (rows or slots) per query (ascending positions,
    /// −1 = none).
    pub indices: Tensor,
    /// Row (slot) of `kv` holding this call's first window-KV row; its T rows follow.
    pub first_row: usize,
    /// T, the call's tokens.
    pub tokens: usize,
}

impl WindowSource {
    /// `kv` as a source of [`crate::cuda::SparseAttentionInputs`].
    pub fn kv_rows(&self) -> KvRows<'_> {
        match self.packing {
            None => KvRows::Bf16(&self.kv),
            Some(p) => KvRows::Packed(&self.kv, p),
        }
    }

    /// `[T, head_dim]` bf16: this call's window-KV rows (RoPE'd, Q1-fake-quantized); packed
    /// storage: dequantized (a host round trip, exact), e.g. for a trace.
    pub fn call_rows(&self) -> Result<Tensor> {
        match &self.packing {
            None => self.kv.narrow(0, self.first_row, self.tokens),
            Some(p) => p.unpack_rows(&self.kv, self.first_row..self.first_row + self.tokens, DType::BF16),
        }
    }
}

/// `[4W − 1]` i64 on `dev`: `[−1 × (W − 1), 0, 1, …, W − 1]` followed by `[0, …, W − 1, 0, …, W − 1]`,
/// the table [`decode_views`] cuts a decode token's ring slot and window indices from.
fn decode_table(w: usize, dev: &Device) -> Result<Tensor> {
    let w = w as i64;
    let table: Vec<i64> = (0..w - 1).map(|_| -1).chain(0..w).chain(0..w).chain(0..w).collect();
    Tensor::from_vec(table, 4 * w as usize - 1, dev)
}

/// Views of [`decode_table`] for a decode token at position `p`: its ring slot `[1]` (`p mod W`)
/// and its window indices `[1, W]` i64, the ring slots of positions `max(0, p − W + 1) ..= p` in
/// ascending order, led by −1 for the missing positions while `p < W − 1` (the attention drops
/// holes and keeps the order of the rest).
fn decode_views(table: &Tensor, p: usize, w: usize) -> Result<(Tensor, Tensor)> {
    let ring = 2 * w - 1; // where the two ring runs start
    let slot = table.narrow(0, ring + p % w, 1)?;
    let indices = if p + 1 < w { table.narrow(0, p, w)? } else { table.narrow(0, ring + (p + 1) % w, w)? };
    Ok((slot, indices.reshape((1, w))?))
}

/// `[T, W]` i64: `d[t, k] = t + k − (W − 1)`, the k-th window position of query t relative to the
/// call's start (negative: a position before the call).
fn window_offsets(t: usize, w: usize, dev: &Device) -> Result<Tensor> {
    let tt = Tensor::arange(0i64, t as i64, dev)?.reshape((t, 1))?;
    let kk = Tensor::arange(0i64, w as i64, dev)?.reshape((1, w))?;
    tt.broadcast_add(&kk)?.affine(1.0, 1.0 - w as f64)
}

impl WindowCache {
    /// Inserts the window KV of the tokens at `start .. start + T` with the fused insert kernel
    /// of the ring's storage (RoPE at `cos`/`sin`, then Q1: [`crate::cuda::window_insert`] with
    /// `fake_quant` for bf16 rows, [`crate::cuda::packed_insert`] in format A for a packed ring)
    /// and returns the rows and indices the queries attend to.
    ///
    /// * `kv`: `[T, head_dim]` bf16, the `kv_norm`'ed window KV (pre-RoPE).
    /// * `cos`, `sin`: `[T, rope_dim/2]` f32 angles of the tokens' positions.
    ///
    /// Decode (`T = 1`) writes straight into the ring and attends over it (indices = ring slots).
    /// A longer call (any length, also beyond W) with bf16 rows writes its rows after a copy of
    /// the ring rows still in the window (one buffer of `≤ W − 1 + T` rows), attends over that,
    /// then copies its last `min(T, W)` rows into the ring; with a packed ring it writes its rows
    /// after a copy of the ring's pages (slots `ring slots ..`), attends over that, then inserts
    /// its last `min(T, W)` rows into the ring at `p mod W`. Indices are computed on the device
    /// from two `arange`s (no per-token host work) and name the same positions as
    /// [`WindowCache::extend`]'s.
    pub fn insert_fused(&mut self, kv: &Tensor, start: usize, cos: &Tensor, sin: &Tensor, fake_quant: bool) -> Result<WindowSource> {
        let (t, d) = kv.dims2()?;
        let ring_d = match &self.packing {
            Some(p) => p.head_dim(),
            None => self.ring.dim(1)?,
        };
        if d != ring_d {
            candle_core::bail!("WindowCache: row width {d} != cache width {ring_d}")
        }
        if let Some(p) = self.packing {
            return self.insert_packed(p, kv, start, cos, sin);
        }
        let w = self.window;
        let dev = self.ring.device().clone();
        if t == 1 {
            let (slot, indices) = self.decode_views(start)?;
            crate::cuda::window_insert(&self.ring, kv, cos, sin, &slot, fake_quant)?;
            return Ok(WindowSource { kv: self.ring.clone(), packing: None, indices, first_row: start % w, tokens: 1 });
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
        // Query t's k-th position start + d[t, k] is buffer row d + start − base; negative ones
        // are positions before 0 (only when base = 0) and become −1.
        let indices = window_offsets(t, w, &dev)?.affine(1.0, (start - base) as f64)?.maximum(-1i64)?;
        self.store(&buf.narrow(0, n_old, t)?, start)?;
        Ok(WindowSource { kv: buf, packing: None, indices, first_row: n_old, tokens: t })
    }

    /// The decode token's ring slot and window indices at position `p` (see [`decode_views`]),
    /// from the cache's decode table (built on the ring's device at the first call).
    fn decode_views(&mut self, p: usize) -> Result<(Tensor, Tensor)> {
        let w = self.window;
        let table = match &self.decode_table {
            Some(t) => t.clone(),
            None => {
                let t = decode_table(w, self.ring.device())?;
                self.decode_table = Some(t.clone());
                t
            }
        };
        decode_views(&table, p, w)
    }

    /// [`WindowCache::insert_fused`] for a packed (format A) ring.
    fn insert_packed(&mut self, p: PackedLayout, kv: &Tensor, start: usize, cos: &Tensor, sin: &Tensor) -> Result<WindowSource> {
        let t = kv.dim(0)?;
        let w = self.window;
        let dev = self.ring.device().clone();
        if t == 1 {
            let (slot, indices) = self.decode_views(start)?;
            crate::cuda::packed_insert(&self.ring, &p, kv, cos, sin, &slot, None)?;
            return Ok(WindowSource { kv: self.ring.clone(), packing: Some(p), indices, first_row: start % w, tokens: 1 });
        }
        // The ring's pages, then the call's rows from slot `off`.
        let ring_pages = self.ring.dim(0)?;
        let off = ring_pages * p.page_size();
        let buf = p.zeros(ring_pages + t.div_ceil(p.page_size()), &dev)?;
        buf.slice_set(&self.ring, 0, 0)?;
        let slots = Tensor::arange(off as i64, (off + t) as i64, &dev)?;
        crate::cuda::packed_insert(&buf, &p, kv, cos, sin, &slots, None)?;
        // Position q = start + d: before the call (d < 0) at ring slot q mod W =
        // (start mod W + W + d) − W·[≥ W] (the sum lies in 1 .. 2W − 1); in the call at
        // off + d; before position 0: −1.
        let d = window_offsets(t, w, &dev)?;
        let old = d.affine(1.0, (start % w + w) as f64)?;
        let old = (&old - old.ge(w as i64)?.to_dtype(DType::I64)?.affine(w as f64, 0.0)?)?;
        let new = d.affine(1.0, off as f64)?;
        let idx = d.lt(0i64)?.where_cond(&old, &new)?;
        let none = Tensor::full(-1i64, (t, w), &dev)?;
        let indices = d.affine(1.0, start as f64)?.lt(0i64)?.where_cond(&none, &idx)?;
        // The ring keeps the call's last min(T, W) rows at p mod W (written after the copy).
        let ring_slots: Vec<i64> = (0..t).map(|i| if i + w >= t { ((start + i) % w) as i64 } else { -1 }).collect();
        crate::cuda::packed_insert(&self.ring, &p, kv, cos, sin, &Tensor::new(ring_slots, &dev)?, None)?;
        Ok(WindowSource { kv: buf, packing: Some(p), indices, first_row: off, tokens: t })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decode views name, for every position, what the definition says: the ring slots of
    /// the last `min(p + 1, W)` positions in ascending order, −1 for the rest, and slot p mod W.
    #[test]
    fn decode_views_are_the_window_of_each_position() -> Result<()> {
        for w in [1usize, 2, 5, 128] {
            let table = decode_table(w, &Device::Cpu)?;
            for p in 0..3 * w + 2 {
                let (slot, indices) = decode_views(&table, p, w)?;
                assert_eq!(slot.to_vec1::<i64>()?, vec![(p % w) as i64], "slot, W = {w}, p = {p}");
                let got = indices.to_vec2::<i64>()?;
                let lo = (p + 1).saturating_sub(w);
                let valid: Vec<i64> = got[0].iter().copied().filter(|&i| i >= 0).collect();
                let want: Vec<i64> = (lo..=p).map(|q| (q % w) as i64).collect();
                assert_eq!(valid, want, "W = {w}, p = {p}: {:?}", got[0]);
                assert_eq!(got[0].len(), w);
                assert!(got[0].iter().all(|&i| i >= -1), "W = {w}, p = {p}: {:?}", got[0]);
            }
        }
        Ok(())
    }
}
