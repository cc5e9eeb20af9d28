//! The decode step of one loaded V4.1 decoder layer for B sequences (one token each), in the
//! order of `DecoderLayer::forward` (spec §3.2): Engram on the stream (Engram layers), the
//! attention's mHC mixes, collapse and `attn_norm`, the batched attention step
//! (`attention::decode_batch` through `support/batched_step.rs`: the caches of all B sequences
//! in pooled device tensors), the
//! attention's post, the FFN's mixes, collapse and `ffn_norm`, the MoE, the FFN's post. Every
//! module is the loaded layer's own (`DecoderLayer` accessors), so the weights are those the
//! real loader placed. Used by `examples/bench_flash_layer.rs` (include it with
//! `#[path = "support/flash_layer_step.rs"] mod flash_layer_step;` next to `batched_layer.rs`
//! and `batched_step.rs`).
//!
//! The MoE of the step is `Moe::forward` inside `cuda::with_device_routing`: on a CUDA device
//! with MXFP4 experts the routing kernel, the shared expert and the grouped expert kernels
//! (streaming up to 8 slots per expert on average, the
//! grouped GEMM above), with no host read ([`LayerStep::moe_on_device`]); its
//! parts are also callable alone ([`LayerStep::route`], [`LayerStep::shared`],
//! [`LayerStep::experts`]) for a per-phase breakdown.
#![allow(dead_code)]

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use deepseek_v41::cuda::{moe_experts_device, moe_route_supported, with_device_routing, DeviceRouting, GroupedExperts, MOE_EXPERTS_MAX_K};
use deepseek_v41::model::{collapse, post, DecoderLayer, Engram, HcCoeffs, HcSublayer};
use deepseek_v41::nn::RowGroups;

use crate::batched_step::{Inputs, Step};

/// Where an Engram layer's rows come from in the step.
pub enum EngramRows {
    /// A table on the device: the `[B·cols]` u32 row ids on the device; the step gathers the
    /// rows (`EngramTable::rows`: one `index_select`).
    DeviceIds(Tensor),
    /// A table in host memory: the rows gathered from the checkpoint and copied to the device
    /// ahead of the step (`[B, cols·width]` bf16; `HostRows::rows`, eager host work).
    Staged(Tensor),
}

/// The Engram module of the step and its rows.
pub struct EngramPart<'a> {
    pub module: &'a Engram,
    pub rows: EngramRows,
}

impl EngramPart<'_> {
    /// The stream `x` `[B, hc, D]` after the Engram (`Engram::forward_rows`).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let b = x.dim(0)?;
        let rows = match &self.rows {
            EngramRows::DeviceIds(ids) => self.module.table().rows(ids, x.device())?.reshape((b, ()))?,
            EngramRows::Staged(rows) => rows.clone(),
        };
        Ok(self.module.forward_rows(x, &rows, &RowGroups::whole(b))?)
    }
}

/// The mHC intermediate of the step between the attention and the MoE.
pub struct AfterAttention {
    /// The stream after the attention's post.
    pub x1: Tensor,
    /// The FFN's coefficients.
    pub f: HcCoeffs,
    /// `[B, D]`: the ffn-normed MoE input.
    pub h2: Tensor,
}

/// Inputs of the mHC parts' breakdown ([`LayerStep::mhc_parts`]).
pub struct MhcParts {
    xf: Tensor,
    fnt: Tensor,
    a: HcCoeffs,
    y: Tensor,
    x: Tensor,
}

/// Names of the mHC parts, in [`LayerStep::mhc_parts`]' order.
pub const MHC_PARTS: [&str; 4] = ["mixes", "f32 product of the mixes' shape", "collapse + norm", "post"];

/// One decode step of a loaded layer (see the module docs).
pub struct LayerStep<'a> {
    pub layer: &'a DecoderLayer,
    pub attn: Step<'a>,
    pub engram: Option<EngramPart<'a>>,
    /// `[B, hc, D]` bf16: the residual stream entering the layer.
    pub x: Tensor,
    /// `[B, hc]` f32: the pre carried from the previous layer.
    pub p_in: Tensor,
}

