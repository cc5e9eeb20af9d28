//! The attention layer on the device (issue 6): the same computation as
//! [`Attention::forward`]'s reference path, with the cache writes, the query RoPE and the
//! attention done by the fused ops of [`crate::cuda`]:
//!
//! | step | device path |
//! |---|---|
//! | `wq_a`, `wkv`, `wq_b`, `wo_b` | Candle matmuls (cuBLAS) after the FP8 activation quant kernel |
//! | `q_norm`, `kv_norm`, compressor | Candle ops |
//! | window KV | [`crate::cuda::window_insert`] (RoPE + Q1) into the ring / the call's window rows; packed: [`crate::cuda::packed_insert`] (format A) |
//! | compressed KV | [`crate::cuda::compressed_insert`] (RoPE at j·r + Q2) in place into the cache; packed: `packed_insert` (format B) |
//! | index keys | `indexer.wk` (Candle matmul), then [`crate::cuda::index_key_insert`] (k_norm + RoPE at j·r + Q3) in place; packed: `packed_insert` (format E) |
//! | q RoPE, inverse RoPE | [`crate::cuda::q_rope_inplace`] |
//! | selection | [`crate::attention::selection::select`]: index scores, top-k and candidate blocks on the device ([`crate::cuda::index_select`]) |
//! | attention | [`crate::attention::sparse_attention::sparse_attention_kv_rows`] over window + compressed rows (bf16 rows or packed pages) |
//! | grouped `wo_a` | one batched Candle matmul |
//!
//! Index lists stay on the device: window indices come from two `arange`s, the compressed
//! indices are the selection's `[T, K]` tensor used as is (the kernel takes the two sources
//! without concatenating them). The ops' CPU implementations are the crate's references, so
//! this path also runs on the CPU (`Attention::forward_fused`), which is how its logic is
//! tested without a GPU.

use candle_core::{Module, Result, Tensor};

use crate::attention::cache::SequenceCache;
use crate::attention::compressor::Compressor;
use crate::attention::indexer::IndexKeyProjection;
use crate::attention::sparse_attention::sparse_attention_kv_rows;
use super::Attention;
use crate::config::AttentionRole;

/// The steps of one fused layer call, reported (in this order) to the observer of
/// [`Attention::forward_fused`] right after each step's work has been enqueued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerPhase {
    /// `wq_a` + `q_norm`, `wkv` + `kv_norm`, `wq_b` (with their activation quant).
    Projections,
    /// q RoPE, window insert, compressor, compressed-entry and index-key inserts.
    Inserts,
    /// Index queries, scores and top-k (index sources), or reading the published top-k.
    Selection,
    /// Sparse attention over window + compressed rows.
    Attention,
    /// Inverse RoPE, grouped `wo_a`, `wo_b`.
    Output,
}

impl Attention {
    /// [`Attention::forward`] through the fused ops of [`crate::cuda`] (what `forward` runs for
    /// inputs on a CUDA device, and for a packed cache on any device); on the CPU the ops'
    /// reference implementations run instead.
    ///
    /// `x`: `[T, hidden]` bf16; the cache's rows must be bf16 or packed
    /// ([`crate::attention::CacheStorage`]; packed needs `Numerics::cache_fake_quant`, else an
    /// error). With either storage the results are bit for bit the same wherever both run the same
    /// sparse-attention kernel (the all-heads kernel: prefill, large batches, short index lists);
    /// for bf16 rows the decode of a few tokens at head_dim 512 runs the dims-split pair instead
    /// (the same numerics model, f32 sums in another order). `observe` is called once per
    /// [`LayerPhase`] after the phase's work has been enqueued (a profiler synchronizes the
    /// device there; pass `&mut |_| {}` otherwise). Returns `[T, hidden]` bf16.
    pub fn forward_fused(
        &self,
        x: &Tensor,
        start: usize,
        cache: &mut SequenceCache,
        observe: &mut dyn FnMut(LayerPhase),
    ) -> Result<Tensor> {
        let l = self.layer;
        let t = x.dim(0)?;
        let expected = cache.layer(l)?.next_pos;
        if start != expected {
            candle_core::bail!("layer {l}: call starts at position {start}, but the cache holds {expected} tokens")
        }
        if t == 0 {
            candle_core::bail!("layer {l}: empty call (no token) at position {start}")
        }
        let fq = self.numerics.cache_fake_quant;
        if cache.storage().is_packed() && !fq {
            candle_core::bail!(
                "layer {l}: packed cache storage needs Numerics.cache_fake_quant = true (the packed formats A/B/E are the Q1/Q2/Q3 cache quantization), got false"
            )
        }
        let positions: Vec<usize> = (start..start + t).collect();
        let crate::nn::RopeRows { cos, sin, neg_sin } = self.rope.rows(&positions)?;

        // wq_a and wkv: one stacked FP8 product where it applies (nn::LinearPair).
        let (qa, kva) = self.wq_a_wkv.forward(x)?;
        let qr = self.q_norm.forward(&qa)?;
        let kv = self.kv_norm.forward(&kva)?;
        let q = self.wq_b.forward(&qr)?.reshape((t, self.n_heads, self.head_dim))?;
        observe(LayerPhase::Projections);

        crate::cuda::q_rope_inplace(&q, &cos, &sin, None)?;
        let window = cache.layer_mut(l)?.window.insert_fused(&kv, start, &cos, &sin, fq)?;
        if cache.is_tracing() {
            cache.record(|| format!("L{l}.window_kv"), &window.call_rows()?.copy()?);
        }
        if let (AttentionRole::Compressed { ratio, .. }, Some(c), Some(kp)) =
            (self.role, &self.compressor, &self.key_projection)
        {
            self.compress_fused(x, start, ratio, c, kp, cache)?;
        }
        observe(LayerPhase::Inserts);

        let selected = match self.role {
            AttentionRole::WindowOnly => None,
            AttentionRole::Compressed { kv_source, topk, .. } => {
                let selected =
                    crate::attention::selection::select(l, topk, self.indexer.as_ref(), x, &qr, &positions, &self.rope, cache)?;
                if cache.is_tracing() {
                    cache.record(|| format!("L{l}.topk"), &selected);
                }
                Some((cache.source(kv_source)?.compressed.stored_rows()?, selected))
            }
        };
        cache.layer_mut(l)?.next_pos = start + t;
        observe(LayerPhase::Selection);

        let scale = (self.head_dim as f32).powf(-0.5);
        let none = window.indices.narrow(1, 0, 0)?;
        let (extra, idx_extra) = match &selected {
            Some((rows, idx)) => (rows.kv_rows(), idx),
            None => (window.kv_rows(), &none),
        };
        let o = sparse_attention_kv_rows(&q, window.kv_rows(), &window.indices, extra, idx_extra, &self.attn_sink, scale)?;
        observe(LayerPhase::Attention);

        crate::cuda::q_rope_inplace(&o, &cos, &neg_sin, None)?;
        let out = self.output(&o)?;
        observe(LayerPhase::Output);
        Ok(out)
    }

