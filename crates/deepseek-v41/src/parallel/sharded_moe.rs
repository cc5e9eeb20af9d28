//! [`ShardedMoe`]: one rank's part of an expert-parallel MoE layer (the module docs of
//! [`crate::parallel`] give the protocol).

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use super::{Collective, ExpertPlacement};
use crate::config::Config;
use crate::model::moe::{add_routed, add_shared, runs};
use crate::model::{sort_by_expert, Expert, ExpertSort, Gate};
use crate::nn::linear::{named, prefixed, NamedLinears};
use crate::nn::RowGroups;
use crate::Numerics;

/// The router, the shared expert and this rank's routed experts of `layers.N.ffn`.
#[derive(Debug, Clone)]
pub struct ShardedMoe {
    gate: Gate,
    /// The experts of `placement.range()`, in order.
    experts: Vec<Expert>,
    shared: Option<Expert>,
    placement: ExpertPlacement,
    /// This rank's experts for the grouped kernels (`cuda::moe_experts_device`): on a CUDA
    /// device when they are MXFP4 and the linears quantize their activations.
    #[cfg(feature = "cuda")]
    grouped: Option<crate::cuda::GroupedExperts>,
}

/// A routed slot as it travels to its expert's rank: the expert, the routing weight, and the
/// sequence it belongs to (source rank, row group) — what the expert's row groups are made of.
/// Its token row travels beside it ([`Collective::all_to_all_rows`]).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Slot {
    expert: u32,
    weight: f32,
    group: u32,
}

const SLOT_BYTES: usize = 12;

/// `[n × (expert u32, weight f32, group u32)]`, little-endian.
fn encode(slots: &[Slot]) -> Vec<u8> {
    let mut out = Vec::with_capacity(slots.len() * SLOT_BYTES);
    for s in slots {
        out.extend_from_slice(&s.expert.to_le_bytes());
        out.extend_from_slice(&s.weight.to_bits().to_le_bytes());
        out.extend_from_slice(&s.group.to_le_bytes());
    }
    out
}

