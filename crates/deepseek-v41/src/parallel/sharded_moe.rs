//! [`ShardedMoe`]: one rank's part of an expert-parallel MoE layer (the module docs of
//! [`crate::parallel`] give the protocol).

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;
use half::bf16;

use super::{Collective, ExpertPlacement};
use crate::config::Config;
use crate::model::moe::{accumulate, runs};
use crate::model::{Expert, Gate};
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
}

/// A routed slot as it travels to its expert's rank: the expert, the routing weight, and the
/// sequence it belongs to (source rank, row group) — what the expert's row groups are made of.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Slot {
    expert: u32,
    weight: f32,
    group: u32,
}

const SLOT_BYTES: usize = 12;

/// `[n: u64][n × (expert u32, weight f32, group u32)][n × D bf16]`, little-endian.
fn encode(slots: &[Slot], rows: &[bf16]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + slots.len() * SLOT_BYTES + rows.len() * 2);
    out.extend_from_slice(&(slots.len() as u64).to_le_bytes());
    for s in slots {
        out.extend_from_slice(&s.expert.to_le_bytes());
        out.extend_from_slice(&s.weight.to_bits().to_le_bytes());
        out.extend_from_slice(&s.group.to_le_bytes());
    }
    out.extend_from_slice(&bf16_bytes(rows));
    out
}

