//! The MoE routing's slots grouped by expert (the input order of a grouped expert kernel), and
//! the host reference of the device router `cuda::moe_route_device` (`kernels/moe_route.cu`,
//! spec §8 steps 1–4).
//!
//! A routing of `T` tokens with `k` experts each has `T·k` slots; slot `t·k + j` is token `t`'s
//! `j`-th choice. [`sort_by_expert`] lists the slots of expert 0, then expert 1, …, each expert's
//! in ascending slot order (a stable counting sort), with the per-expert counts and offsets.

use candle_core::Result;

use super::moe::{router_score, select_experts, Routing};

/// The slots of a routing grouped by expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertSort {
    /// `[E]`: how many slots chose each expert.
    pub counts: Vec<u32>,
    /// `[E + 1]`: the exclusive prefix sum of `counts` (`offsets[E]` = `T·k`): expert `e`'s
    /// slots are `order[offsets[e]..offsets[e + 1]]`.
    pub offsets: Vec<u32>,
    /// `[T·k]`: the slot indices `t·k + j`, grouped by expert ascending, ascending within an
    /// expert.
    pub order: Vec<u32>,
}

/// Groups the slots of `ids` (`[T·k]`, the experts of [`Routing::ids`], each `< n_experts`) by
/// expert (a stable counting sort). Errors on an id `>= n_experts` or more than `u32::MAX` slots.
pub fn sort_by_expert(ids: &[u32], n_experts: usize) -> Result<ExpertSort> {
    if u32::try_from(ids.len()).is_err() {
        candle_core::bail!("sort_by_expert: {} slots do not fit u32 slot indices", ids.len())
    }
    let mut counts = vec![0u32; n_experts];
    for (s, &e) in ids.iter().enumerate() {
        match counts.get_mut(e as usize) {
            Some(c) => *c += 1,
            None => candle_core::bail!("sort_by_expert: slot {s} has expert {e}, not below n_experts = {n_experts}"),
        }
    }
    let mut offsets = Vec::with_capacity(n_experts + 1);
    let mut acc = 0u32;
    offsets.push(0);
    for &c in &counts {
        acc += c;
        offsets.push(acc);
    }
    let mut next: Vec<u32> = offsets[..n_experts].to_vec();
    let mut order = vec![0u32; ids.len()];
    for (s, &e) in ids.iter().enumerate() {
        order[next[e as usize] as usize] = s as u32;
        next[e as usize] += 1;
    }
    Ok(ExpertSort { counts, offsets, order })
}

