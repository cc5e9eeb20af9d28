//! The MoE FFN of every V4.1 layer (spec §8): a sqrt-softplus router with a selection-only bias,
//! routed experts (MXFP4 in the release) and one always-on shared expert (FP8), both with the
//! clamped SwiGLU.
//!
//! Routing decisions are made on the host: the expert dispatch needs the ids there anyway, and
//! the router tensor is only `[T, n_routed_experts]`. On a CUDA device inside
//! `cuda::with_device_routing` the decision is made by the kernel `cuda::moe_route_device`
//! instead and only the ids and weights are read back (`docs/kernels.md`); the host path is the
//! reference ([`super::moe_sort::moe_route_ref`]).

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::config::{Config, ScoringFunc};
use crate::nn::linear::{named, prefixed, NamedLinears};
use crate::nn::{Linear, LinearKind, RowGroups};
use crate::numerics::Numerics;

/// The literal added to the sum of the selected scores before renormalizing (spec §8 step 4,
/// §14 item 10: not `rms_norm_eps`).
const RENORM_EPS: f32 = 1e-20;

/// Stable softplus in f32, as torch computes it (`x` above 20 passes through).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The router score `sqrt(softplus(l))` of one logit already divided by `gate_temp` (spec §8
/// step 2).
pub(crate) fn router_score(l: f32) -> f32 {
    softplus(l).sqrt()
}

/// The routing decision for `T` tokens, `k` experts each, on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per token.
    pub k: usize,
    /// `[T·k]`: the chosen experts of token `t` at `t·k..(t+1)·k`, in descending (score + bias)
    /// order, ties broken by the lower expert id.
    pub ids: Vec<u32>,
    /// `[T·k]`: the routing weights of `ids` (unbiased scores, renormalized, times the routed
    /// scaling factor).
    pub weights: Vec<f32>,
}

impl Routing {
    /// Number of tokens.
    pub fn tokens(&self) -> usize {
        self.ids.len().checked_div(self.k).unwrap_or(0)
    }

    /// `ids` as a `[T, k]` u32 tensor.
    pub fn ids_tensor(&self, device: &Device) -> Result<Tensor> {
        Tensor::from_slice(&self.ids, (self.tokens(), self.k), device)
    }

    /// `weights` as a `[T, k]` f32 tensor.
    pub fn weights_tensor(&self, device: &Device) -> Result<Tensor> {
        Tensor::from_slice(&self.weights, (self.tokens(), self.k), device)
    }
}

/// The router: `ffn.gate.{weight, bias, bias_vl}`.
#[derive(Debug, Clone)]
pub struct Gate {
    /// `[E, D]`, used in f32 (plain linear, no activation quantization).
    proj: Linear,
    /// `[E]` f32 selection bias for text tokens.
    bias: Vec<f32>,
    /// `bias` as loaded (on the model's device), for the device routing.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    bias_t: Tensor,
    /// `[E]` f32 selection bias for tokens inside image spans (unused for text).
    bias_vl: Tensor,
    top_k: usize,
    route_scale: f32,
    temp: f32,
}