fn word(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Inverse of [`encode`]; errors on a malformed buffer.
fn decode(b: &[u8], from: usize) -> Result<Vec<Slot>> {
    if !b.len().is_multiple_of(SLOT_BYTES) {
        candle_core::bail!("expert parallel: a malformed dispatch buffer of {} bytes from rank {from}", b.len())
    }
    Ok(b.chunks_exact(SLOT_BYTES).map(|c| Slot { expert: word(c, 0), weight: f32::from_bits(word(c, 4)), group: word(c, 8) }).collect())
}

/// The rows `at` of `x` `[T, D]` (an empty `[0, D]` for none).
fn rows(x: &Tensor, at: &[u32]) -> Result<Tensor> {
    let d = x.dim(1)?;
    if at.is_empty() {
        return Tensor::zeros((0, d), x.dtype(), x.device());
    }
    x.index_select(&Tensor::from_slice(at, at.len(), x.device())?, 0)
}

/// The tensors' rows in order (an empty `[0, width]` of `dtype` for none).
fn cat_rows(parts: &[Tensor], width: usize, dtype: DType, dev: &candle_core::Device) -> Result<Tensor> {
    let parts: Vec<&Tensor> = parts.iter().filter(|t| t.dim(0).is_ok_and(|n| n > 0)).collect();
    match parts.len() {
        0 => Tensor::zeros((0, width), dtype, dev),
        1 => Ok(parts[0].clone()),
        _ => Tensor::cat(&parts, 0),
    }
}

impl ShardedMoe {
    /// Loads `gate`, `shared_experts` and the experts `placement.range()` of `vb` = `layers.N.ffn`
    /// (the other experts' tensors are not read). Errors when the placement is for another
    /// number of experts than `cfg.n_routed_experts`.
    pub fn new(cfg: &Config, numerics: Numerics, vb: VarBuilder, placement: ExpertPlacement) -> Result<Self> {
        if placement.experts() != cfg.n_routed_experts {
            candle_core::bail!("ShardedMoe: a placement of {} experts for a layer of {}", placement.experts(), cfg.n_routed_experts)
        }
        let (d, inter, limit) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit);
        let experts = placement.range().map(|e| Expert::new(d, inter, limit, numerics, vb.pp("experts").pp(e))).collect::<Result<Vec<_>>>()?;
        let shared = match cfg.n_shared_experts {
            0 => None,
            n => Some(Expert::new(d, inter * n, limit, numerics, vb.pp("shared_experts"))?),
        };
        #[cfg(feature = "cuda")]
        let grouped = crate::model::moe::grouped_experts(&experts, numerics)?;
        Ok(Self {
            gate: Gate::new(cfg, vb.pp("gate"))?,
            experts,
            shared,
            placement,
            #[cfg(feature = "cuda")]
            grouped,
        })
    }

    /// Where the routed experts are.
    pub fn placement(&self) -> &ExpertPlacement {
        &self.placement
    }

    /// This rank's routed experts (`placement().range()`, in order).
    pub fn experts(&self) -> &[Expert] {
        &self.experts
    }

    /// This rank's routed experts in the grouped form of `cuda::moe_experts_device` (MXFP4
    /// experts on a CUDA device with the activation quantization on), else `None`: with them and
    /// the device routing on (`cuda::with_device_routing`), the received slots run through the
    /// grouped kernels, else through the per-expert loop.
    #[cfg(feature = "cuda")]
    pub fn grouped_experts(&self) -> Option<&crate::cuda::GroupedExperts> {
        self.grouped.as_ref()
    }

    /// Every linear this rank holds with its checkpoint prefix (`gate`, `experts.E.w1` with the
    /// global expert id, `shared_experts.w2`, ...).
    pub fn linears(&self) -> NamedLinears<'_> {
        let mut v = named([("gate", self.gate.proj())]);
        for (e, expert) in self.placement.range().zip(&self.experts) {
            v.extend(prefixed(&format!("experts.{e}"), expert.linears()));
        }
        if let Some(shared) = &self.shared {
            v.extend(prefixed("shared_experts", shared.linears()));
        }
        v
    }

    /// The MoE output `[T, D]` of this rank's tokens `x` `[T, D]` (bf16, ffn-normed; `groups`:
    /// its sequences, as for [`crate::model::Moe::forward_grouped`]; T = 0 allowed). A
    /// collective: every rank of `comm` calls it once per layer and step, with its own tokens.
    /// The routed slots go to their experts' ranks (their metadata as host bytes, their token rows
    /// with [`Collective::all_to_all_rows`], which keeps them on the device where the collective
    /// can), the outputs come back the same way; the rows stay on `x`'s device otherwise.
    pub fn forward(&self, x: &Tensor, groups: &RowGroups, comm: &dyn Collective) -> Result<Tensor> {
        let p = &self.placement;
        if comm.world() != p.world() || comm.rank() != p.rank() {
            candle_core::bail!("ShardedMoe: rank {} of {} in the group, placed as rank {} of {}", comm.rank(), comm.world(), p.rank(), p.world())
        }
        let (t, d) = x.dims2()?;
        if x.dtype() != DType::BF16 {
            // The exchange carries bf16 rows and outputs: another dtype would be rounded on the way.
            candle_core::bail!("ShardedMoe: the input is {:?}; expert parallelism exchanges bf16 activations (load the model in bf16)", x.dtype())
        }
        let dev = x.device();
        let world = p.world();
        // Route locally: slot s = token s / k, its expert ids[s].
        let (k, ids, weights) = if t == 0 {
            (1, Vec::new(), Vec::new())
        } else {
            let r = self.gate.route_grouped(x, groups)?;
            (r.k, r.ids, r.weights)
        };
        let group_of: Vec<u32> = groups.groups().iter().enumerate().flat_map(|(i, g)| std::iter::repeat_n(i as u32, g.len)).collect();
        if group_of.len() != t {
            candle_core::bail!("ShardedMoe: the row groups cover {} rows, the input has {t}", group_of.len())
        }
        // Dispatch: each rank's slots in slot order.
        let mut sent: Vec<Vec<usize>> = vec![Vec::new(); world];
        for (s, &e) in ids.iter().enumerate() {
            if e as usize >= p.experts() {
                candle_core::bail!("ShardedMoe: routed to expert {e} of {}", p.experts())
            }
            sent[p.owner(e as usize)].push(s);
        }
        let meta = sent.iter().map(|slots| encode(&slots.iter().map(|&s| Slot { expert: ids[s], weight: weights[s], group: group_of[s / k] }).collect::<Vec<_>>())).collect();
        let send_rows = sent.iter().map(|slots| rows(x, &slots.iter().map(|&s| (s / k) as u32).collect::<Vec<_>>())).collect::<Result<Vec<_>>>()?;
        let got_meta = comm.all_to_all(meta)?;
        let got_rows = comm.all_to_all_rows(send_rows, d, dev)?;
        // Every received slot, in received order (source by source).
        let mut slots: Vec<(usize, Slot)> = Vec::new();
        let mut per_source = Vec::with_capacity(world);
        for (src, (buf, r)) in got_meta.iter().zip(&got_rows).enumerate() {
            let m = decode(buf, src)?;
            if r.dim(0)? != m.len() {
                candle_core::bail!("expert parallel: rank {src} sent {} slots and {} rows", m.len(), r.dim(0)?)
            }
            per_source.push(m.len());
            slots.extend(m.into_iter().map(|s| (src, s)));
        }
        let n = slots.len();
        // The received slots' experts as indices into this rank's, and the slots grouped by them
        // (in received order within one).
        let local = slots
            .iter()
            .map(|(_, slot)| match (slot.expert as usize).checked_sub(p.range().start).filter(|&i| i < self.experts.len()) {
                Some(i) => Ok(i as u32),
                None => candle_core::bail!("expert parallel: rank {} received a slot of expert {}, it holds {:?}", p.rank(), slot.expert, p.range()),
            })
            .collect::<Result<Vec<_>>>()?;
        let sort = sort_by_expert(&local, self.experts.len())?;
        // Compute every received slot with its expert; the outputs in received order.
        let outs = if n == 0 {
            Tensor::zeros((0, d), DType::BF16, dev)?
        } else if let Some(outs) = self.received_on_device(&got_rows, &slots, &local, &sort, d, dev)? {
            outs
        } else {
            let xr = cat_rows(&got_rows, d, DType::BF16, dev)?;
            let xp = match (self.experts.first(), &self.shared) {
                (Some(e), _) | (None, Some(e)) => e.prepare_input(&xr)?,
                (None, None) => xr,
            };
            let mut parts = Vec::new();
            for (i, expert) in self.experts.iter().enumerate() {
                // The received slots of local expert i, in received order.
                let mine = &sort.order[sort.offsets[i] as usize..sort.offsets[i + 1] as usize];
                if mine.is_empty() {
                    continue;
                }
                let slot = |j: u32| &slots[j as usize];
                let ws = Tensor::from_vec(mine.iter().map(|&j| slot(j).1.weight).collect::<Vec<_>>(), (mine.len(), 1), dev)?;
                let eg = runs(mine.iter().map(|&j| (slot(j).0, slot(j).1.group)));
                parts.push(expert.forward_prepared_grouped(&rows(&xp, mine)?, Some(&ws), &eg)?.to_dtype(DType::BF16)?);
            }
            // Back into received order: the experts' outputs are in `sort.order`, so received
            // slot j is row at[j] of them.
            let mut at = vec![0u32; n];
            for (q, &j) in sort.order.iter().enumerate() {
                at[j as usize] = q as u32;
            }
            rows(&cat_rows(&parts, d, DType::BF16, dev)?, &at)?
        };
        // Combine: the outputs back to their sources, in the order they came.
        let mut first = 0;
        let back = per_source
            .iter()
            .map(|&m| {
                let b = outs.narrow(0, first, m);
                first += m;
                b
            })
            .collect::<Result<Vec<_>>>()?;
        let returned = comm.all_to_all_rows(back, d, dev)?;
        // Slot s's output is row pos[s] of the returned rows (destination by destination).
        let mut pos = vec![0u32; ids.len()];
        let mut base = 0;
        for (dst, slots_sent) in sent.iter().enumerate() {
            if returned[dst].dim(0)? != slots_sent.len() {
                candle_core::bail!("expert parallel: rank {dst} returned {} rows for {} slots", returned[dst].dim(0)?, slots_sent.len())
            }
            for (q, &s) in slots_sent.iter().enumerate() {
                pos[s] = (base + q) as u32;
            }
            base += slots_sent.len();
        }
        let all = cat_rows(&returned, d, DType::BF16, dev)?;
        // The f32 sum in expert-id order, then the shared expert (model::Moe::forward_grouped).
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); p.experts()];
        for (s, &e) in ids.iter().enumerate() {
            by_expert[e as usize].push(s);
        }
        let mut y: Option<Tensor> = None;
        for mine in &by_expert {
            if mine.is_empty() {
                continue;
            }
            let out = rows(&all, &mine.iter().map(|&s| pos[s]).collect::<Vec<_>>())?;
            y = Some(if mine.len() == t {
                add_routed(y, &out, None)?
            } else {
                let at = Tensor::from_vec(mine.iter().map(|&s| (s / k) as u32).collect::<Vec<_>>(), mine.len(), dev)?;
                add_routed(y, &out, Some((&at, t)))?
            });
        }
        let xp = match &self.shared {
            Some(shared) => Some((shared, shared.prepare_input(x)?)),
            None => None,
        };
        add_shared(y, xp.as_ref().map(|(s, xp)| (*s, xp)), x, groups)
    }
}