impl<'a> LayerStep<'a> {
    /// A random stream `[b, hc, d]` (bf16, unit scale) and carried pre `[b, hc]` (f32 in
    /// (0.1, 1), as the sigmoid + eps of spec §3.2 gives).
    pub fn random_inputs(b: usize, hc: usize, d: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let x = Tensor::randn(0f32, 1.0, (b, hc, d), dev)?.to_dtype(DType::BF16)?;
        let p = Tensor::rand(0.1f32, 1.0, (b, hc), dev)?;
        Ok((x, p))
    }

    /// The stream after the Engram (the input stream itself for other layers).
    pub fn engram(&self, x: &Tensor) -> Result<Tensor> {
        match &self.engram {
            Some(e) => e.forward(x),
            None => Ok(x.clone()),
        }
    }

    /// The attention's coefficients and its input `attn_norm(collapse(x, p_in))` `[B, D]`.
    pub fn pre_attention(&self, x: &Tensor) -> Result<(HcCoeffs, Tensor)> {
        let a = self.layer.hc_mix(HcSublayer::Attn).mixes(x)?;
        let h = self.layer.attn_norm().forward(&collapse(x, &self.p_in)?)?;
        Ok((a, h))
    }

    /// The attention's post, the FFN's coefficients and its input.
    pub fn post_attention(&self, y: &Tensor, x: &Tensor, a: &HcCoeffs) -> Result<AfterAttention> {
        let x1 = post(y, x, &a.post, &a.comb)?;
        let f = self.layer.hc_mix(HcSublayer::Ffn).mixes(&x1)?;
        let h2 = self.layer.ffn_norm().forward(&collapse(&x1, &a.pre)?)?;
        Ok(AfterAttention { x1, f, h2 })
    }

    /// The FFN's post: the stream leaving the layer.
    pub fn finish(&self, z: &Tensor, m: &AfterAttention) -> Result<Tensor> {
        Ok(post(z, &m.x1, &m.f.post, &m.f.comb)?)
    }

    /// The MoE output `[B, D]` (`Moe::forward` inside `cuda::with_device_routing`).
    pub fn moe(&self, h2: &Tensor) -> Result<Tensor> {
        Ok(with_device_routing(|| self.layer.moe()?.forward(h2))?.out)
    }

    /// Whether [`LayerStep::moe`] stays on the device for any number of tokens (no host read: capturable
    /// into a CUDA graph); `Err` says why not.
    pub fn moe_on_device(&self, top_k: usize) -> std::result::Result<(), String> {
        let Some(g) = self.grouped() else {
            return Err("the routed experts are not MXFP4 on a CUDA device (no grouped experts): host routing and per-expert loop".into());
        };
        if !moe_route_supported(g.len(), top_k) || top_k > MOE_EXPERTS_MAX_K {
            return Err(format!("{} experts, top-{top_k}: outside what the routing and expert kernels take (host routing)", g.len()));
        }
        Ok(())
    }