impl Gate {
    /// Loads `weight` `[E, D]` (bf16 in the release, used in f32), `bias` `[E]` f32 and
    /// `bias_vl` `[E]` f32 from `vb` = `layers.N.ffn.gate`.
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let e = cfg.n_routed_experts;
        if cfg.num_experts_per_tok == 0 || cfg.num_experts_per_tok > e {
            candle_core::bail!(
                "MoE gate: num_experts_per_tok {} not in 1..={e}",
                cfg.num_experts_per_tok
            )
        }
        if cfg.gate_temp.is_nan() || cfg.gate_temp <= 0.0 {
            candle_core::bail!("MoE gate: gate_temp must be > 0, got {}", cfg.gate_temp)
        }
        match cfg.scoring_func {
            ScoringFunc::SqrtSoftplus => {}
        }
        if !cfg.norm_topk_prob {
            candle_core::bail!("MoE gate: norm_topk_prob = false is not a V4.1 configuration")
        }
        let proj = Linear::new(
            cfg.hidden_size,
            e,
            LinearKind::F32,
            Numerics::PLAIN,
            vb.clone(),
        )?;
        let hints = Default::default();
        let bias_t = vb.get_with_hints_dtype(e, "bias", hints, DType::F32)?;
        let bias = bias_t.to_vec1::<f32>()?;
        let bias_vl = vb.get_with_hints_dtype(e, "bias_vl", hints, DType::F32)?;
        Ok(Self {
            proj,
            bias,
            bias_t,
            bias_vl,
            top_k: cfg.num_experts_per_tok,
            route_scale: cfg.routed_scaling_factor as f32,
            temp: cfg.gate_temp as f32,
        })
    }

    /// The router's projection `[E, D]` (f32).
    pub(crate) fn proj(&self) -> &Linear {
        &self.proj
    }

    /// Experts chosen per token (`num_experts_per_tok`).
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The image-span selection bias `[E]` f32 (spec §8 step 3; text inference never uses it).
    pub fn bias_vl(&self) -> &Tensor {
        &self.bias_vl
    }

    /// The router logits `x·Wᵀ` `[T, E]` f32 for `x` `[T, D]` (bf16), before `gate_temp`.
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        self.proj.forward(x)
    }

    /// The router scores `sqrt(softplus(x·Wᵀ / gate_temp))` in f32 for `x` `[T, D]` (bf16), as
    /// host rows `[T][E]`.
    fn scores(&self, x: &Tensor, groups: &RowGroups) -> Result<Vec<Vec<f32>>> {
        let logits = self.proj.forward_grouped(x, groups)?;
        let logits = if self.temp == 1.0 {
            logits
        } else {
            (logits / self.temp as f64)?
        };
        let rows = logits.to_vec2::<f32>()?;
        Ok(rows
            .into_iter()
            .map(|r| r.into_iter().map(router_score).collect())
            .collect())
    }

    /// Routes `x` `[T, D]` (bf16): top-k of score + bias (ties: lower expert id first), weights
    /// `score / (Σ_sel score + 1e-20) · routed_scaling_factor` from the unbiased scores.
    ///
    /// On a CUDA device inside `cuda::with_device_routing` (and when the kernel takes E and k)
    /// the decision is made on the device (`cuda::moe_route_device`) and only the ids and
    /// weights come back, in one copy, instead of the `[T, E]` logits. Equal to the host
    /// decision except where two biased scores are within ~1 ulp (the kernel's softplus is
    /// correctly rounded, the host's is the platform libm's), the weights then within a few ulp.
    pub fn route(&self, x: &Tensor) -> Result<Routing> {
        self.route_grouped(x, &RowGroups::whole(x.dim(0)?))
    }

    /// [`Gate::route`] of tokens of several sequences split as `groups`: on the CPU each
    /// sequence's decisions are bit for bit those of its own call ([`Linear::forward_grouped`]).
    pub fn route_grouped(&self, x: &Tensor, groups: &RowGroups) -> Result<Routing> {
        #[cfg(feature = "cuda")]
        if crate::cuda::device_routing(x.device()) && crate::cuda::moe_route_supported(self.bias.len(), self.top_k) {
            return self.route_on_device(&self.logits(x)?);
        }
        Ok(select_experts(
            &self.scores(x, groups)?,
            &self.bias,
            self.top_k,
            self.route_scale,
        ))
    }

    /// The routing decision of `x` `[T, D]` (bf16) on its CUDA device, left there
    /// ([`crate::cuda::moe_route_device`]: ids, weights and the slots sorted by expert); no host
    /// read. Errors where the kernel does not take E and k.
    #[cfg(feature = "cuda")]
    pub fn route_device(&self, x: &Tensor) -> Result<crate::cuda::DeviceRouting> {
        crate::cuda::moe_route_device(&self.logits(x)?, &self.bias_t, self.top_k, self.temp, self.route_scale)
    }

    /// [`Gate::route`]'s device path for the router `logits` `[T, E]` f32 on a CUDA device.
    #[cfg(feature = "cuda")]
    fn route_on_device(&self, logits: &Tensor) -> Result<Routing> {
        let r = crate::cuda::moe_route_device(logits, &self.bias_t, self.top_k, self.temp, self.route_scale)?;
        // One device → host copy: the ids as f32 (exact, they are < 2^24) beside the weights.
        let rows = Tensor::cat(&[&r.ids.to_dtype(DType::F32)?, &r.weights], 1)?.to_vec2::<f32>()?;
        let k = self.top_k;
        let mut ids = Vec::with_capacity(rows.len() * k);
        let mut weights = Vec::with_capacity(rows.len() * k);
        for row in rows {
            ids.extend(row[..k].iter().map(|&v| v as u32));
            weights.extend_from_slice(&row[k..]);
        }
        Ok(Routing { k, ids, weights })
    }
}