/// The router decision and its sort, on the host, for the router logits `logits` (`[T, E]` f32,
/// row-major, before `gate_temp`) and the selection `bias` `[E]`: what `cuda::moe_route_device`
/// computes, with [`super::Gate::route`]'s arithmetic — `l · f32(1 / temp) + 0` when `temp != 1`
/// (candle's `Tensor / f64`), `sqrt(softplus(·))`, then the top-`k` and weights of the crate's
/// selection (ties: lower expert id first).
///
/// Errors on `E = 0`, a `logits` length that is not a multiple of `E`, a `bias` of another
/// length, `k` outside `1..=E`, or `temp` not finite and > 0.
pub fn moe_route_ref(
    logits: &[f32],
    n_experts: usize,
    bias: &[f32],
    k: usize,
    temp: f32,
    route_scale: f32,
) -> Result<(Routing, ExpertSort)> {
    let op = "moe_route_ref";
    let e = n_experts;
    if e == 0 || !logits.len().is_multiple_of(e) || bias.len() != e {
        candle_core::bail!("{op}: logits of {} values and bias of {} do not make [T, E] rows with E = {e} >= 1", logits.len(), bias.len())
    }
    if !(1..=e).contains(&k) {
        candle_core::bail!("{op}: k = {k} not in 1..={e}")
    }
    if !temp.is_finite() || temp <= 0.0 {
        candle_core::bail!("{op}: temp must be finite and > 0, got {temp}")
    }
    let scale = (1.0 / temp as f64) as f32;
    let scores: Vec<Vec<f32>> = logits
        .chunks(e)
        .map(|row| row.iter().map(|&l| router_score(if temp == 1.0 { l } else { l * scale + 0.0 })).collect())
        .collect();
    let routing = select_experts(&scores, bias, k, route_scale);
    let sort = sort_by_expert(&routing.ids, e)?;
    Ok((routing, sort))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sort_by_hand() -> Result<()> {
        // T = 3, k = 2: token 0 → (2, 0), token 1 → (0, 3), token 2 → (2, 3); expert 1 idle.
        let s = sort_by_expert(&[2, 0, 0, 3, 2, 3], 4)?;
        assert_eq!(s.counts, vec![2, 0, 2, 2]);
        assert_eq!(s.offsets, vec![0, 2, 2, 4, 6]);
        assert_eq!(s.order, vec![1, 2, 0, 4, 3, 5]);
        assert!(sort_by_expert(&[0, 4], 4).is_err());
        let empty = sort_by_expert(&[], 3)?;
        assert_eq!((empty.counts, empty.offsets, empty.order.len()), (vec![0; 3], vec![0; 4], 0));
        Ok(())
    }

    /// Random routings: `order` is a permutation, grouped by expert ascending and ascending within
    /// each group, and the groups have `counts[e]` slots of expert e starting at `offsets[e]`.
    #[test]
    fn sort_properties_on_random_ids() -> Result<()> {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for &(t, k, e) in &[(1usize, 1usize, 4usize), (37, 6, 16), (200, 8, 384), (5, 3, 3)] {
            let mut ids = Vec::with_capacity(t * k);
            for _ in 0..t {
                let mut row: Vec<u32> = Vec::with_capacity(k);
                while row.len() < k {
                    let x = next(e) as u32;
                    if !row.contains(&x) {
                        row.push(x);
                    }
                }
                ids.extend(row);
            }
            let s = sort_by_expert(&ids, e)?;
            let mut seen = vec![false; t * k];
            for x in 0..e {
                let (a, b) = (s.offsets[x] as usize, s.offsets[x + 1] as usize);
                assert_eq!((b - a) as u32, s.counts[x]);
                assert_eq!(s.counts[x] as usize, ids.iter().filter(|&&i| i as usize == x).count());
                let group = &s.order[a..b];
                assert!(group.windows(2).all(|w| w[0] < w[1]), "expert {x}: slots not ascending");
                for &slot in group {
                    assert_eq!(ids[slot as usize] as usize, x);
                    assert!(!std::mem::replace(&mut seen[slot as usize], true));
                }
            }
            assert!(seen.iter().all(|&v| v));
            assert_eq!(s.offsets[e] as usize, t * k);
        }
        Ok(())
    }

    /// The reference routes like `select_experts` over `router_score`s of the temperature-scaled
    /// logits, and its sort is `sort_by_expert` of those ids.
    #[test]
    fn reference_matches_the_gate_arithmetic() -> Result<()> {
        let e = 5;
        let logits = [0.3f32, -1.0, 2.5, 25.0, 0.0, 1.0, 1.0, 1.0, -3.0, 1.0];
        let bias = [0.0f32, 0.5, 0.0, -3.0, 0.25];
        let (r, s) = moe_route_ref(&logits, e, &bias, 2, 0.5, 1.5)?;
        let scores: Vec<Vec<f32>> = logits.chunks(e).map(|row| row.iter().map(|&l| router_score(l * 2.0 + 0.0)).collect()).collect();
        assert_eq!(r, select_experts(&scores, &bias, 2, 1.5));
        assert_eq!(s, sort_by_expert(&r.ids, e)?);
        // Row 0 (logits · 2): biased ≈ [1.02, 0.86, 2.24, 4.07, 1.08] → 3, 2.
        assert_eq!(&r.ids[..2], &[3, 2]);
        // Row 1: experts 0, 2, 4 have equal logits; 4 has +0.25 bias and 1 has +0.5.
        assert_eq!(&r.ids[2..], &[1, 4]);
        assert!(moe_route_ref(&logits, 0, &bias, 2, 1.0, 1.5).is_err());
        assert!(moe_route_ref(&logits, 3, &bias, 2, 1.0, 1.5).is_err());
        assert!(moe_route_ref(&logits, e, &bias, 6, 1.0, 1.5).is_err());
        assert!(moe_route_ref(&logits, e, &bias, 2, f32::NAN, 1.5).is_err());
        Ok(())
    }
}