impl ShardedMoe {
    /// The received slots' outputs `[n, D]` bf16 in received order from the grouped expert
    /// kernels (`cuda::moe_experts_device` with one expert per received row, the rank's experts
    /// as the group: each row's SwiGLU times its weight, `w2`, as the single-GPU device path
    /// computes a slot), where this rank has them and the device routing is on; else `None`
    /// (the per-expert loop). `local`: each row's expert among the rank's; `sort`: the rows
    /// grouped by it. Both are known on the host (the slots came as metadata): they go to the
    /// device in one upload (the routing's u32 tensors are views of it) beside the weights, with
    /// no device read.
    #[cfg(feature = "cuda")]
    fn received_on_device(
        &self,
        got_rows: &[Tensor],
        slots: &[(usize, Slot)],
        local: &[u32],
        sort: &ExpertSort,
        d: usize,
        dev: &candle_core::Device,
    ) -> Result<Option<Tensor>> {
        let Some(g) = &self.grouped else { return Ok(None) };
        if !crate::cuda::device_routing(dev) {
            return Ok(None);
        }
        let (n, e) = (local.len(), sort.counts.len());
        // [ids n | counts e | offsets e + 1 | order n]
        let packed: Vec<u32> = [local, &sort.counts, &sort.offsets, &sort.order].concat();
        let packed = Tensor::from_vec(packed, 2 * n + 2 * e + 1, dev)?;
        let routing = crate::cuda::DeviceRouting {
            ids: packed.narrow(0, 0, n)?.reshape((n, 1))?,
            weights: Tensor::from_vec(slots.iter().map(|(_, s)| s.weight).collect::<Vec<_>>(), (n, 1), dev)?,
            counts: packed.narrow(0, n, e)?,
            offsets: packed.narrow(0, n + e, e + 1)?,
            order: packed.narrow(0, n + 2 * e + 1, n)?,
        };
        let xr = cat_rows(got_rows, d, DType::BF16, dev)?.contiguous()?;
        let limit = self.experts.first().and_then(|e| e.limit()).map(|l| l as f32);
        // k = 1 and no shared expert: the combine's bf16(0 + y) is each row's y as it is.
        Ok(Some(crate::cuda::moe_experts_device(&xr, &routing, g, limit, None)?.out))
    }

    #[cfg(not(feature = "cuda"))]
    fn received_on_device(&self, _: &[Tensor], _: &[(usize, Slot)], _: &[u32], _: &ExpertSort, _: usize, _: &candle_core::Device) -> Result<Option<Tensor>> {
        Ok(None)
    }
}