/// Top-`k` of `score + bias` per row (ties: lower expert id first), weights
/// `score / (Σ_sel score + 1e-20) · route_scale` from the unbiased `scores` (`[T][E]` f32).
pub(crate) fn select_experts(scores: &[Vec<f32>], bias: &[f32], k: usize, route_scale: f32) -> Routing {
    let mut ids = Vec::with_capacity(scores.len() * k);
    let mut weights = Vec::with_capacity(scores.len() * k);
    let mut order: Vec<usize> = Vec::with_capacity(bias.len());
    for row in scores {
        let biased: Vec<f32> = row.iter().zip(bias).map(|(s, b)| s + b).collect();
        order.clear();
        order.extend(0..row.len());
        // total_cmp keeps NaN deterministic (ordered above +inf, so a NaN score is visible).
        order.sort_by(|&a, &b| biased[b].total_cmp(&biased[a]).then(a.cmp(&b)));
        let sel = &order[..k];
        let sum: f32 = sel.iter().map(|&e| row[e]).sum();
        for &e in sel {
            ids.push(e as u32);
            weights.push(row[e] / (sum + RENORM_EPS) * route_scale);
        }
    }
    Routing { k, ids, weights }
}

/// `(acc + f32(v))` rounded to `dtype`, with `acc` = zeros when `None`: one step of the MoE's f32
/// sum. `acc`: f32 of `v`'s shape; `v`: any float dtype. On a CUDA device one kernel, bit for bit
/// these ops.
pub(crate) fn accumulate(acc: Option<&Tensor>, v: &Tensor, dtype: DType) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::cuda::fused_kernels(v.device()) && crate::cuda::accumulate_supported(v, dtype) {
        return crate::cuda::accumulate_device(acc, v, dtype);
    }
    let v = v.to_dtype(DType::F32)?;
    let sum = match acc {
        Some(a) => (a + v)?,
        None => (Tensor::zeros(v.shape(), DType::F32, v.device())? + v)?,
    };
    sum.to_dtype(dtype)
}

/// One SwiGLU expert `w2(silu(min(w1·x, L)) · clamp(w3·x, −L, L))` with FP8/FP4 weights
/// (quantized linears), `L` = `swiglu_limit` (no clamp when `L <= 0`).
#[derive(Debug, Clone)]
pub struct Expert {
    w1: Linear,
    w2: Linear,
    w3: Linear,
    limit: Option<f64>,
}

impl Expert {
    /// The SwiGLU limit (none when the config's is 0).
    #[cfg(feature = "cuda")]
    pub(crate) fn limit(&self) -> Option<f64> {
        self.limit
    }

    /// Loads `w1`, `w3` `[inter, D]` and `w2` `[D, inter]` from `vb` = `…experts.E` or
    /// `…shared_experts`.
    pub fn new(
        dim: usize,
        inter: usize,
        swiglu_limit: f64,
        numerics: Numerics,
        vb: VarBuilder,
    ) -> Result<Self> {
        let lin = |i, o, name| Linear::new(i, o, LinearKind::Quantized, numerics, vb.pp(name));
        Ok(Self {
            w1: lin(dim, inter, "w1")?,
            w2: lin(inter, dim, "w2")?,
            w3: lin(dim, inter, "w3")?,
            limit: (swiglu_limit > 0.0).then_some(swiglu_limit),
        })
    }

