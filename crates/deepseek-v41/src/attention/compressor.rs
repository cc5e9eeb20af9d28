//! The compressor of a kv source (spec §5): turns the layer input into compressed latents.
//!
//! * ratio 1: `latent_p = RMSNorm(h_p·wkvᵀ)` for every token (bf16 projection), no state;
//! * ratio 2: `kv_t = h_t·wkvᵀ`, `s_t = h_t·wgateᵀ` in f32; the tokens of group j = (2j, 2j+1) are
//!   pooled with a per-channel softmax over the group of `s`, cast to bf16 and RMS-normed. A group
//!   is emitted when its last token is processed; the open group's raw projections are carried
//!   across calls in [`CompressorCarry`].
//!
//! Latents are pre-RoPE and pre-quantization: the indexer's key projection consumes them as is.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::history::PositionRing;
use crate::config::Config;
use crate::nn::linear::{named, NamedLinears};
use crate::nn::{Linear, LinearKind, RmsNorm};
use crate::numerics::Numerics;

/// The open group's raw f32 projections, carried between calls (ratio > 1 only).
#[derive(Debug, Clone)]
pub struct CompressorCarry {
    /// `[n_open, head_dim]` f32 kv projections of the open group's tokens, in position order.
    kv: Option<Tensor>,
    /// `[n_open, head_dim]` f32 gate scores, same rows.
    score: Option<Tensor>,
    /// The raw projections of the last positions, kept for [`CompressorCarry::truncate`]
    /// (capacity 0 by default: nothing kept).
    kv_history: PositionRing,
    score_history: PositionRing,
}

impl Default for CompressorCarry {
    fn default() -> Self {
        Self { kv: None, score: None, kv_history: PositionRing::new(0), score_history: PositionRing::new(0) }
    }
}

impl CompressorCarry {
    /// Keeps the raw projections of the last `positions` tokens, so that the open group can be
    /// rebuilt after a truncation up to `positions − (ratio − 1)` tokens back; forgets what was
    /// kept.
    pub fn set_history(&mut self, positions: usize) {
        self.kv_history = PositionRing::new(positions);
        self.score_history = PositionRing::new(positions);
    }

    fn record(&mut self, kv: &Tensor, score: &Tensor, start: usize) -> Result<()> {
        self.kv_history.write(kv, start)?;
        self.score_history.write(score, start)
    }

    /// The positions a rollback of a ratio-`ratio` compressor from `len` to `new_len` tokens
    /// needs for its open group but does not hold (`None`: it can be done).
    pub fn rollback_gap(&self, ratio: usize, len: usize, new_len: usize) -> Option<std::ops::Range<usize>> {
        let open = new_len.checked_rem(ratio).unwrap_or(0);
        let group = new_len - open..new_len;
        let same_group = len - len.checked_rem(ratio).unwrap_or(0) == group.start;
        if open == 0 || same_group || self.kv_history.holds(&group) {
            None
        } else {
            Some(group)
        }
    }

    /// Rolls the open group back from `len` to `new_len` tokens (`new_len <= len`); fails,
    /// changing nothing, when the projections of the new open group are not held
    /// ([`CompressorCarry::rollback_gap`]).
    pub fn truncate(&mut self, ratio: usize, len: usize, new_len: usize) -> Result<()> {
        if new_len > len {
            candle_core::bail!("compressor: cannot truncate {len} positions to {new_len}")
        }
        if let Some(gap) = self.rollback_gap(ratio, len, new_len) {
            candle_core::bail!(
                "compressor: the projections of positions {}..{} (the open group) are not held for rollback (held: {:?})",
                gap.start,
                gap.end,
                self.kv_history.held()
            )
        }
        let open = new_len.checked_rem(ratio).unwrap_or(0);
        let group = new_len - open..new_len;
        let same_group = len - len.checked_rem(ratio).unwrap_or(0) == group.start;
        (self.kv, self.score) = if open == 0 {
            (None, None)
        } else if same_group {
            let cut = |t: &Option<Tensor>| t.as_ref().map(|t| t.narrow(0, 0, open)).transpose();
            (cut(&self.kv)?, cut(&self.score)?)
        } else {
            (self.kv_history.read(group.clone())?, self.score_history.read(group)?)
        };
        self.kv_history.truncate(new_len);
        self.score_history.truncate(new_len);
        Ok(())
    }

    /// The carry as the reference lays it out: `(kv, score)`, each `[ratio, head_dim]` f32 with
    /// slot = position mod ratio; only slots `< pos mod ratio` are meaningful (others hold 0 /
    /// −inf here). `pos` is the number of tokens processed.
    pub fn slots(&self, ratio: usize, head_dim: usize, pos: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let open = pos % ratio;
        let mut kv = Tensor::zeros((ratio, head_dim), DType::F32, device)?;
        let mut score = Tensor::full(f32::NEG_INFINITY, (ratio, head_dim), device)?;
        if let (Some(k), Some(s)) = (&self.kv, &self.score) {
            if open > 0 {
                let pad = ratio - open;
                kv = Tensor::cat(&[k.clone(), kv.narrow(0, 0, pad)?], 0)?;
                score = Tensor::cat(&[s.clone(), score.narrow(0, 0, pad)?], 0)?;
            }
        }
        Ok((kv, score))
    }
}

