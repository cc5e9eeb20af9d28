//! The lightning indexer (spec §6): index keys of kv sources, index scores, visibility, candidate
//! blocks and the top-k of index sources.
//!
//! Scores follow the reference's bf16 arithmetic (§0.1b.1):
//! `S[t,j] = bf16(Σ_h bf16(ReLU(bf16(q_I[t,h]·K[j])) · w[t,h]))` with
//! `w = bf16(bf16(weights_proj(x)) · d_I^-½ · H_I^-½)`. Entry j is visible to the query at
//! position p iff `j < (p+1) div r`; a selected entry that is not visible becomes −1 (§0.1b.2).
//! Ties are broken towards the lower entry id, so prefill, chunked prefill and decode agree.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::cache::RowStore;
use crate::config::{CandidateRole, Config};
use crate::nn::linear::{named, NamedLinears};
use crate::nn::{Linear, LinearKind, RmsNorm, RopeTable, RowGroups};
use crate::numerics::Numerics;
use crate::quant::fake_quant::{fake_quant, QatFormat};

/// Key projection of an index-key owner (kv source): `indexer.{wk, k_norm}`.
#[derive(Debug, Clone)]
pub struct IndexKeyProjection {
    wk: Linear,
    k_norm: RmsNorm,
    numerics: Numerics,
}

impl IndexKeyProjection {
    /// Loads `indexer.wk` `[d_I, head_dim]` and `indexer.k_norm` `[d_I]` from `vb` (= `attn.indexer`).
    pub fn new(cfg: &Config, numerics: Numerics, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            wk: Linear::new(cfg.head_dim, cfg.index_head_dim, LinearKind::Plain, numerics, vb.pp("wk"))?,
            k_norm: RmsNorm::new(cfg.index_head_dim, cfg.rms_norm_eps, vb.pp("k_norm"))?,
            numerics,
        })
    }

    /// The pre-norm keys `latent·wkᵀ` `[G, d_I]` of latents `[G, head_dim]`, in the latents' dtype
    /// (the input of a fused norm + RoPE + quant insert such as `cuda::index_key_insert`).
    pub fn project(&self, latent: &Tensor) -> Result<Tensor> {
        self.wk.forward(latent)
    }

    /// [`Self::project`] of the latents of several sequences split as `groups`: on the CPU each
    /// sequence's rows get the bits of its own call ([`Linear::forward_grouped`]).
    pub fn project_grouped(&self, latent: &Tensor, groups: &RowGroups) -> Result<Tensor> {
        self.wk.forward_grouped(latent, groups)
    }

    /// The `k_norm` applied after [`Self::project`].
    pub fn k_norm(&self) -> &RmsNorm {
        &self.k_norm
    }

    /// Index keys of latents `[G, head_dim]` (pre-RoPE) whose row g is entry `first_entry + g`:
    /// `fq_Q3(RoPE(j·r)(k_norm(latent·wkᵀ)))`, `[G, d_I]` in the latents' dtype.
    pub fn keys(&self, latent: &Tensor, first_entry: usize, ratio: usize, rope: &RopeTable) -> Result<Tensor> {
        let k = self.k_norm.forward(&self.project(latent)?)?;
        let positions: Vec<usize> = (0..latent.dim(0)?).map(|g| (first_entry + g) * ratio).collect();
        let k = rope.apply(&k, &positions, false)?;
        if self.numerics.cache_fake_quant {
            fake_quant(&k, QatFormat::Fp4Ue8m0B32)
        } else {
            Ok(k)
        }
    }

    /// The key projection with its checkpoint prefix (`wk`).
    pub fn linears(&self) -> NamedLinears<'_> {
        named([("wk", &self.wk)])
    }
}

/// Candidate blocks published by the candidate source for the tokens of one call (spec §6.4).
#[derive(Debug, Clone)]
pub struct Candidates {
    /// Entries per block.
    pub block: usize,
    /// `[T, n_keep]` i64 on the activations' device: per token the kept block ids ascending,
    /// −1 padded.
    pub kept: Tensor,
}