    /// `x`: `[n, D]` (bf16); `weight`: optional `[n, 1]` f32 routing weight, multiplied into the
    /// f32 activation before it is rounded to `x`'s dtype and fed to `w2` (the reference's
    /// order). Returns `[n, D]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor, weight: Option<&Tensor>) -> Result<Tensor> {
        self.forward_prepared(&self.prepare_input(x)?, weight)
    }

    /// The input of `w1` / `w3` for `x` `[n, D]` ([`Linear::prepare_input`]: the FP8 activation
    /// quantization when the numerics quantize). Experts built with the same numerics share it.
    pub fn prepare_input(&self, x: &Tensor) -> Result<Tensor> {
        self.w1.prepare_input(x)
    }

    /// [`Expert::forward`] of `xp` = [`Expert::prepare_input`]`(x)` `[n, D]` (of this expert or
    /// one with the same numerics); bit for bit `forward(x, weight)`.
    pub fn forward_prepared(&self, xp: &Tensor, weight: Option<&Tensor>) -> Result<Tensor> {
        self.forward_prepared_grouped(xp, weight, &RowGroups::whole(xp.dim(0)?))
    }

    /// [`Expert::forward_prepared`] of the rows of several sequences split as `groups`: on the
    /// CPU each sequence's rows are bit for bit those of its own call
    /// ([`Linear::forward_grouped`]).
    pub fn forward_prepared_grouped(&self, xp: &Tensor, weight: Option<&Tensor>, groups: &RowGroups) -> Result<Tensor> {
        let (gate, up) = (self.w1.forward_prepared_grouped(xp, groups)?, self.w3.forward_prepared_grouped(xp, groups)?);
        self.down(gate, up, xp.dtype(), weight, groups)
    }

    /// [`Expert::forward`] with `w1` and `w3` each given `x` itself ([`Linear::forward`]): an FP8
    /// weight on CUDA quantizes the activation inside its kernel (one launch per linear instead of
    /// the shared quantization and a prep launch each). The same quantized values as
    /// [`Expert::forward`]; on CUDA the products' f32 sums in the fused kernels' order.
    pub fn forward_quantizing(&self, x: &Tensor, weight: Option<&Tensor>) -> Result<Tensor> {
        let (gate, up) = (self.w1.forward(x)?, self.w3.forward(x)?);
        self.down(gate, up, x.dtype(), weight, &RowGroups::whole(x.dim(0)?))
    }

    /// Whether [`Expert::forward_quantizing`] of `x` is, on CUDA, launches of the crate's kernels
    /// only — `w1`, `w3` and `w2` each one FP8 streaming kernel
    /// ([`Linear::forward_is_kernels_only`]) and the SwiGLU between them — with no Candle op
    /// reading a kernel's output, so that the whole expert can run on a
    /// [`crate::cuda::SideStream`]. Not with `DSV41_UNFUSE=fp8_fused`, whose path quantizes
    /// each input with a separate launch.
    #[cfg(feature = "cuda")]
    pub(crate) fn kernels_only(&self, x: &Tensor) -> bool {
        let (Ok((rows, _)), dev, dt) = (x.dims2(), x.device(), x.dtype()) else { return false };
        // gate, up and the SwiGLU's output are fresh contiguous [rows, inter] tensors of x's dtype.
        let swiglu = crate::cuda::fused_kernels(dev) && !crate::cuda::unfused("fp8_fused") && crate::cuda::swiglu_supported(x);
        x.is_contiguous() && swiglu && [&self.w1, &self.w3, &self.w2].into_iter().all(|l| l.forward_is_kernels_only(dev, dt, rows))
    }

    /// The SwiGLU of `gate` and `up` (times `weight`), rounded to `dtype`, through `w2`.
    fn down(&self, gate: Tensor, up: Tensor, dtype: DType, weight: Option<&Tensor>, groups: &RowGroups) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if crate::cuda::fused_kernels(gate.device()) && crate::cuda::swiglu_supported(&gate) && gate.dtype() == dtype {
            // One launch, bit for bit the op sequence below.
            return self.w2.forward(&crate::cuda::swiglu_device(&gate, &up, weight, self.limit)?);
        }
        let mut gate = gate.to_dtype(DType::F32)?;
        let mut up = up.to_dtype(DType::F32)?;
        if let Some(l) = self.limit {
            gate = gate.minimum(l)?;
            up = up.clamp(-l, l)?;
        }
        let mut act = (gate.silu()? * up)?;
        if let Some(w) = weight {
            act = act.broadcast_mul(w)?;
        }
        self.w2.forward_grouped(&act.to_dtype(dtype)?, groups)
    }

    /// The SwiGLU clamp `L` (`swiglu_limit`; `None`: no clamp).
    pub fn swiglu_limit(&self) -> Option<f64> {
        self.limit
    }

    /// The three projections with their checkpoint prefixes (`w1`, `w2`, `w3`).
    pub fn linears(&self) -> NamedLinears<'_> {
        named([("w1", &self.w1), ("w2", &self.w2), ("w3", &self.w3)])
    }
}

