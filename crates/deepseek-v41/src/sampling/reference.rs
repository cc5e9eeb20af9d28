//! The CPU reference of the sampler ([`super`] defines the algorithm): one row at a time, the
//! candidates as a prefix of the fully sorted row, then the Gumbel-max draw over them. The CUDA
//! kernel (`kernels/sampling.cu`) reaches the same candidate set by radix selection and the same
//! draw by a block reduction; both use [`super::math`], so they pick the same id.

use super::math::{
    element_bits, gumbel, key_value, mass, nucleus_target, order_key, ranked, ranked_id, row_stream, GUMBEL_BOUND,
};
use super::{SamplingError, SamplingParams};

/// What the reference decided for one row, with how close the decision was (tests compare a
/// kernel's choice against it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleDecision {
    /// The chosen token id.
    pub id: u32,
    /// How many candidates the draw ran over (a prefix of the row's order; 1 when greedy).
    pub kept: usize,
    /// A lower bound of the gap between the best and the second-best perturbed score of the
    /// candidates: how far the draw was from choosing another id (+inf with one candidate or
    /// greedy).
    pub margin: f32,
    /// How close `top_p` was to changing the number of candidates: its distance to the nearer of
    /// the two prefix masses around it, as fractions of the row's mass (+inf when the nucleus does
    /// not bound the candidates).
    pub nucleus_slack: f64,
}

/// Greedy decoding: the index of the largest logit, the lowest index on ties, NaN counted as −inf
/// (and −0 equal to +0); 0 for an empty row.
pub fn argmax_ref(logits: &[f32]) -> u32 {
    let top = logits.iter().enumerate().map(|(i, &l)| ranked(order_key(l), i as u32)).max();
    top.map_or(0, ranked_id)
}

/// One token from `logits` (one row of `vocab` entries) with `params` at draw `step` — the
/// reference of [`super::sample_batch`] (`kernels/sampling.cu` picks the same id).
///
/// Errors when `params` are invalid for this row ([`SamplingParams::check`]).
pub fn sample_row_ref(logits: &[f32], params: &SamplingParams, step: u64) -> Result<SampleDecision, SamplingError> {
    params.check(0, logits.len())?;
    Ok(decide(logits, params, step))
}

/// [`sample_row_ref`] of checked inputs. Also defined for values the checks refuse (the kernel
/// reads them from a device table): temperature <= 0 or NaN is greedy, `top_k >= vocab` is no
/// top-k, `top_p >= 1` or NaN is no nucleus, `top_p <= 0` keeps one candidate.
pub(crate) fn decide(logits: &[f32], p: &SamplingParams, step: u64) -> SampleDecision {
    let v = logits.len();
    let keys: Vec<u32> = logits.iter().map(|&l| order_key(l)).collect();
    let top = keys.iter().enumerate().map(|(i, &k)| ranked(k, i as u32)).max().unwrap_or(0);
    let a = ranked_id(top);
    let m = key_value((top >> 32) as u32);
    if p.temperature.is_nan() || p.temperature <= 0.0 || !m.is_finite() {
        return SampleDecision { id: a, kept: 1, margin: f32::INFINITY, nucleus_slack: f64::INFINITY };
    }
    let t = p.temperature;
    let x = |key: u32| (key_value(key) - m) / t;
    let k = if p.top_k == 0 || p.top_k as usize >= v { v } else { p.top_k as usize };
    let nucleus = p.top_p < 1.0;
    let mut nucleus_slack = f64::INFINITY;
    // The candidates: the first n entries of the row ordered by logit, descending, lower ids
    // first among equal logits; all of them when nothing truncates. With a nucleus only entries
    // of positive mass can be candidates (they are a prefix of the order and hold all of Z);
    // with top-k alone only the k largest.
    let candidates: Option<Vec<u32>> = if k < v || nucleus {
        let mut order: Vec<(u64, u64)> = keys
            .iter()
            .enumerate()
            .filter_map(|(i, &key)| {
                let q = if nucleus { mass(x(key)) } else { 0 };
                (!nucleus || q > 0).then_some((ranked(key, i as u32), q))
            })
            .collect();
        if !nucleus {
            order.select_nth_unstable_by(k - 1, |a, b| b.0.cmp(&a.0));
            order.truncate(k);
        }
        order.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        let mut n = k;
        if nucleus {
            let z: u64 = order.iter().map(|e| e.1).sum();
            let target = nucleus_target(p.top_p, z);
            let mut before = 0u64;
            let mut n_p = order.len();
            for (j, &(_, w)) in order.iter().enumerate() {
                if before + w >= target {
                    n_p = j + 1;
                    break;
                }
                before += w;
            }
            if n_p <= k {
                let (zf, tp) = (z as f64, p.top_p as f64);
                let below = tp - before as f64 / zf;
                let above = (before + order[n_p - 1].1) as f64 / zf - tp;
                nucleus_slack = below.min(above).max(0.0);
            }
            n = n.min(n_p);
        }
        Some(order[..n].iter().map(|e| ranked_id(e.0)).collect())
    } else {
        None
    };
    let kept = candidates.as_ref().map_or(v, Vec::len);

    // The draw: argmax of x + Gumbel over the candidates. The row's argmax `a` is always a
    // candidate, so its score bounds the winner's from below, and an entry with x below that
    // score minus GUMBEL_BOUND can neither win nor tie: it is skipped (as in the kernel).
    let stream = row_stream(p.seed, step);
    let lb = x(keys[a as usize]) + gumbel(element_bits(stream, a));
    let skip_below = lb - GUMBEL_BOUND;
    let (mut best, mut best_score, mut second) = (0u64, f32::NEG_INFINITY, f32::NEG_INFINITY);
    let mut skipped = false;
    let mut visit = |i: u32| {
        let xi = x(keys[i as usize]);
        if xi < skip_below {
            skipped = true;
            return;
        }
        let s = xi + gumbel(element_bits(stream, i));
        let r = ranked(order_key(s), i);
        if r > best {
            second = second.max(best_score);
            (best, best_score) = (r, s);
        } else {
            second = second.max(s);
        }
    };
    match &candidates {
        Some(c) => c.iter().for_each(|&i| visit(i)),
        None => (0..v as u32).for_each(&mut visit),
    }
    // A skipped entry's score is below lb − GUMBEL_BOUND + 22.9 < lb − 1.
    if skipped {
        second = second.max(lb - 1.0);
    }
    let margin = if kept == 1 { f32::INFINITY } else { best_score - second };
    SampleDecision { id: ranked_id(best), kept, margin, nucleus_slack }
}