fn word(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// bf16 values as little-endian bytes (the combine's messages: the outputs, no header).
fn bf16_bytes(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

fn bf16s(b: &[u8]) -> Vec<bf16> {
    b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect()
}

/// Inverse of [`encode`] for rows of `dim` values; errors on a malformed buffer.
fn decode(b: &[u8], dim: usize, from: usize) -> Result<(Vec<Slot>, Vec<bf16>)> {
    let bad = || candle_core::Error::Msg(format!("expert parallel: a malformed dispatch buffer of {} bytes from rank {from}", b.len()));
    let n = u64::from_le_bytes(b.get(..8).ok_or_else(bad)?.try_into().map_err(|_| bad())?) as usize;
    let rows_at = n.checked_mul(SLOT_BYTES).and_then(|v| v.checked_add(8)).ok_or_else(bad)?;
    if n.checked_mul(dim * 2).and_then(|v| v.checked_add(rows_at)) != Some(b.len()) {
        return Err(bad());
    }
    let slots = (0..n)
        .map(|i| {
            let at = 8 + i * SLOT_BYTES;
            Slot { expert: word(b, at), weight: f32::from_bits(word(b, at + 4)), group: word(b, at + 8) }
        })
        .collect();
    Ok((slots, bf16s(&b[rows_at..])))
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
        Ok(Self { gate: Gate::new(cfg, vb.pp("gate"))?, experts, shared, placement })
    }

    /// Where the routed experts are.
    pub fn placement(&self) -> &ExpertPlacement {
        &self.placement
    }

    /// This rank's routed experts (`placement().range()`, in order).
    pub fn experts(&self) -> &[Expert] {
        &self.experts
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
    /// Two exchanges: the routed slots' rows to their experts' ranks, the outputs back.
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
        let xs: Vec<bf16> = x.flatten_all()?.to_vec1()?;
        // Dispatch: each rank's slots in slot order.
        let mut sent: Vec<Vec<usize>> = vec![Vec::new(); world];
        for (s, &e) in ids.iter().enumerate() {
            if e as usize >= p.experts() {
                candle_core::bail!("ShardedMoe: routed to expert {e} of {}", p.experts())
            }
            sent[p.owner(e as usize)].push(s);
        }
        let send = sent
            .iter()
            .map(|slots| {
                let meta: Vec<Slot> = slots.iter().map(|&s| Slot { expert: ids[s], weight: weights[s], group: group_of[s / k] }).collect();
                let rows: Vec<bf16> = slots.iter().flat_map(|&s| xs[(s / k) * d..(s / k + 1) * d].iter().copied()).collect();
                encode(&meta, &rows)
            })
            .collect();
        let got = comm.all_to_all(send)?;
        // Compute every received slot with its expert; outputs in received order.
        let mut slots: Vec<(usize, Slot)> = Vec::new();
        let mut rows: Vec<bf16> = Vec::new();
        let mut per_source = Vec::with_capacity(world);
        for (src, buf) in got.iter().enumerate() {
            let (m, r) = decode(buf, d, src)?;
            per_source.push(m.len());
            slots.extend(m.into_iter().map(|s| (src, s)));
            rows.extend(r);
        }
        let n = slots.len();
        let mut outs: Vec<bf16> = vec![bf16::ZERO; n * d];
        if n > 0 {
            let xr = Tensor::from_vec(rows, (n, d), dev)?;
            let xp = match (self.experts.first(), &self.shared) {
                (Some(e), _) | (None, Some(e)) => e.prepare_input(&xr)?,
                (None, None) => xr,
            };
            // The received slots of each local expert, in received order.
            let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); self.experts.len()];
            for (j, (_, slot)) in slots.iter().enumerate() {
                match (slot.expert as usize).checked_sub(p.range().start).and_then(|i| by_expert.get_mut(i)) {
                    Some(v) => v.push(j),
                    None => candle_core::bail!("expert parallel: rank {} received a slot of expert {}, it holds {:?}", p.rank(), slot.expert, p.range()),
                }
            }
            for (expert, mine) in self.experts.iter().zip(&by_expert) {
                if mine.is_empty() {
                    continue;
                }
                let ws = Tensor::from_vec(mine.iter().map(|&j| slots[j].1.weight).collect::<Vec<_>>(), (mine.len(), 1), dev)?;
                let sel = Tensor::from_vec(mine.iter().map(|&j| j as u32).collect::<Vec<_>>(), mine.len(), dev)?;
                let eg = runs(mine.iter().map(|&j| (slots[j].0, slots[j].1.group)));
                let out: Vec<bf16> = expert.forward_prepared_grouped(&xp.index_select(&sel, 0)?, Some(&ws), &eg)?.to_dtype(DType::BF16)?.flatten_all()?.to_vec1()?;
                for (q, &j) in mine.iter().enumerate() {
                    outs[j * d..(j + 1) * d].copy_from_slice(&out[q * d..(q + 1) * d]);
                }
            }
        }
        // Combine: the outputs back to their sources, in the order they came.
        let mut at = 0;
        let back: Vec<Vec<u8>> = per_source
            .iter()
            .map(|&m| {
                let b = bf16_bytes(&outs[at * d..(at + m) * d]);
                at += m;
                b
            })
            .collect();
        let returned = comm.all_to_all(back)?;
        let mut slot_out: Vec<Option<&[bf16]>> = vec![None; ids.len()];
        let decoded: Vec<Vec<bf16>> = returned
            .iter()
            .enumerate()
            .map(|(src, b)| {
                let v = bf16s(b);
                if v.len() != sent[src].len() * d {
                    candle_core::bail!("expert parallel: rank {src} returned {} values for {} slots of width {d}", v.len(), sent[src].len())
                }
                Ok(v)
            })
            .collect::<Result<_>>()?;
        for (dst, slots_sent) in sent.iter().enumerate() {
            for (q, &s) in slots_sent.iter().enumerate() {
                slot_out[s] = Some(&decoded[dst][q * d..(q + 1) * d]);
            }
        }
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
            let vals: Vec<bf16> = mine.iter().flat_map(|&s| slot_out[s].unwrap_or(&[]).iter().copied()).collect();
            let out = Tensor::from_vec(vals, (mine.len(), d), dev)?;
            if mine.len() == t {
                y = Some(accumulate(y.as_ref(), &out, DType::F32)?);
            } else {
                let at = Tensor::from_vec(mine.iter().map(|&s| (s / k) as u32).collect::<Vec<_>>(), mine.len(), dev)?;
                let acc = match y {
                    Some(y) => y,
                    None => Tensor::zeros((t, d), DType::F32, dev)?,
                };
                y = Some(acc.index_add(&at, &out.to_dtype(DType::F32)?, 0)?);
            }
        }
        Ok(match (&self.shared, y) {
            (Some(shared), y) => {
                let xp = shared.prepare_input(x)?;
                accumulate(y.as_ref(), &shared.forward_prepared_grouped(&xp, None, groups)?, x.dtype())?
            }
            (None, Some(y)) => y.to_dtype(x.dtype())?,
            (None, None) => Tensor::zeros((t, d), x.dtype(), dev)?,
        })
    }
}