/// The f32 sum of the routed experts (`None` until the first adds to it) plus one expert's outputs
/// `out` `[n, D]`: of every token in order (`rows` = None), or of the tokens `rows` `[n]` u32 of
/// `T` (an `index_add` into zeros the first time). One step of the MoE's sum in expert-id order.
pub(crate) fn add_routed(y: Option<Tensor>, out: &Tensor, rows: Option<(&Tensor, usize)>) -> Result<Tensor> {
    match rows {
        None => accumulate(y.as_ref(), out, DType::F32),
        Some((rows, t)) => {
            let acc = match y {
                Some(y) => y,
                None => Tensor::zeros((t, out.dim(1)?), DType::F32, out.device())?,
            };
            acc.index_add(rows, &out.to_dtype(DType::F32)?, 0)
        }
    }
}

/// The MoE output in `x`'s dtype: the routed sum `y` plus the shared expert's output over its
/// prepared input (`shared` = the expert and `xp`), zeros when there is neither.
pub(crate) fn add_shared(y: Option<Tensor>, shared: Option<(&Expert, &Tensor)>, x: &Tensor, groups: &RowGroups) -> Result<Tensor> {
    match (shared, y) {
        (Some((shared, xp)), y) => accumulate(y.as_ref(), &shared.forward_prepared_grouped(xp, None, groups)?, x.dtype()),
        (None, Some(y)) => y.to_dtype(x.dtype()),
        (None, None) => Tensor::zeros(x.dims(), x.dtype(), x.device()),
    }
}

/// Row groups of the runs of equal owners (the rows of one sequence routed to an expert, in
/// order): each its own whole product.
pub(crate) fn runs<T: PartialEq + Copy>(owners: impl Iterator<Item = T>) -> RowGroups {
    let mut lens: Vec<usize> = Vec::new();
    let mut last = None;
    for o in owners {
        match lens.last_mut() {
            Some(n) if last == Some(o) => *n += 1,
            _ => lens.push(1),
        }
        last = Some(o);
    }
    RowGroups::from_lens(lens)
}

/// The MoE output with the routing decision kept for checking.
#[derive(Debug, Clone)]
pub struct MoeOutput {
    /// `[T, D]` in the input's dtype (bf16).
    pub out: Tensor,
    /// `[T, k]` u32: chosen experts in descending (score + bias) order.
    pub ids: Tensor,
    /// `[T, k]` f32: their routing weights.
    pub weights: Tensor,
}

/// The MoE FFN of one layer: `layers.N.ffn`.
#[derive(Debug, Clone)]
pub struct Moe {
    gate: Gate,
    experts: Vec<Expert>,
    shared: Option<Expert>,
    /// The routed experts for the grouped kernels (`cuda::moe_experts_device`): on a CUDA device
    /// when every routed expert is MXFP4 and the linears quantize their activations.
    #[cfg(feature = "cuda")]
    grouped: Option<crate::cuda::GroupedExperts>,
}