impl Candidates {
    /// Host copy of the kept block ids per token (ascending, padding dropped).
    pub fn kept_rows(&self) -> Result<Vec<Vec<usize>>> {
        Ok(self
            .kept
            .to_device(&candle_core::Device::Cpu)?
            .to_dtype(DType::I64)?
            .to_vec2::<i64>()?
            .into_iter()
            .map(|r| r.into_iter().filter(|&b| b >= 0).map(|b| b as usize).collect())
            .collect())
    }
}

/// Shape of the candidate blocks a candidate source publishes: `block` entries per block,
/// `n_keep` blocks kept per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CandidateShape {
    /// Entries per block (`candidate_block_size`).
    pub block: usize,
    /// Blocks kept per token (`candidate_topk_blocks`).
    pub n_keep: usize,
}

/// The output of an index source for one call, on the activations' device.
#[derive(Debug, Clone)]
pub struct Selection {
    /// `[T, index_topk]` i64: per token the selected entry ids ascending, `-1` padded.
    pub topk: Tensor,
    /// Published candidate blocks (candidate source only).
    pub candidates: Option<Candidates>,
}

/// The CPU reference of a selection: from unmasked score rows `[T][N]` (of [`index_scores`])
/// and the visible entries per token, the top `k` ([`top_k`]) after masking invisible entries
/// and, for consumers, entries outside `consume`'s blocks; for a candidate source (`publish`)
/// also its [`candidate_blocks`] (from the scores before any consumer mask). The tensors are
/// created on `device`.
pub fn reference_selection(
    scores: Vec<Vec<f32>>,
    visible: &[usize],
    k: usize,
    consume: Option<&Candidates>,
    publish: Option<CandidateShape>,
    device: &candle_core::Device,
) -> Result<Selection> {
    if scores.len() != visible.len() {
        candle_core::bail!("reference_selection: {} score rows but {} visible counts", scores.len(), visible.len())
    }
    let allowed = consume.map(|c| c.kept_rows().map(|rows| (c.block, rows))).transpose()?;
    if let Some((_, rows)) = &allowed {
        if rows.len() != scores.len() {
            candle_core::bail!("reference_selection: candidates for {} tokens, scores for {}", rows.len(), scores.len())
        }
    }
    let (mut topk, mut kept) = (Vec::with_capacity(scores.len()), Vec::new());
    for (t, (row, &vis)) in scores.into_iter().zip(visible).enumerate() {
        let mut s = mask_invisible(row, vis);
        if let Some(shape) = publish {
            let mut b: Vec<i64> =
                candidate_blocks(&s, vis, shape.block, shape.n_keep).into_iter().map(|b| b as i64).collect();
            b.resize(shape.n_keep.max(b.len()), -1);
            kept.push(b);
        }
        if let Some((block, rows)) = &allowed {
            mask_outside_blocks(&mut s, *block, &rows[t]);
        }
        topk.push(top_k(&s, k, vis));
    }
    let t = topk.len();
    let topk = Tensor::from_vec(topk.concat(), (t, k), device)?;
    let candidates = match publish {
        Some(shape) => {
            Some(Candidates { block: shape.block, kept: Tensor::from_vec(kept.concat(), (t, shape.n_keep), device)? })
        }
        None => None,
    };
    Ok(Selection { topk, candidates })
}

/// `attn.indexer` query side of an index source.
#[derive(Debug, Clone)]
pub struct Indexer {
    wq_b: Linear,
    weights_proj: Linear,
    n_heads: usize,
    head_dim: usize,
    topk: usize,
    ratio: usize,
    candidates: CandidateRole,
    cand_blocks: usize,
    cand_block_size: usize,
    numerics: Numerics,
}

impl Indexer {
    /// Loads `indexer.wq_b` `[H_I·d_I, q_lora]` and `indexer.weights_proj` `[H_I, hidden]`
    /// from `vb` (= `attn.indexer`).
    pub fn new(cfg: &Config, ratio: usize, candidates: CandidateRole, numerics: Numerics, vb: VarBuilder) -> Result<Self> {
        let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
        Ok(Self {
            wq_b: Linear::new(cfg.q_lora_rank, hi * di, LinearKind::Quantized, numerics, vb.pp("wq_b"))?,
            weights_proj: Linear::new(cfg.hidden_size, hi, LinearKind::Plain, numerics, vb.pp("weights_proj"))?,
            n_heads: hi,
            head_dim: di,
            topk: cfg.index_topk,
            ratio,
            candidates,
            cand_blocks: cfg.candidate_topk_blocks,
            cand_block_size: cfg.candidate_block_size,
            numerics,
        })
    }

