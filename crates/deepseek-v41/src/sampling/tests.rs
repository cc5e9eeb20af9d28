//! CPU tests of the sampling algorithm (the GPU kernel against it: `tests/cuda_sampling.rs`).

use candle_core::{DType, Device, Result, Tensor};

use super::*;

fn params(temperature: f32, top_k: u32, top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, seed }
}

fn draw(logits: &[f32], p: &SamplingParams, step: u64) -> u32 {
    sample_row_ref(logits, p, step).expect("valid params").id
}

/// `n` logits from a fixed pseudo-random sequence, spread over about ±8, none zero.
fn row(n: usize, salt: u64) -> Vec<f32> {
    (0..n).map(|i| ((math::mix64(salt.wrapping_mul(1_000_003) + i as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 16.0 + 1e-3).collect()
}

/// Counts of each id over `steps` draws.
fn histogram(logits: &[f32], p: &SamplingParams, steps: u64) -> Vec<u64> {
    let mut h = vec![0u64; logits.len()];
    for s in 0..steps {
        h[draw(logits, p, s) as usize] += 1;
    }
    h
}

/// Pearson's statistic of `counts` against the probabilities `prob` (zero-probability ids must
/// have zero counts).
fn chi_square(counts: &[u64], prob: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(prob)
        .map(|(&o, &p)| {
            if p == 0.0 {
                assert_eq!(o, 0, "an id of probability 0 was drawn");
                0.0
            } else {
                let e = n as f64 * p;
                (o as f64 - e).powi(2) / e
            }
        })
        .sum()
}

fn softmax(l: &[f32], t: f32, keep: &[usize]) -> Vec<f64> {
    let m = keep.iter().map(|&i| l[i] as f64).fold(f64::NEG_INFINITY, f64::max);
    let mut p = vec![0f64; l.len()];
    for &i in keep {
        p[i] = ((l[i] as f64 - m) / t as f64).exp();
    }
    let z: f64 = p.iter().sum();
    p.iter().map(|x| x / z).collect()
}

#[test]
fn a_seed_and_step_fix_the_draw_and_different_ones_differ() {
    let l = row(1000, 1);
    let p = params(1.0, 0, 1.0, 42);
    let a: Vec<u32> = (0..64).map(|s| draw(&l, &p, s)).collect();
    let b: Vec<u32> = (0..64).map(|s| draw(&l, &p, s)).collect();
    assert_eq!(a, b);
    let other: Vec<u32> = (0..64).map(|s| draw(&l, &params(1.0, 0, 1.0, 43), s)).collect();
    assert_ne!(a, other, "seeds 42 and 43 drew the same 64 tokens");
    // Steps draw differently: many distinct ids over 64 steps of a flat-ish row.
    let flat: Vec<f32> = l.iter().map(|x| x / 8.0).collect();
    let distinct: std::collections::BTreeSet<u32> = (0..64).map(|s| draw(&flat, &p, s)).collect();
    assert!(distinct.len() > 40, "{} distinct ids in 64 steps", distinct.len());
}

#[test]
fn greedy_takes_the_lowest_of_tied_maxima_with_nan_as_minus_infinity() {
    let g = SamplingParams::GREEDY;
    assert_eq!(draw(&[1.0, 3.0, 3.0, -1.0], &g, 0), 1);
    assert_eq!(draw(&[f32::NAN, 0.5, f32::NAN, 0.5], &g, 0), 1);
    assert_eq!(draw(&[-0.0, 0.0, -1.0], &g, 0), 0, "-0 equals +0");
    assert_eq!(draw(&[0.0, -0.0, -1.0], &g, 0), 0);
    assert_eq!(draw(&[f32::NEG_INFINITY; 3], &g, 0), 0);
    assert_eq!(argmax_ref(&[f32::NAN, -5.0, -4.0]), 2);
    assert_eq!(argmax_ref(&[]), 0);
    for salt in 0..20 {
        let l = row(777, salt);
        let want = l.iter().enumerate().fold(0, |b, (i, &x)| if x > l[b] { i } else { b }) as u32;
        assert_eq!(argmax_ref(&l), want);
        assert_eq!(draw(&l, &g, salt), want);
    }
}

#[test]
fn top_k_one_and_a_tiny_nucleus_are_greedy() {
    for salt in 0..10 {
        let mut l = row(500, salt);
        l[17] = 9.0;
        l[300] = 9.0;
        for step in 0..20 {
            for t in [0.5, 1.0, 4.0] {
                assert_eq!(draw(&l, &params(t, 1, 1.0, salt), step), 17);
                assert_eq!(draw(&l, &params(t, 0, 1e-6, salt), step), 17);
                assert_eq!(draw(&l, &params(t, 7, f32::from_bits(1), salt), step), 17);
            }
        }
    }
}

#[test]
fn top_k_keeps_the_k_largest_with_lower_ids_first_among_ties() {
    // Ties at the k-th value: ids 1, 3, 5 hold 2.0; k = 3 keeps 0 (3.0), 1 and 3.
    let l = [3.0f32, 2.0, -1.0, 2.0, 0.0, 2.0];
    let p = params(1.0, 3, 1.0, 9);
    let h = histogram(&l, &p, 4000);
    assert_eq!((h[2], h[4], h[5]), (0, 0, 0), "{h:?}");
    let stat = chi_square(&h, &softmax(&l, 1.0, &[0, 1, 3]));
    assert!(stat < 25.0, "chi² = {stat} over 2 degrees of freedom ({h:?})");
    let d = sample_row_ref(&l, &p, 0).unwrap();
    assert_eq!(d.kept, 3);
}

#[test]
fn the_nucleus_is_the_shortest_prefix_reaching_top_p() {
    // Probabilities at T = 1: about 0.643, 0.237, 0.087, 0.032 (ln 1, e^-1, e^-2, e^-3).
    let l = [0.0f32, -1.0, -2.0, -3.0];
    let kept = |top_p: f32, top_k: u32| sample_row_ref(&l, &params(1.0, top_k, top_p, 0), 0).unwrap().kept;
    assert_eq!(kept(0.5, 0), 1);
    assert_eq!(kept(0.7, 0), 2);
    assert_eq!(kept(0.9, 0), 3);
    assert_eq!(kept(0.99, 0), 4);
    assert_eq!(kept(1.0, 0), 4);
    assert_eq!(kept(0.9, 2), 2, "top-k and top-p intersect");
    assert_eq!(kept(0.5, 3), 1);
    let d = sample_row_ref(&l, &params(1.0, 0, 0.7, 0), 0).unwrap();
    // Prefix masses 0.644, 0.881: top_p = 0.7 is 0.056 above the first.
    assert!((d.nucleus_slack - 0.0561).abs() < 1e-3 && d.kept == 2, "{d:?}");
    let h = histogram(&l, &params(1.0, 0, 0.9, 5), 6000);
    assert_eq!(h[3], 0);
    let stat = chi_square(&h, &softmax(&l, 1.0, &[0, 1, 2]));
    assert!(stat < 25.0, "chi² = {stat} ({h:?})");
}

#[test]
fn draws_follow_the_softmax() {
    let l = [1.0f32, 0.5, -0.25, 2.0, f32::NEG_INFINITY, 0.0];
    let all = [0, 1, 2, 3, 5];
    for (t, seed) in [(1.0f32, 1u64), (0.6, 2), (2.5, 3)] {
        let h = histogram(&l, &params(t, 0, 1.0, seed), 20_000);
        let stat = chi_square(&h, &softmax(&l, t, &all));
        // 4 degrees of freedom: P(chi² > 30) ≈ 5e-6.
        assert!(stat < 30.0, "T = {t}: chi² = {stat} ({h:?})");
    }
}

#[test]
fn extreme_temperatures_and_infinite_logits() {
    let l = [1.0f32, 5.0, 5.0, -2.0, f32::NEG_INFINITY];
    // A tiny temperature leaves the tied maxima, each about half the time.
    let h = histogram(&l, &params(1e-30, 0, 1.0, 4), 2000);
    assert_eq!((h[0], h[3], h[4]), (0, 0, 0), "{h:?}");
    assert!(h[1] > 850 && h[2] > 850, "{h:?}");
    // A huge one is uniform over the finite logits; −inf is never drawn.
    let h = histogram(&l, &params(1e30, 0, 1.0, 4), 4000);
    assert_eq!(h[4], 0);
    assert!(chi_square(&h, &[0.25, 0.25, 0.25, 0.25, 0.0]) < 25.0, "{h:?}");
    // A row whose largest logit is +inf, or only −inf / NaN: greedy.
    assert_eq!(draw(&[1.0, f32::INFINITY, f32::INFINITY], &params(1.0, 0, 1.0, 0), 3), 1);
    assert_eq!(draw(&[f32::NAN, f32::NEG_INFINITY], &params(1.0, 0, 0.5, 0), 3), 0);
    // One entry.
    assert_eq!(draw(&[-3.0], &params(1.0, 1, 0.3, 0), 3), 0);
}

#[test]
fn margins_bound_the_decision() {
    let l = row(2000, 7);
    for step in 0..50 {
        let d = sample_row_ref(&l, &params(1.0, 0, 1.0, 1), step).unwrap();
        assert!(d.margin > 0.0 && d.kept == 2000 && d.nucleus_slack.is_infinite(), "{d:?}");
    }
    let d = sample_row_ref(&l, &SamplingParams::GREEDY, 0).unwrap();
    assert!(d.margin.is_infinite() && d.kept == 1);
}

#[test]
fn a_batch_samples_each_row_alone() -> Result<()> {
    let (b, v) = (5, 300);
    let rows: Vec<Vec<f32>> = (0..b).map(|i| row(v, 100 + i as u64)).collect();
    let ps: Vec<SamplingParams> = (0..b)
        .map(|i| match i {
            0 => SamplingParams::GREEDY,
            1 => params(0.8, 0, 0.95, 11),
            2 => params(1.3, 20, 1.0, 12),
            3 => params(1.0, 50, 0.5, 13),
            _ => params(0.7, 0, 1.0, 14),
        })
        .collect();
    let steps: Vec<u64> = (0..b as u64).map(|i| 1000 + 7 * i).collect();
    let logits = Tensor::from_vec(rows.concat(), (b, v), &Device::Cpu)?;
    let batch = SamplingBatch::new(ps.clone(), steps.clone(), &Device::Cpu)?;
    let got = sample_batch(&logits, &batch)?.to_vec1::<u32>()?;
    for i in 0..b {
        assert_eq!(got[i], draw(&rows[i], &ps[i], steps[i]), "row {i}");
        // A batch of this row alone gives the same id.
        let one = SamplingBatch::new(vec![ps[i]], vec![steps[i]], &Device::Cpu)?;
        assert_eq!(sample_batch(&logits.narrow(0, i, 1)?, &one)?.to_vec1::<u32>()?, vec![got[i]]);
    }
    // bf16 logits sample their f32 values.
    let bf = logits.to_dtype(DType::BF16)?;
    let want: Vec<u32> = bf.to_dtype(DType::F32)?.to_vec2::<f32>()?.iter().enumerate().map(|(i, r)| draw(r, &ps[i], steps[i])).collect();
    assert_eq!(sample_batch(&bf, &batch)?.to_vec1::<u32>()?, want);
    assert_eq!(batch.table().dims(), &[b, SAMPLING_TABLE_WORDS]);
    let t = batch.table().to_vec2::<u32>()?;
    assert_eq!((t[1][0], t[1][2], t[1][4], t[1][6]), (0.8f32.to_bits(), 0.95f32.to_bits(), 11, 1007));
    Ok(())
}

#[test]
fn bad_settings_are_errors_naming_the_value() -> Result<()> {
    let dev = Device::Cpu;
    let msg = |p: SamplingParams| SamplingBatch::new(vec![SamplingParams::GREEDY, p], vec![0, 0], &dev).unwrap_err().to_string();
    for t in [-1.0, f32::NAN, f32::INFINITY] {
        let e = msg(params(t, 0, 1.0, 0));
        assert!(e.contains("sequence 1: temperature") && e.contains(&t.to_string()), "{e}");
    }
    for p in [0.0, 1.5, f32::NAN, -0.1] {
        let e = msg(params(1.0, 0, p, 0));
        assert!(e.contains("sequence 1: top_p") && e.contains(&p.to_string()), "{e}");
    }
    let e = SamplingBatch::new(vec![SamplingParams::GREEDY], vec![0, 1], &dev).unwrap_err().to_string();
    assert!(e.contains("2 step counters for 1 sequences"), "{e}");
    let batch = SamplingBatch::new(vec![params(1.0, 5, 1.0, 0)], vec![0], &dev)?;
    let e = sample_batch(&Tensor::zeros((1, 4), DType::F32, &dev)?, &batch).unwrap_err().to_string();
    assert!(e.contains("top_k = 5 exceeds the 4 logits"), "{e}");
    let e = sample_batch(&Tensor::zeros((2, 8), DType::F32, &dev)?, &batch).unwrap_err().to_string();
    assert!(e.contains("logits have 2 rows but the batch has 1 sequences"), "{e}");
    let e = sample_batch(&Tensor::zeros((1, 0), DType::F32, &dev)?, &batch).unwrap_err().to_string();
    assert!(e.contains("logit rows of 0 entries"), "{e}");
    let e = sample_batch(&Tensor::zeros(8, DType::F32, &dev)?, &batch).unwrap_err().to_string();
    assert!(e.contains("must be [B, V]"), "{e}");
    assert_eq!(sample_row_ref(&[], &SamplingParams::GREEDY, 0), Err(SamplingError::Vocab { vocab: 0 }));
    assert_eq!(sample_row_ref(&[1.0], &params(1.0, 2, 1.0, 0), 0), Err(SamplingError::TopK { seq: 0, top_k: 2, vocab: 1 }));
    // An empty batch is fine.
    let empty = SamplingBatch::new(vec![], vec![], &dev)?;
    assert_eq!(sample_batch(&Tensor::zeros((0, 8), DType::F32, &dev)?, &empty)?.dims(), &[0]);
    Ok(())
}

#[test]
fn set_steps_rewrites_the_table_in_place_as_a_new_batch_would() -> Result<()> {
    let dev = Device::Cpu;
    let ps = vec![params(0.9, 0, 0.95, 3), params(1.3, 7, 1.0, 11)];
    let mut batch = SamplingBatch::new(ps.clone(), vec![0, 0], &dev)?;
    let table = batch.table().clone();
    batch.set_steps(&[5, 9])?;
    let fresh = SamplingBatch::new(ps, vec![5, 9], &dev)?;
    assert_eq!(batch.steps(), &[5, 9]);
    // The same storage (a graph reading the table sees the change) holds the new batch's words.
    assert_eq!(table.to_vec2::<u32>()?, fresh.table().to_vec2::<u32>()?);
    let e = batch.set_steps(&[1]).unwrap_err().to_string();
    assert!(e.contains("1 step counters for 2 sequences"), "{e}");
    assert_eq!(batch.steps(), &[5, 9], "a refused update changes nothing");
    Ok(())
}

#[test]
fn first_steps_new_sequences_and_leading_views_share_the_table() -> Result<()> {
    let dev = Device::Cpu;
    let ps = vec![params(0.9, 0, 0.95, 3), params(1.3, 7, 1.0, 11), params(0.7, 2, 0.5, 5)];
    let mut batch = SamplingBatch::new(ps.clone(), vec![1, 2, 3], &dev)?;
    let lead = batch.leading(2)?;
    assert_eq!((lead.len(), lead.params(), lead.steps()), (2, &ps[..2], &[1u64, 2][..]));
    batch.set_first_steps(&[8, 9])?;
    let joined = params(1.1, 0, 0.8, 99);
    batch.set_sequence(1, joined, 4)?;
    let want = SamplingBatch::new(vec![ps[0], joined, ps[2]], vec![8, 4, 3], &dev)?;
    assert_eq!((batch.params(), batch.steps()), (want.params(), want.steps()));
    assert_eq!(batch.table().to_vec2::<u32>()?, want.table().to_vec2::<u32>()?);
    // The view taken before sees the rewrites of its rows.
    assert_eq!(lead.table().to_vec2::<u32>()?, want.table().narrow(0, 0, 2)?.to_vec2::<u32>()?);
    assert!(batch.set_first_steps(&[0; 4]).is_err() && batch.leading(4).is_err());
    let e = batch.set_sequence(3, joined, 0).unwrap_err().to_string();
    assert!(e.contains("sequence 3 is outside the batch of 3"), "{e}");
    assert!(batch.set_sequence(0, params(-1.0, 0, 1.0, 0), 0).is_err());
    assert_eq!(batch.steps(), &[8, 4, 3], "refused changes change nothing");
    Ok(())
}