    /// The compressor of this kv source, then its entries and index keys written in place into
    /// the source's cache (device counterpart of `Attention::compress`).
    fn compress_fused(
        &self,
        x: &Tensor,
        start: usize,
        ratio: usize,
        compressor: &Compressor,
        keys: &IndexKeyProjection,
        cache: &mut SequenceCache,
    ) -> Result<()> {
        let Some(lat) = self.closed_groups(x, start, compressor, cache)? else { return Ok(()) };
        let g = lat.latent.dim(0)?;
        let source = cache.source_mut(self.layer)?;
        let k_pre = keys.project(&lat.latent)?;
        let positions: Vec<usize> = (0..g).map(|i| (lat.first_entry + i) * ratio).collect();
        let (cos, sin) = self.rope.cos_sin(&positions)?;
        let fq = self.numerics.cache_fake_quant;
        let norm = keys.k_norm();
        let packing = source.compressed.packing();
        source.compressed.append_in_place(g, |buf, first| {
            let slots = Tensor::arange(first as i64, (first + g) as i64, buf.device())?;
            match &packing {
                None => crate::cuda::compressed_insert(buf, &lat.latent, &cos, &sin, &slots, fq),
                Some(p) => crate::cuda::packed_insert(buf, p, &lat.latent, &cos, &sin, &slots, None),
            }
        })?;
        let packing = source.index_keys.packing();
        source.index_keys.append_in_place(g, |buf, first| {
            let slots = Tensor::arange(first as i64, (first + g) as i64, buf.device())?;
            match &packing {
                None => crate::cuda::index_key_insert(buf, &k_pre, norm.weight(), norm.eps(), &cos, &sin, &slots, fq),
                Some(p) => crate::cuda::packed_insert(buf, p, &k_pre, &cos, &sin, &slots, Some((norm.weight(), norm.eps()))),
            }
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::nn::RandomWeights;
    use crate::numerics::Numerics;

    /// Every layer of the tiny config with random weights, run over `calls` (chunk lengths)
    /// through the reference path or the fused path; returns each layer's outputs.
    fn run(fused: bool, calls: &[usize], xs: &[Tensor]) -> Result<Vec<Tensor>> {
        let cfg = crate::test_util::tiny_config();
        let vb = RandomWeights::new(11).var_builder(DType::BF16, &Device::Cpu);
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| Attention::new(&cfg, l, Numerics::REFERENCE, vb.pp("layers").pp(l).pp("attn")))
            .collect::<Result<Vec<_>>>()?;
        let mut cache = SequenceCache::new(&cfg, DType::BF16, &Device::Cpu)?;
        let mut outs = vec![Vec::new(); layers.len()];
        let mut start = 0;
        for &n in calls {
            for (l, a) in layers.iter().enumerate() {
                let x = xs[l].narrow(0, start, n)?;
                let y = if fused { a.forward_fused(&x, start, &mut cache, &mut |_| {})? } else { a.forward(&x, start, &mut cache)? };
                outs[l].push(y);
            }
            start += n;
        }
        outs.iter().map(|o| Tensor::cat(o, 0)).collect()
    }

    #[test]
    fn fused_path_equals_the_reference_on_the_cpu() -> Result<()> {
        let cfg = crate::test_util::tiny_config();
        let n = 3 * cfg.sliding_window + 5;
        let xs = (0..cfg.num_hidden_layers)
            .map(|_| Tensor::randn(0f32, 1.0, (n, cfg.hidden_size), &Device::Cpu)?.to_dtype(DType::BF16))
            .collect::<Result<Vec<_>>>()?;
        let mut decode = vec![cfg.sliding_window + 3];
        decode.resize(decode.len() + n - decode[0], 1);
        for calls in [vec![n], vec![5, 2 * cfg.sliding_window + 1, n - 6 - 2 * cfg.sliding_window], decode] {
            let want = run(false, &calls, &xs)?;
            let got = run(true, &calls, &xs)?;
            for (l, (g, w)) in got.iter().zip(&want).enumerate() {
                let (g, w) = (g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                assert!(g.iter().any(|&v| v != 0.0), "layer {l}: all zeros");
                assert_eq!(g, w, "layer {l}, calls {calls:?}");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "layer_packed_tests.rs"]
mod packed_tests;