    fn grouped(&self) -> Option<&'a GroupedExperts> {
        self.layer.moe().ok()?.grouped_experts()
    }

    /// The routing decision on the device (router logits and `moe_route_device`).
    pub fn route(&self, h2: &Tensor) -> Result<DeviceRouting> {
        Ok(self.layer.moe()?.gate().route_device(h2)?)
    }

    /// The shared expert's output `[B, D]` (none when the layer has no shared expert).
    pub fn shared(&self, h2: &Tensor) -> Result<Option<Tensor>> {
        match self.layer.moe()?.shared_expert() {
            Some(s) => Ok(Some(s.forward_prepared(&s.prepare_input(h2)?, None)?)),
            None => Ok(None),
        }
    }

    /// The routed experts and the combine with the shared expert's output
    /// (`moe_experts_device`), `[B, D]`.
    pub fn experts(&self, h2: &Tensor, r: &DeviceRouting, shared: Option<&Tensor>) -> Result<Tensor> {
        let g = self.grouped().context("no grouped experts")?;
        let limit = self.layer.moe()?.experts().first().and_then(|e| e.swiglu_limit()).map(|l| l as f32);
        Ok(moe_experts_device(h2, r, g, limit, shared)?.out)
    }

    /// The whole step: the stream leaving the layer `[B, hc, D]` and the pre for the next layer.
    pub fn run(&self) -> Result<(Tensor, Tensor)> {
        let x = self.engram(&self.x)?;
        let (a, h) = self.pre_attention(&x)?;
        let y = self.attn.run(&h)?;
        let m = self.post_attention(&y, &x, &a)?;
        let z = self.moe(&m.h2)?;
        Ok((self.finish(&z, &m)?, m.f.pre))
    }

    /// The mHC parts of the step, each alone (for a breakdown of [`LayerStep::mhc`]): the
    /// attention's mixes (`HcMix::mixes`: the rms scale, the `[B, hc·D] x [hc·D, (2+hc)·hc]` f32
    /// product, the Sinkhorn), a plain f32 product of the mixes' shapes (random operands: the
    /// product alone), the collapse + `attn_norm`, and the post.
    pub fn mhc_parts(&self, x: &Tensor, y: &Tensor) -> Result<MhcParts> {
        let (b, hc, d) = x.dims3()?;
        let mix = (2 + hc) * hc;
        let xf = Tensor::randn(0f32, 1.0, (b, hc * d), x.device())?;
        let fnt = Tensor::randn(0f32, 0.01, (mix, hc * d), x.device())?;
        let a = self.layer.hc_mix(HcSublayer::Attn).mixes(x)?;
        Ok(MhcParts { xf, fnt, a, y: y.clone(), x: x.clone() })
    }

    /// The attention's mixes alone.
    pub fn part_mixes(&self, p: &MhcParts) -> Result<()> {
        self.layer.hc_mix(HcSublayer::Attn).mixes(&p.x)?;
        Ok(())
    }

    /// A plain f32 product of the mixes' shapes alone.
    pub fn part_product(&self, p: &MhcParts) -> Result<()> {
        p.xf.matmul(&p.fnt.t()?)?;
        Ok(())
    }

    /// The collapse and `attn_norm` alone.
    pub fn part_collapse_norm(&self, p: &MhcParts) -> Result<()> {
        self.layer.attn_norm().forward(&collapse(&p.x, &self.p_in)?)?;
        Ok(())
    }

    /// The attention's post alone.
    pub fn part_post(&self, p: &MhcParts) -> Result<()> {
        post(&p.y, &p.x, &p.a.post, &p.a.comb)?;
        Ok(())
    }

    /// The mHC and norm work of the step alone, for the attention and MoE outputs `y`, `z`
    /// computed before: both sublayers' mixes, collapses, norms and posts.
    pub fn mhc(&self, x: &Tensor, y: &Tensor, z: &Tensor) -> Result<Tensor> {
        let (a, _) = self.pre_attention(x)?;
        let m = self.post_attention(y, x, &a)?;
        self.finish(z, &m)
    }
}

/// The largest absolute value of `t` and whether every value is finite (one device → host read).
pub fn finite_max(t: &Tensor) -> Result<(bool, f32)> {
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok((v.iter().all(|x| x.is_finite()), v.iter().fold(0f32, |m, x| m.max(x.abs()))))
}

/// The two placements' rows of the same ids must agree bit for bit (`HostRows::rows`).
pub fn check_same_rows(a: &EngramPart, b: &EngramPart, n: usize) -> Result<()> {
    let rows = |p: &EngramPart| -> Result<Vec<u16>> {
        let t = match &p.rows {
            EngramRows::DeviceIds(ids) => p.module.table().rows(ids, ids.device())?.reshape((n, ()))?,
            EngramRows::Staged(r) => r.clone(),
        };
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect())
    };
    if rows(a)? != rows(b)? {
        bail!("the Engram rows of the device table and of the host table differ")
    }
    Ok(())
}

/// Random top-k rows of a reuse layer whose index source is not run: k entries per sequence
/// inside its visible range, as pool rows.
pub fn random_topk(s: &Inputs, k: usize, dev: &Device) -> Result<Tensor> {
    anyhow::ensure!(s.ratio > 0, "a reuse layer without compressed inputs");
    let mut v = Vec::with_capacity(s.b * k);
    for (b, n) in s.visible().into_iter().enumerate() {
        v.extend((0..k).map(|j| (b * s.entry_stride() + (j * 7919) % n.max(1)) as i64));
    }
    Ok(Tensor::from_vec(v, (s.b, k), dev)?)
}