/// Latents emitted by one call.
#[derive(Debug, Clone)]
pub struct Latents {
    /// `[G, head_dim]` bf16 (activation dtype), RMS-normed, pre-RoPE; on `x`'s device, except
    /// that an empty latent (`G = 0`) lives on the host.
    pub latent: Tensor,
    /// Entry id of row 0; row g is entry `first_entry + g` (covers tokens `[j·r, (j+1)·r)`).
    pub first_entry: usize,
}

/// Projections of a compressor, by ratio.
#[derive(Debug, Clone)]
enum Pooling {
    /// Ratio 1: a bf16 projection, no gate.
    PerToken { wkv: Linear },
    /// Ratio ≥ 2: f32 projections and a per-channel softmax gate over each group.
    Gated { wkv: Linear, wgate: Linear, ratio: usize },
}

/// `attn.compressor` of a kv source.
#[derive(Debug, Clone)]
pub struct Compressor {
    pooling: Pooling,
    /// `compressor.norm`, eps = rms_norm_eps.
    norm: RmsNorm,
}

impl Compressor {
    /// Loads `compressor.{wkv, wgate (ratio > 1), norm}` from `vb` (= `layers.N.attn.compressor`).
    pub fn new(cfg: &Config, ratio: usize, numerics: Numerics, vb: VarBuilder) -> Result<Self> {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let pooling = match ratio {
            0 => candle_core::bail!("Compressor: ratio 0 layers have no compressor"),
            1 => Pooling::PerToken { wkv: Linear::new(d, hd, LinearKind::Plain, numerics, vb.pp("wkv"))? },
            r => Pooling::Gated {
                wkv: Linear::new(d, hd, LinearKind::F32, numerics, vb.pp("wkv"))?,
                wgate: Linear::new(d, hd, LinearKind::F32, numerics, vb.pp("wgate"))?,
                ratio: r,
            },
        };
        Ok(Self { pooling, norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("norm"))? })
    }

    /// Compresses `x` (`[T, hidden]` bf16, the attn-normed layer input of positions
    /// `start .. start + T`), returning the latents of the groups that close in this call.
    pub fn forward(&self, x: &Tensor, start: usize, carry: &mut CompressorCarry) -> Result<Latents> {
        match &self.pooling {
            Pooling::PerToken { wkv } => {
                let latent = self.norm.forward(&wkv.forward(x)?)?;
                Ok(Latents { latent, first_entry: start })
            }
            Pooling::Gated { wkv, wgate, ratio } => {
                let r = *ratio;
                let kv = wkv.forward(x)?;
                let score = wgate.forward(x)?;
                carry.record(&kv, &score, start)?;
                // Prepend the open group carried from earlier calls.
                let (kv, score) = match (&carry.kv, &carry.score) {
                    (Some(k), Some(s)) => (Tensor::cat(&[k, &kv], 0)?, Tensor::cat(&[s, &score], 0)?),
                    _ => (kv, score),
                };
                let group_start = start - start % r;
                let rows = kv.dim(0)?;
                let groups = rows / r;
                let open = rows % r;
                carry.kv = (open > 0).then(|| kv.narrow(0, groups * r, open)).transpose()?;
                carry.score = (open > 0).then(|| score.narrow(0, groups * r, open)).transpose()?;
                let hd = kv.dim(1)?;
                let latent = if groups == 0 {
                    // No group closes: an empty latent, kept on the host (callers only read
                    // its row count; a zero-sized device allocation is not made).
                    Tensor::zeros((0, hd), x.dtype(), &Device::Cpu)?
                } else {
                    let kv = kv.narrow(0, 0, groups * r)?.reshape((groups, r, hd))?;
                    let score = score.narrow(0, 0, groups * r)?.reshape((groups, r, hd))?;
                    let alpha = candle_nn::ops::softmax(&score, 1)?;
                    let pooled = (alpha * kv)?.sum(1)?.to_dtype(x.dtype())?;
                    self.norm.forward(&pooled)?
                };
                Ok(Latents { latent, first_entry: group_start / r })
            }
        }
    }

    /// The compress ratio.
    pub fn ratio(&self) -> usize {
        match &self.pooling {
            Pooling::PerToken { .. } => 1,
            Pooling::Gated { ratio, .. } => *ratio,
        }
    }

    /// `compressor.wkv` `[head_dim, hidden]` (ratio 1: bf16 product; ratio ≥ 2: f32).
    pub fn wkv(&self) -> &Linear {
        match &self.pooling {
            Pooling::PerToken { wkv } | Pooling::Gated { wkv, .. } => wkv,
        }
    }

    /// `compressor.wgate` `[head_dim, hidden]` (f32; ratio ≥ 2 only).
    pub fn wgate(&self) -> Option<&Linear> {
        match &self.pooling {
            Pooling::PerToken { .. } => None,
            Pooling::Gated { wgate, .. } => Some(wgate),
        }
    }

    /// `compressor.norm` over the pooled latents.
    pub fn norm(&self) -> &RmsNorm {
        &self.norm
    }

    /// The projections with their checkpoint prefixes (`wkv`, `wgate`).
    pub fn linears(&self) -> NamedLinears<'_> {
        match &self.pooling {
            Pooling::PerToken { wkv } => named([("wkv", wkv)]),
            Pooling::Gated { wkv, wgate, .. } => named([("wkv", wkv), ("wgate", wgate)]),
        }
    }
}