impl Moe {
    /// Loads `gate`, `experts.0..E` and `shared_experts` (intermediate width
    /// `moe_intermediate_size · n_shared_experts`, absent when 0) from `vb` = `layers.N.ffn`.
    pub fn new(cfg: &Config, numerics: Numerics, vb: VarBuilder) -> Result<Self> {
        let (d, inter, limit) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit);
        let gate = Gate::new(cfg, vb.pp("gate"))?;
        let experts = (0..cfg.n_routed_experts)
            .map(|e| Expert::new(d, inter, limit, numerics, vb.pp("experts").pp(e)))
            .collect::<Result<Vec<_>>>()?;
        let shared = match cfg.n_shared_experts {
            0 => None,
            n => Some(Expert::new(
                d,
                inter * n,
                limit,
                numerics,
                vb.pp("shared_experts"),
            )?),
        };
        #[cfg(feature = "cuda")]
        let grouped = grouped_experts(&experts, numerics)?;
        Ok(Self {
            gate,
            experts,
            shared,
            #[cfg(feature = "cuda")]
            grouped,
        })
    }

    /// The router.
    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// The routed experts, by expert id.
    pub fn experts(&self) -> &[Expert] {
        &self.experts
    }

    /// The shared expert (absent when `n_shared_experts` is 0).
    pub fn shared_expert(&self) -> Option<&Expert> {
        self.shared.as_ref()
    }

    /// The routed experts in the grouped form of `cuda::moe_experts_device` (MXFP4 experts on a
    /// CUDA device with the activation quantization on), else `None`.
    #[cfg(feature = "cuda")]
    pub fn grouped_experts(&self) -> Option<&crate::cuda::GroupedExperts> {
        self.grouped.as_ref()
    }

    /// `x`: `[T, D]` (bf16, already ffn-normed). Routed expert outputs (each in `x`'s dtype) are
    /// summed per token in f32 in expert-id order, the shared expert's output is added, and the
    /// sum is rounded to `x`'s dtype.
    ///
    /// The routing decision is made on the host (one copy of the `[T, E]` router logits, or of
    /// the `[T, k]` ids and weights with the device routing: [`Gate::route`]); the input's
    /// activation quantization is computed once and shared by every expert. An expert
    /// chosen by every token of the call (always the case for a decode token) runs on the whole
    /// input and its output is added directly, with no row gather / scatter (the same values as
    /// the gathered path: the rows are `0..T` in order).
    ///
    /// On a CUDA device inside `cuda::with_device_routing`, with MXFP4 experts (the release's,
    /// loaded natively), the whole layer stays on the device with no host read, whatever the
    /// number of tokens: the routing kernel, the shared expert, and the grouped expert kernels
    /// (`cuda::moe_experts_device`: weight streaming for decode, the tensor-core GEMM above 8
    /// slots per expert on average; the same sequence, the products summed in another f32 order).
    pub fn forward(&self, x: &Tensor) -> Result<MoeOutput> {
        self.forward_grouped(x, &RowGroups::whole(x.dim(0)?))
    }

    /// [`Moe::forward`] of the tokens of several sequences split as `groups` (whole groups: every
    /// token of a sequence's call): on the CPU each sequence's rows are bit for bit those of its
    /// own call — the router, the shared expert and every routed expert multiply each sequence's
    /// rows as its own call does ([`Linear::forward_grouped`]; a routed expert's groups are the
    /// sequences' runs of rows routed to it).
    pub fn forward_grouped(&self, x: &Tensor, groups: &RowGroups) -> Result<MoeOutput> {
        let t = x.dims2()?.0;
        let dev = x.device();
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.grouped {
            let k = self.gate.top_k;
            if crate::cuda::device_routing(dev)
                && x.dtype() == DType::BF16
                && crate::cuda::moe_route_supported(g.len(), k)
                && k <= crate::cuda::MOE_EXPERTS_MAX_K
            {
                return self.forward_on_device(x, g);
            }
        }
        let routing = self.gate.route_grouped(x, groups)?;
        // The sequence (group) of every token, for the routed experts' groups.
        let owner: Vec<usize> = groups.groups().iter().enumerate().flat_map(|(i, g)| std::iter::repeat_n(i, g.len)).collect();
        if owner.len() != t {
            candle_core::bail!("Moe: the row groups cover {} rows, the input has {t}", owner.len())
        }
        let k = routing.k;
        let weights = routing.weights_tensor(dev)?;
        let xp = match (self.experts.first(), &self.shared) {
            (Some(e), _) | (None, Some(e)) => e.prepare_input(x)?,
            (None, None) => x.clone(),
        };
        // The f32 sum from zeros, in expert-id order; `None` until the first expert adds to it.
        let mut y: Option<Tensor> = None;
        for (e, expert) in self.experts.iter().enumerate() {
            let slots: Vec<usize> = (0..routing.ids.len()).filter(|&s| routing.ids[s] as usize == e).collect();
            let n = slots.len();
            if n == 0 {
                continue;
            }
            let ws = if t == 1 {
                // The decode token: a view of the routing weights already on the device.
                weights.flatten_all()?.narrow(0, slots[0], 1)?.reshape((1, 1))?
            } else {
                Tensor::from_vec(slots.iter().map(|&s| routing.weights[s]).collect::<Vec<_>>(), (n, 1), dev)?
            };
            let eg = runs(slots.iter().map(|&s| owner[s / k]));
            if n == t {
                // Every token chose e (top-k ids are distinct): its rows are 0..T in order.
                y = Some(add_routed(y, &expert.forward_prepared_grouped(&xp, Some(&ws), &eg)?, None)?);
            } else {
                let rows = Tensor::from_vec(slots.iter().map(|&s| (s / k) as u32).collect::<Vec<_>>(), n, dev)?;
                let out = expert.forward_prepared_grouped(&xp.index_select(&rows, 0)?, Some(&ws), &eg)?;
                y = Some(add_routed(y, &out, Some((&rows, t)))?);
            }
        }
        let out = add_shared(y, self.shared.as_ref().map(|s| (s, &xp)), x, groups)?;
        Ok(MoeOutput { out, ids: routing.ids_tensor(dev)?, weights })
    }

    /// [`Moe::forward`] on the device: routing, shared expert, grouped routed experts.
    #[cfg(feature = "cuda")]
    fn forward_on_device(&self, x: &Tensor, g: &crate::cuda::GroupedExperts) -> Result<MoeOutput> {
        // The shared expert first, on the device's side stream where it has one (a decode
        // device, `cuda::SideStream`): beside the routing and the routed experts, joined before
        // the combine reads its output.
        let mut side = super::side_work::SideWork::new(x.device())?;
        // x is FP8-quantized (Q1, spec §0.1b.8) by the shared expert's w1 and w3 kernels (FP8 in
        // the release: each quantizes x itself, `Expert::forward_quantizing`) and by the routed
        // kernels' gate/up prep launch into their own panel (the streaming kernel: e4m3 values as
        // f16, K permuted within 8-groups, the block scales apart; the GEMM: bf16 values in its
        // stage order, K padded to 128). No layout serves all, and the prep launch runs anyway (it
        // also sorts the slots' tokens and weights), so a shared quantization would cost a launch
        // and save none.
        let shared_of = || -> Result<Option<Tensor>> {
            Ok(match &self.shared {
                Some(s) if crate::cuda::unfused("fp8_fused") => Some(s.forward_prepared(&s.prepare_input(x)?, None)?),
                Some(s) => Some(s.forward_quantizing(x, None)?),
                None => None,
            })
        };
        let shared = if self.shared.as_ref().is_some_and(|s| s.kernels_only(x)) { side.run(shared_of)? } else { shared_of()? };
        let r = self.gate.route_device(x)?;
        let limit = self.experts.first().and_then(|e| e.limit).map(|l| l as f32);
        let mut join = || side.join();
        let kernel = crate::cuda::MoeExpertsKernel::Auto;
        let out = crate::cuda::moe_experts_device_joined(x, &r, g, limit, shared.as_ref(), kernel, &mut join)?.out;
        Ok(MoeOutput { out, ids: r.ids, weights: r.weights })
    }

    /// Every linear with its checkpoint prefix (`gate`, `experts.E.w1`, `shared_experts.w2`, ...).
    pub fn linears(&self) -> NamedLinears<'_> {
        let mut v = named([("gate", &self.gate.proj)]);
        for (e, expert) in self.experts.iter().enumerate() {
            v.extend(prefixed(&format!("experts.{e}"), expert.linears()));
        }
        if let Some(shared) = &self.shared {
            v.extend(prefixed("shared_experts", shared.linears()));
        }
        v
    }
}

