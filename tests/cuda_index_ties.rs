//! The tie policy of the index top-k and the candidate-block top-k, on CPU and CUDA, in prefill and
//! decode: among EXACTLY equal scores at the k boundary the lowest entry (block) ids are taken
//! (IEEE equality; `docs/numerics.md` "Ties").
//!
//! The ties are made the way an untrained lightning indexer makes them: every index head's
//! `q·k` of most entries is negative, so `ReLU` zeroes every head and the entry's score is exactly
//! `Σ_h w_h · 0 = ±0` (the same zero for every entry of a query: its sign depends only on the
//! query's head weights). A few entries get positive keys (positive or negative scores, by the
//! head weights' signs), fewer than k, so each query's k boundary falls among the zeros.
//!
//! Checked: the GPU's ids equal the CPU's, and the CPU's equal an independent statement of the
//! policy written here (sort by score descending with IEEE equality, then id ascending); and the
//! data really put ties at the boundary.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_index_ties`.

use std::cmp::Ordering;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::indexer::CandidateShape;
use deepseek_v41::cuda::{index_select, masked_index_scores, IndexKeys, KeySource, Visibility};

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

#[path = "support/indexer_data.rs"]
#[allow(dead_code)]
mod data;
use data::*;

/// Keys `[n, 128]`: rows in `positive` get |fq| values, every other row −|fq| (so with all-positive
/// queries every head's product is negative and ReLU makes it 0).
fn signed_keys(rng: &mut Rng, n: usize, positive: &[usize]) -> Result<Tensor> {
    let mags = fq(rng, &[n, D])?.abs()?;
    let sign: Vec<f32> = (0..n).map(|j| if positive.contains(&j) { 1.0 } else { -1.0 }).collect();
    let sign = Tensor::from_vec(sign, (n, 1), &Device::Cpu)?.to_dtype(DType::BF16)?;
    Ok(mags.broadcast_mul(&sign)?)
}

/// The policy in its own words: descending score with IEEE equality (so −0 ties +0), then
/// ascending id; the best `k`; −inf entries only where fewer than k finite ones exist; ids
/// `>= visible` dropped; ascending, −1 padded.
fn policy_top_k(scores: &[f32], k: usize, visible: usize) -> Vec<i64> {
    let mut ids: Vec<usize> = (0..scores.len()).collect();
    ids.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap_or(Ordering::Equal).then(a.cmp(&b)));
    let mut out: Vec<i64> = ids.into_iter().take(k).filter(|&j| j < visible).map(|j| j as i64).collect();
    out.sort_unstable();
    out.resize(k, -1);
    out
}

/// Rows of `[T, N]` scores on the host as f32.
fn rows(t: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec2::<f32>()?)
}

/// How many queries have their k boundary inside a run of exactly equal scores (with at least one
/// tied entry taken and one left out).
fn boundary_ties(scores: &[Vec<f32>], picked: &[Vec<i64>]) -> usize {
    scores
        .iter()
        .zip(picked)
        .filter(|(s, p)| {
            let taken: Vec<usize> = p.iter().filter(|&&i| i >= 0).map(|&i| i as usize).collect();
            let Some(last) = taken.iter().map(|&j| s[j]).min_by(|a, b| a.total_cmp(b)) else { return false };
            last.is_finite() && s.iter().enumerate().any(|(j, &v)| v == last && !taken.contains(&j))
        })
        .count()
}