    /// `indexer.wq_b` `[H_I·d_I, q_lora]`.
    pub fn wq_b(&self) -> &Linear {
        &self.wq_b
    }

    /// Replaces `indexer.wq_b` by the same weight held elsewhere (the view of a stacked pair,
    /// `nn::LinearPair`).
    pub(super) fn set_wq_b(&mut self, wq_b: Linear) {
        self.wq_b = wq_b;
    }

    /// `indexer.weights_proj` `[H_I, hidden]`.
    pub fn weights_proj(&self) -> &Linear {
        &self.weights_proj
    }

    /// Number of candidate blocks kept per token (`candidate_topk_blocks`).
    pub fn candidate_topk_blocks(&self) -> usize {
        self.cand_blocks
    }

    /// Index queries `[T, H_I, d_I]`: `fq_Q3(RoPE(p)(qr·wq_bᵀ))`.
    pub fn queries(&self, qr: &Tensor, positions: &[usize], rope: &RopeTable) -> Result<Tensor> {
        let t = qr.dim(0)?;
        let q = self.wq_b.forward(qr)?.reshape((t, self.n_heads, self.head_dim))?;
        let q = rope.apply(&q, positions, false)?;
        if self.numerics.cache_fake_quant {
            fake_quant(&q, QatFormat::Fp4Ue8m0B32)
        } else {
            Ok(q)
        }
    }

    /// Head weights `[T, H_I]` (bf16 values): `bf16(weights_proj(x)) · d_I^-½ · H_I^-½`.
    pub fn head_weights(&self, x: &Tensor) -> Result<Tensor> {
        self.head_weights_grouped(x, &RowGroups::whole(x.dim(0)?))
    }

    /// [`Self::head_weights`] of the rows of several sequences split as `groups` (on the CPU each
    /// sequence's rows get the bits of its own call, [`Linear::forward_grouped`]).
    pub fn head_weights_grouped(&self, x: &Tensor, groups: &RowGroups) -> Result<Tensor> {
        let scale = (self.head_dim as f64).powf(-0.5) * (self.n_heads as f64).powf(-0.5);
        let w = self.weights_proj.forward_grouped(x, groups)?;
        #[cfg(feature = "cuda")]
        if crate::cuda::fused_kernels(w.device()) && !crate::cuda::unfused("scale_round") && matches!(w.dtype(), DType::BF16 | DType::F32) {
            // One launch, bit for bit the ops below.
            return crate::cuda::scale_round_device(&w, scale);
        }
        (w.to_dtype(DType::F32)? * scale)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)
    }

    /// Selects the top-k of the call's tokens, on `x`'s device (CUDA: the indexer kernels of
    /// `cuda::index_select`; CPU: [`reference_selection`]).
    ///
    /// `x`: `[T, hidden]` attn-normed input; `qr`: `[T, q_lora]` q-LoRA activation; positions of
    /// the tokens; `keys`: the key owner's index-key store (its N `[N, d_I]` entries, written
    /// this call included; bf16 rows or packed MXFP4 pages: on CUDA the kernels read either, the
    /// CPU reference scores the dequantized rows); `published`: the candidate source's blocks for
    /// these tokens (consumers only).
    pub fn select(
        &self,
        x: &Tensor,
        qr: &Tensor,
        positions: &[usize],
        keys: &RowStore,
        rope: &RopeTable,
        published: Option<&Candidates>,
    ) -> Result<Selection> {
        let q = self.queries(qr, positions, rope)?;
        let w = self.head_weights(x)?;
        let consume = match self.candidates {
            CandidateRole::Consume { source } => Some(published.ok_or_else(|| {
                candle_core::Error::Msg(format!("indexer: candidates of layer {source} were not published"))
            })?),
            _ => None,
        };
        let publish = (self.candidates == CandidateRole::Publish)
            .then_some(CandidateShape { block: self.cand_block_size, n_keep: self.cand_blocks });
        #[cfg(feature = "cuda")]
        if crate::cuda::fused_kernels(x.device()) {
            let stored = keys.stored_rows()?;
            return crate::cuda::select_on_device(&q, &w, stored.index_keys(), keys.len(), positions, self.ratio, self.topk, consume, publish);
        }
        let visible: Vec<usize> = positions.iter().map(|&p| (p + 1) / self.ratio).collect();
        reference_selection(index_scores(&q, &w, &keys.rows()?)?, &visible, self.topk, consume, publish, x.device())
    }

    /// The query-side projections with their checkpoint prefixes (`wq_b`, `weights_proj`).
    pub fn linears(&self) -> NamedLinears<'_> {
        named([("wq_b", &self.wq_b), ("weights_proj", &self.weights_proj)])
    }
}

