//! Restoring a layer's cache state from given rows (issue 6): resuming a saved sequence, or
//! giving a layer a long synthetic context for benchmarks without running the prefill.

use candle_core::{Result, Tensor};

use super::cache::{RowStore, SequenceCache};
use super::compressor::CompressorCarry;

impl SequenceCache {
    /// Replaces the state of `layer` as if `next_pos` tokens had been processed.
    ///
    /// * `window_ring`: `[sliding_window, head_dim]`, the ring as [`super::window::WindowCache::ring`]
    ///   lays it out (slot = position mod W), in the cache's dtype and device.
    /// * `source`: for a kv source, `(compressed [N, head_dim], index_keys [N, index_head_dim])`
    ///   in the cache's dtype (copied in); `None` for other layers.
    ///
    /// The compressor carry is reset (no open group), so for a kv source `next_pos` must close
    /// its last group (`N·ratio = next_pos`); a mismatch is reported by the layer's next call.
    /// Errors if the layer is or is not a kv source against `source`, on shape mismatches, or
    /// for a cache in packed storage (restoring takes bf16 rows).
    pub fn restore_layer(
        &mut self,
        layer: usize,
        next_pos: usize,
        window_ring: &Tensor,
        source: Option<(&Tensor, &Tensor)>,
    ) -> Result<()> {
        if self.storage().is_packed() {
            candle_core::bail!("restore_layer {layer}: the cache is in packed storage; restoring takes a bf16 cache")
        }
        let state = self.layer_mut(layer)?;
        state.window.restore(window_ring)?;
        match (&mut state.source, source) {
            (Some(s), Some((compressed, keys))) => {
                if compressed.dim(0)? != keys.dim(0)? {
                    candle_core::bail!(
                        "restore_layer {layer}: {} compressed entries but {} index keys",
                        compressed.dim(0)?,
                        keys.dim(0)?
                    )
                }
                let fresh = |rows: &Tensor, like: &RowStore| -> Result<RowStore> {
                    let like = like.rows()?;
                    let mut r = RowStore::new(like.dim(1)?, like.dtype(), like.device())?;
                    r.append(rows)?;
                    Ok(r)
                };
                s.compressed = fresh(compressed, &s.compressed)?;
                s.index_keys = fresh(keys, &s.index_keys)?;
                s.carry = CompressorCarry::default();
            }
            (None, None) => {}
            (Some(_), None) => candle_core::bail!("restore_layer {layer}: a kv source needs its compressed rows and index keys"),
            (None, Some(_)) => candle_core::bail!("restore_layer {layer}: not a kv source, but rows were given"),
        }
        state.next_pos = next_pos;
        Ok(())
    }
}