#[test]
fn relu_zero_ties_go_to_the_lowest_ids_in_prefill() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(91);
    // A prefill chunk of 24 queries over a ratio-2 kv source of 400 entries; 20 positive keys.
    let (t, h, n, k, ratio) = (24usize, 8usize, 400usize, 64usize, 2usize);
    let start = ratio * n - t;
    let positive: Vec<usize> = (0..20).map(|i| 7 + 19 * i).collect();
    let keys = signed_keys(&mut rng, n, &positive)?;
    let q = fq(&mut rng, &[t, h, D])?.abs()?;
    let w = weights(&mut rng, t, h)?;
    let shape = CandidateShape { block: 8, n_keep: 6 };
    let cpu_src = KeySource::sequence(IndexKeys::Rows(&keys), start, ratio)?;
    let want = index_select(&q, &w, &cpu_src, k, None, Some(shape))?;
    let kg = keys.to_device(&dev)?;
    let gpu_src = KeySource::sequence(IndexKeys::Rows(&kg), start, ratio)?;
    poison(&dev, t * k)?;
    let got = index_select(&q.to_device(&dev)?, &w.to_device(&dev)?, &gpu_src, k, None, Some(shape))?;
    assert_ids_equal("prefill top-k with ReLU-zero ties", &got.topk, &want.topk)?;
    let (gc, wc) = (got.candidates.as_ref().unwrap(), want.candidates.as_ref().unwrap());
    assert_ids_equal("prefill candidate blocks with ReLU-zero ties", &gc.kept, &wc.kept)?;

    // The CPU's picks are the policy's, and the data do tie at the boundary.
    let scores = rows(&masked_index_scores(&q, &w, &cpu_src, None)?)?;
    let picked = ids(&want.topk)?;
    for (i, s) in scores.iter().enumerate() {
        let visible = (start + i + 1) / ratio;
        ensure!(picked[i] == policy_top_k(s, k, visible), "query {i}: CPU top-k is not the lowest-id policy's");
        ensure!(s.iter().take(visible).filter(|&&v| v == 0.0).count() > k, "query {i}: the data must hold > k zero scores");
    }
    ensure!(boundary_ties(&scores, &picked) == t, "every query's k boundary must fall inside the zero ties");
    // Candidate blocks: block score = max of its visible entries, the newest block pinned; blocks
    // of zeros tie, so the kept zero blocks must be the lowest-id ones.
    for (i, (s, kept)) in scores.iter().zip(ids(&wc.kept)?).enumerate() {
        let visible = (start + i + 1) / ratio;
        let mut beta: Vec<f32> = s.chunks(8).map(|c| c.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))).collect();
        beta[(visible - 1) / 8] = f32::INFINITY;
        let n_blocks = beta.len();
        let want_blocks = policy_top_k(&beta, 6, n_blocks);
        let want_blocks: Vec<i64> = want_blocks.into_iter().filter(|&b| b >= 0 && beta[b as usize] > f32::NEG_INFINITY).collect();
        let kept: Vec<i64> = kept.into_iter().filter(|&b| b >= 0).collect();
        ensure!(kept == want_blocks, "query {i}: kept blocks {kept:?}, policy {want_blocks:?}");
    }
    Ok(())
}

#[test]
fn relu_zero_ties_go_to_the_lowest_ids_in_batched_decode() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(92);
    // Five decode queries, each over its own 600 keys (bf16 rows and packed MXFP4 pages), with
    // visible counts around k; 30 positive keys per query.
    let (b, h, nk, k) = (5usize, 32usize, 600usize, 64usize);
    let counts: Vec<u32> = vec![600, 300, 65, 64, 10];
    let positive: Vec<usize> = (0..b).flat_map(|s| (0..30).map(move |i| s * nk + 3 + 13 * i)).collect();
    let keys = signed_keys(&mut rng, b * nk, &positive)?;
    let q = fq(&mut rng, &[b, h, D])?.abs()?;
    let w = weights(&mut rng, b, h)?;
    let bases: Vec<u32> = (0..b as u32).map(|i| i * nk as u32).collect();
    let (base_c, vis_c) = (Tensor::new(bases.as_slice(), &Device::Cpu)?, Tensor::new(counts.as_slice(), &Device::Cpu)?);
    let cpu = KeySource { keys: IndexKeys::Rows(&keys), base: Some(&base_c), pages: None, entries: nk, visibility: Visibility::Counts(&vis_c) };
    let want = index_select(&q, &w, &cpu, k, None, None)?;
    let (base_g, vis_g) = (base_c.to_device(&dev)?, vis_c.to_device(&dev)?);
    let (cache, layout) = pack(&keys, 64, &dev)?;
    let kg = keys.to_device(&dev)?;
    let packed = KeySource { keys: IndexKeys::Packed { cache: &cache, layout }, base: Some(&base_g), pages: None, entries: nk, visibility: Visibility::Counts(&vis_g) };
    let bf16_rows = KeySource { keys: IndexKeys::Rows(&kg), ..packed };
    for (name, src) in [("packed keys", &packed), ("bf16 rows", &bf16_rows)] {
        poison(&dev, b * k)?;
        let got = index_select(&q.to_device(&dev)?, &w.to_device(&dev)?, src, k, None, None)?;
        assert_ids_equal(&format!("decode top-k with ReLU-zero ties, {name}"), &got.topk, &want.topk)?;
    }
    let scores = rows(&masked_index_scores(&q, &w, &cpu, None)?)?;
    let picked = ids(&want.topk)?;
    for (i, s) in scores.iter().enumerate() {
        ensure!(picked[i] == policy_top_k(s, k, counts[i] as usize), "query {i}: CPU top-k is not the lowest-id policy's");
    }
    // Queries 0 and 1 see more zeros than k minus their positives: boundary ties; 3 and 4 see at
    // most k entries (all taken, no choice).
    ensure!(boundary_ties(&scores[..2], &picked[..2]) == 2, "queries 0 and 1 must tie at the boundary");
    ensure!(picked[4][..10] == (0..10).collect::<Vec<i64>>()[..], "10 visible: every one of them");
    Ok(())
}