/// Index scores `[T][N]` (bf16 values as f32) of queries `q` `[T, H_I, d_I]`, head weights `w`
/// `[T, H_I]` and keys `[N, d_I]`, in the reference's bf16 arithmetic. No masking.
pub fn index_scores(q: &Tensor, w: &Tensor, keys: &Tensor) -> Result<Vec<Vec<f32>>> {
    let (t, h, d) = q.dims3()?;
    let n = keys.dim(0)?;
    if n == 0 {
        return Ok(vec![Vec::new(); t]);
    }
    let keys = keys.to_dtype(DType::F32)?;
    let w = w.to_dtype(DType::F32)?;
    // Bound the [chunk, H, N] intermediate for long contexts.
    let chunk = (1usize << 24).div_ceil(h * n).clamp(1, t.max(1));
    let mut out = Vec::with_capacity(t);
    for c0 in (0..t).step_by(chunk) {
        let c = chunk.min(t - c0);
        let qc = q.narrow(0, c0, c)?.to_dtype(DType::F32)?.reshape((c * h, d))?;
        let s = qc.matmul(&keys.t()?)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.relu()?;
        let s = s.reshape((c, h, n))?.broadcast_mul(&w.narrow(0, c0, c)?.unsqueeze(2)?)?;
        let s = s.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.sum(1)?.to_dtype(DType::BF16)?;
        out.extend(s.to_dtype(DType::F32)?.to_vec2::<f32>()?);
    }
    Ok(out)
}

/// Sets the scores of entries `j >= visible` to −inf.
pub fn mask_invisible(mut row: Vec<f32>, visible: usize) -> Vec<f32> {
    row.iter_mut().skip(visible).for_each(|v| *v = f32::NEG_INFINITY);
    row
}