/// Softmax pooling of one group written out by hand (used by tests as an independent check).
#[cfg(test)]
fn pool_by_hand(kv: &[Vec<f32>], score: &[Vec<f32>]) -> Vec<f32> {
    let d = kv[0].len();
    (0..d)
        .map(|c| {
            let m = score.iter().map(|s| s[c]).fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = score.iter().map(|s| (s[c] - m).exp()).collect();
            let z: f32 = e.iter().sum();
            kv.iter().zip(&e).map(|(k, w)| k[c] * w / z).sum()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn compressor(ratio: usize, d: usize, hd: usize) -> Result<(Compressor, Config)> {
        let dev = Device::Cpu;
        let mut cfg = crate::test_util::tiny_config();
        cfg.hidden_size = d;
        cfg.head_dim = hd;
        let mut ws = HashMap::new();
        ws.insert("wkv.weight".to_string(), Tensor::randn(0f32, 0.5, (hd, d), &dev)?);
        ws.insert("wgate.weight".to_string(), Tensor::randn(0f32, 0.5, (hd, d), &dev)?);
        ws.insert("norm.weight".to_string(), Tensor::ones(hd, DType::F32, &dev)?);
        let vb = VarBuilder::from_tensors(ws, DType::BF16, &dev);
        Ok((Compressor::new(&cfg, ratio, Numerics::PLAIN, vb)?, cfg))
    }

    #[test]
    fn ratio2_pooling_matches_hand_computation_and_carry_is_exact() -> Result<()> {
        let (c, _) = compressor(2, 32, 16)?;
        let x = Tensor::randn(0f32, 1.0, (7, 32), &Device::Cpu)?.to_dtype(DType::BF16)?;
        let mut carry = CompressorCarry::default();
        let full = c.forward(&x, 0, &mut carry)?;
        assert_eq!(full.latent.dims2()?, (3, 16)); // odd trailing token carried
        assert_eq!(full.first_entry, 0);
        // Hand pooling of group 1 (tokens 2, 3).
        let Pooling::Gated { wkv, wgate, .. } = &c.pooling else { unreachable!() };
        let kv = wkv.forward(&x)?.to_vec2::<f32>()?;
        let s = wgate.forward(&x)?.to_vec2::<f32>()?;
        let pooled = pool_by_hand(&kv[2..4], &s[2..4]);
        let pooled = Tensor::new(pooled, &Device::Cpu)?.to_dtype(DType::BF16)?.unsqueeze(0)?;
        let want = c.norm.forward(&pooled)?.to_dtype(DType::F32)?;
        let got = full.latent.narrow(0, 1, 1)?.to_dtype(DType::F32)?;
        assert_eq!(want.to_vec2::<f32>()?, got.to_vec2::<f32>()?);
        // Any split gives the same latents: 3 + 1 + 3 tokens.
        let mut carry2 = CompressorCarry::default();
        let mut parts = vec![];
        for (s, n) in [(0, 3), (3, 1), (4, 3)] {
            let l = c.forward(&x.narrow(0, s, n)?, s, &mut carry2)?;
            assert_eq!(l.first_entry, s / 2);
            parts.push(l.latent);
        }
        let chunked = Tensor::cat(&parts, 0)?.to_dtype(DType::F32)?;
        assert_eq!(chunked.to_vec2::<f32>()?, full.latent.to_dtype(DType::F32)?.to_vec2::<f32>()?);
        let (ck, _) = carry2.slots(2, 16, 7, &Device::Cpu)?;
        assert_eq!(ck.narrow(0, 0, 1)?.to_vec2::<f32>()?[0], kv[6]);
        Ok(())
    }

    #[test]
    fn ratio1_emits_every_token_without_state() -> Result<()> {
        let (c, _) = compressor(1, 32, 16)?;
        let x = Tensor::randn(0f32, 1.0, (5, 32), &Device::Cpu)?.to_dtype(DType::BF16)?;
        let mut carry = CompressorCarry::default();
        let l = c.forward(&x, 9, &mut carry)?;
        assert_eq!((l.latent.dim(0)?, l.first_entry), (5, 9));
        assert!(carry.kv.is_none());
        Ok(())
    }
}