/// The grouped form of `experts` when every one holds MXFP4 `w1`, `w3`, `w2` on a CUDA device
/// with the activation quantization on (the kernels always quantize), else `None`.
#[cfg(feature = "cuda")]
pub(crate) fn grouped_experts(experts: &[Expert], numerics: Numerics) -> Result<Option<crate::cuda::GroupedExperts>> {
    if !numerics.activation_quant || experts.is_empty() || experts.len() > crate::cuda::MOE_EXPERTS_MAX_E {
        return Ok(None);
    }
    let mut ws = Vec::with_capacity(experts.len());
    for e in experts {
        let w = [&e.w1, &e.w3, &e.w2].map(|l| l.weight().mxfp4().cloned());
        match w {
            [Some(w1), Some(w3), Some(w2)] => ws.push([w1, w3, w2]),
            _ => return Ok(None),
        }
    }
    crate::cuda::GroupedExperts::new(ws).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn selection_uses_bias_weights_do_not() {
        let scores = vec![vec![0.5f32, 0.9, 0.7, 0.1]];
        // The bias lifts expert 3 into the top-2 and pushes expert 1 out.
        let r = select_experts(&scores, &[0.0, -1.0, 0.0, 1.0], 2, 1.5);
        assert_eq!(r.ids, vec![3, 2]);
        let sum = 0.1f32 + 0.7;
        assert_eq!(
            r.weights,
            vec![0.1 / (sum + 1e-20) * 1.5, 0.7 / (sum + 1e-20) * 1.5]
        );
        assert!((r.weights.iter().sum::<f32>() - 1.5).abs() < 1e-6);
    }

    #[test]
    fn ties_pick_the_lower_expert_id() {
        let scores = vec![vec![0.3f32, 0.6, 0.6, 0.6], vec![0.2, 0.2, 0.2, 0.2]];
        let r = select_experts(&scores, &[0.0; 4], 2, 1.0);
        assert_eq!(r.ids, vec![1, 2, 0, 1]);
        assert_eq!(r.tokens(), 2);
    }

    /// The clamped SwiGLU against a hand computation: gate clamped above only, up clamped on both
    /// sides, routing weight applied before `w2`. Weights are exact small values so f32 is exact.
    #[test]
    fn expert_clamp_by_hand() -> Result<()> {
        let dev = Device::Cpu;
        let (d, inter, limit) = (32usize, 4usize, 0.5f32);
        // x: one token with x[c] = 1 for c < 2, else 0; w1/w3 rows pick scaled sums.
        let mut x = vec![0f32; d];
        x[0] = 1.0;
        x[1] = 1.0;
        let gate_rows = [2.0f32, -3.0, 0.25, 0.0]; // a = 2·row value (x has two ones)
        let up_rows = [-1.0f32, 0.125, 2.0, -0.0625];
        let row = |v: f32| -> Vec<f32> { (0..d).map(|c| if c < 2 { v } else { 0.0 }).collect() };
        let w1: Vec<f32> = gate_rows.iter().flat_map(|&v| row(v)).collect();
        let w3: Vec<f32> = up_rows.iter().flat_map(|&v| row(v)).collect();
        let w2: Vec<f32> = (0..d * inter)
            .map(|i| if i / inter == i % inter { 1.0 } else { 0.0 })
            .collect();
        let mut ts = HashMap::new();
        ts.insert(
            "w1.weight".to_string(),
            Tensor::from_vec(w1, (inter, d), &dev)?,
        );
        ts.insert(
            "w3.weight".to_string(),
            Tensor::from_vec(w3, (inter, d), &dev)?,
        );
        ts.insert(
            "w2.weight".to_string(),
            Tensor::from_vec(w2, (d, inter), &dev)?,
        );
        let vb = VarBuilder::from_tensors(ts, DType::F32, &dev);
        let expert = Expert::new(d, inter, limit as f64, Numerics::PLAIN, vb.clone())?;
        let unclamped = Expert::new(d, inter, 0.0, Numerics::PLAIN, vb)?;
        let xt = Tensor::from_vec(x, (1, d), &dev)?;
        let w = Tensor::new(&[[0.75f32]], &dev)?;
        let got = expert.forward(&xt, Some(&w))?.to_vec2::<f32>()?[0].clone();
        let free = unclamped.forward(&xt, Some(&w))?.to_vec2::<f32>()?[0].clone();
        let silu = |a: f32| a / (1.0 + (-a).exp());
        for j in 0..inter {
            let (a, u) = (2.0 * gate_rows[j], 2.0 * up_rows[j]);
            let want = silu(a.min(limit)) * u.clamp(-limit, limit) * 0.75;
            assert!(
                (got[j] - want).abs() <= 1e-6 * want.abs().max(1.0),
                "col {j}: {} vs {want}",
                got[j]
            );
            let want_free = silu(a) * u * 0.75;
            assert!((free[j] - want_free).abs() <= 1e-6 * want_free.abs().max(1.0));
        }
        // The clamp is active here: rows 0 (gate 4 → 0.5, up −2 → −0.5) and 2 (up 4 → 0.5).
        assert!((got[0] - free[0]).abs() > 0.1 && (got[2] - free[2]).abs() > 0.1);
        // Upper-only on the gate: a = −6 is not raised to −0.5.
        let want1 = silu(-6.0) * 0.25 * 0.75;
        assert!((got[1] - want1).abs() < 1e-7);
        assert!(got[4..].iter().all(|&v| v == 0.0));
        Ok(())
    }

    #[test]
    fn softplus_is_stable() {
        assert_eq!(softplus(100.0), 100.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        let tiny = softplus(-30.0);
        assert!(tiny > 0.0 && (tiny / (-30f32).exp() - 1.0).abs() < 1e-5);
    }
}