/// Sets to −inf the scores of entries whose block (`j / block`) is not in `kept` (ascending
/// block ids): a candidate consumer's mask (spec §6.4).
pub fn mask_outside_blocks(row: &mut [f32], block: usize, kept: &[usize]) {
    for (j, v) in row.iter_mut().enumerate() {
        if kept.binary_search(&(j / block)).is_err() {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// Descending score order, ties towards the lower index.
fn order(scores: &[f32]) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..scores.len()).collect();
    ids.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    ids
}

/// The top `k` entries of one query's masked scores: the best `min(k, N)` ids, those `>= visible`
/// replaced by −1, valid ids ascending, padded with −1 to `k`.
pub fn top_k(scores: &[f32], k: usize, visible: usize) -> Vec<i64> {
    let mut ids: Vec<i64> =
        order(scores).into_iter().take(k).filter(|&j| j < visible).map(|j| j as i64).collect();
    ids.sort_unstable();
    ids.resize(k, -1);
    ids
}

/// Candidate blocks of one query (spec §6.4): block score = max of its entries (−inf padded), the
/// newest visible entry's block pinned, the best `n_keep` blocks, only finite ones kept. Returns
/// kept block ids ascending.
pub fn candidate_blocks(masked: &[f32], visible: usize, block: usize, n_keep: usize) -> Vec<usize> {
    let n_blocks = masked.len().div_ceil(block);
    let mut beta: Vec<f32> =
        (0..n_blocks).map(|b| masked[b * block..((b + 1) * block).min(masked.len())].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))).collect();
    if visible >= 1 {
        beta[(visible - 1) / block] = f32::INFINITY;
    }
    let mut kept: Vec<usize> =
        order(&beta).into_iter().take(n_keep).filter(|&b| beta[b] > f32::NEG_INFINITY).collect();
    kept.sort_unstable();
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_pads_masks_and_breaks_ties_low() {
        let s = [0.5, 2.0, 2.0, -1.0, f32::NEG_INFINITY];
        assert_eq!(top_k(&s, 2, 4), vec![1, 2]);
        assert_eq!(top_k(&[1.0, 1.0, 1.0], 2, 3), vec![0, 1]);
        // Short context: every visible entry, the rest −1.
        assert_eq!(top_k(&[0.1, f32::NEG_INFINITY], 4, 1), vec![0, -1, -1, -1]);
        assert_eq!(top_k(&[], 3, 0), vec![-1, -1, -1]);
    }

    #[test]
    fn candidate_blocks_pin_the_newest_partial_block() {
        // 7 visible of 8 entries, blocks of 2: block 3 is partial and pinned despite low scores.
        let mut s = vec![5.0, 0.0, 1.0, 1.0, 9.0, 0.0, -3.0, 0.0];
        s = mask_invisible(s, 7);
        assert_eq!(candidate_blocks(&s, 7, 2, 2), vec![2, 3]);
        // Only finite blocks are kept.
        let s = mask_invisible(vec![1.0; 8], 2);
        assert_eq!(candidate_blocks(&s, 2, 2, 3), vec![0]);
    }

    #[test]
    fn scores_match_brute_force_in_bf16() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (3, 2, 8), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::randn(0f32, 1.0, (3, 2), &dev)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        let k = Tensor::randn(0f32, 1.0, (5, 8), &dev)?.to_dtype(DType::BF16)?;
        let got = index_scores(&q, &w, &k)?;
        let (qv, wv, kv) = (q.to_dtype(DType::F32)?.to_vec3::<f32>()?, w.to_vec2::<f32>()?, k.to_dtype(DType::F32)?.to_vec2::<f32>()?);
        let bf = |x: f32| half::bf16::from_f32(x).to_f32();
        for t in 0..3 {
            for j in 0..5 {
                let want = bf((0..2)
                    .map(|h| bf(bf(qv[t][h].iter().zip(&kv[j]).map(|(a, b)| a * b).sum::<f32>()).max(0.0) * wv[t][h]))
                    .sum());
                assert_eq!(got[t][j], want, "t{t} j{j}");
            }
        }
        Ok(())
    }

    #[test]
    fn reference_selection_publishes_and_consumes_device_tensors() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        // Two tokens, 6 entries; token 0 sees 5 entries, token 1 sees 6.
        let scores = vec![vec![0.5, 3.0, 1.0, 2.0, -1.0, 9.0], vec![4.0, 0.0, 1.0, 1.0, 2.0, 5.0]];
        let shape = CandidateShape { block: 2, n_keep: 2 };
        let sel = reference_selection(scores.clone(), &[5, 6], 2, None, Some(shape), &dev)?;
        assert_eq!(sel.topk.to_vec2::<i64>()?, vec![vec![1, 3], vec![0, 5]]);
        let c = sel.candidates.expect("a candidate source publishes");
        // Token 0: block 2 (entry 4, newest visible) pinned, then block 0 (max 3.0) over 1 (2.0).
        assert_eq!(c.kept.to_vec2::<i64>()?, vec![vec![0, 2], vec![0, 2]]);
        // A consumer restricted to those blocks: token 0 may use entries 0, 1, 4; token 1 0, 1, 4, 5.
        let cons = reference_selection(scores, &[5, 6], 3, Some(&c), None, &dev)?;
        assert_eq!(cons.topk.to_vec2::<i64>()?, vec![vec![0, 1, 4], vec![0, 4, 5]]);
        assert!(cons.candidates.is_none());
        Ok(())
    }
}
