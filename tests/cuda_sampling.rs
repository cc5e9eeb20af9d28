//! GPU tests of the sampling kernel `kernels/sampling.cu` (`cuda::sample_device`,
//! `sampling::sample_batch` on CUDA) against its CPU reference `sampling::sample_row_ref`.
//!
//! Data: fresh random logits (never zeros) for B = 1, 7, 64, 256 and V = 1, 2, 1000, 129280 (the
//! released vocabulary), f32 and bf16 (bf16 rows hold many equal values), with rows of coarse
//! values (ties at every boundary), the maximum repeated at several ids, −inf and NaN entries,
//! and rows of only −inf / with +inf; per row its own settings: greedy, temperature only, top-k,
//! top-p, both, extreme temperatures (1e-30, 1e4), top-k 1 / V − 1 / V, top-p at its smallest and
//! just below 1, random ones, random seeds and steps (up to 2^64 − 1).
//!
//! Expectation: the same id as the reference for every row. The kernel computes the keys, scaled
//! logits, fixed-point masses and Gumbel values with the reference's own operations
//! (`sampling/math.rs`), so equality is exact; the comparison still reads each decision's margin
//! (the gap between the two best perturbed scores) and the nucleus boundary's slack, allows a
//! mismatch only where one of them is below `NOISE` and asserts such mismatches are rare (none
//! are expected). Greedy rows must match exactly. Every call's ids are allocated over freed
//! poisoned memory, and each case runs twice (the ids must be equal: deterministic).
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_sampling`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::cuda::{sample_device, with_plain_candle};
use deepseek_v41::generation::{Sampler, Sampling};
use deepseek_v41::sampling::{sample_batch, sample_row_ref, SampleDecision, SamplingBatch, SamplingParams};

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

/// A decision this close to a boundary may differ from the reference (module docs).
const NOISE: f64 = 1e-6;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_sampling.rs needs a CUDA device (none found): these tests must run on a GPU")
}

/// Allocates and frees poisoned u32 buffers so the next ids likely reuse them.
fn poison(dev: &Device, n: usize) -> Result<()> {
    drop(Tensor::full(0x5a5a_5a5au32, n.max(1) + 64, dev)?);
    Ok(())
}

/// Row `r` of `v` logits; its kind by `r % 6`: plain, coarse (multiples of 1/4: ties), the max
/// repeated, 10 % −inf and a NaN, all −inf (or +inf at two ids when `r % 12 == 10`), scaled ×20.
fn logits_row(rng: &mut Rng, r: usize, v: usize) -> Vec<f32> {
    let scale = [0.5f32, 2.0, 4.0][r % 3];
    let mut row: Vec<f32> = (0..v).map(|_| rng.normal() * scale).collect();
    match r % 6 {
        1 => row.iter_mut().for_each(|x| {
            let q = (*x * 4.0).round() / 4.0;
            *x = if q == 0.0 { 0.25f32.copysign(*x) } else { q };
        }),
        2 => {
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            for _ in 0..3 {
                row[rng.below(v)] = m;
            }
        }
        3 => {
            for x in row.iter_mut() {
                if rng.below(10) == 0 {
                    *x = f32::NEG_INFINITY;
                }
            }
            row[rng.below(v)] = f32::NAN;
        }
        4 if r % 12 == 10 => {
            row[rng.below(v)] = f32::INFINITY;
            row[rng.below(v)] = f32::INFINITY;
        }
        4 => row.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
        5 => row.iter_mut().for_each(|x| *x *= 20.0),
        _ => {}
    }
    row
}

/// Row `r`'s settings (`v` logits): fixed edge cases for the first rows, then random ones.
fn params_row(rng: &mut Rng, r: usize, v: usize) -> SamplingParams {
    let v32 = v as u32;
    let seed = rng.next_u64();
    let p = |temperature: f32, top_k: u32, top_p: f32| SamplingParams { temperature, top_k, top_p, seed };
    match r % 16 {
        0 => SamplingParams { seed, ..SamplingParams::GREEDY },
        1 => p(1.0, 0, 1.0),
        2 => p(0.7, 0, 0.9),
        3 => p(1.3, 50.min(v32), 1.0),
        4 => p(0.8, 40.min(v32), 0.95),
        5 => p(1e-30, 0, 1.0),
        6 => p(1e4, 0, 0.5),
        7 => p(1.0, 1, 1.0),
        8 => p(1.0, v32, 1.0),
        9 => p(1.0, 0, f32::from_bits(1)),
        10 => p(0.9, 0, 1.0 - f32::EPSILON / 2.0),
        11 => p(1.1, v32 - 1, 0.8),
        _ => p(
            0.05 + 3.0 * rng.uniform(),
            if rng.below(2) == 0 { 0 } else { 1 + rng.below(v.min(3000)) as u32 },
            if rng.below(3) == 0 { 1.0 } else { 0.02 + 0.98 * rng.uniform() },
        ),
    }
}

fn step_row(rng: &mut Rng, r: usize) -> u64 {
    match r % 5 {
        0 => r as u64,
        1 => u64::MAX - r as u64,
        _ => rng.next_u64(),
    }
}

/// The reference's decision of every row, rows spread over the host's cores.
fn reference(rows: &[Vec<f32>], params: &[SamplingParams], steps: &[u64]) -> Result<Vec<SampleDecision>> {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).min(rows.len().max(1));
    let chunk = rows.len().div_ceil(threads).max(1);
    let mut out = Vec::with_capacity(rows.len());
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..rows.len())
            .step_by(chunk)
            .map(|start| {
                let end = (start + chunk).min(rows.len());
                s.spawn(move || (start..end).map(|r| sample_row_ref(&rows[r], &params[r], steps[r])).collect::<Result<Vec<_>, _>>())
            })
            .collect();
        for h in handles {
            out.extend(h.join().expect("reference thread")?);
        }
        Ok(())
    })?;
    Ok(out)
}

/// Compares GPU ids with the reference's decisions; returns the number of (allowed) mismatches.
fn compare(what: &str, got: &[u32], want: &[SampleDecision], params: &[SamplingParams]) -> Result<usize> {
    ensure!(got.len() == want.len(), "{what}: {} ids for {} rows", got.len(), want.len());
    let mut near = 0;
    for (r, (&g, w)) in got.iter().zip(want).enumerate() {
        if g == w.id {
            continue;
        }
        let greedy = params[r].temperature.is_nan() || params[r].temperature <= 0.0;
        ensure!(
            !greedy && ((w.margin as f64) < NOISE || w.nucleus_slack < NOISE),
            "{what}, row {r}: GPU id {g}, reference {w:?} with {:?}",
            params[r]
        );
        near += 1;
    }
    ensure!(near * 500 <= got.len().max(500), "{what}: {near} of {} rows differ within the noise margins", got.len());
    Ok(near)
}

/// B rows of V logits in `dtype` with per-row settings: GPU twice (poisoned ids) vs the
/// reference on the same values.
fn check_case(dev: &Device, rng: &mut Rng, b: usize, v: usize, dtype: DType) -> Result<()> {
    let what = format!("B = {b}, V = {v}, {dtype:?}");
    let rows: Vec<Vec<f32>> = (0..b).map(|r| logits_row(rng, r, v)).collect();
    let params: Vec<SamplingParams> = (0..b).map(|r| params_row(rng, r, v)).collect();
    let steps: Vec<u64> = (0..b).map(|r| step_row(rng, r)).collect();
    let host = Tensor::from_vec(rows.concat(), (b, v), &Device::Cpu)?.to_dtype(dtype)?;
    // The reference sees the values the GPU sees (bf16 rounded).
    let seen: Vec<Vec<f32>> = host.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let want = reference(&seen, &params, &steps)?;
    let logits = host.to_device(dev)?;
    let batch = SamplingBatch::new(params.clone(), steps, dev)?;
    poison(dev, b)?;
    let first = sample_device(&logits, &batch)?.to_vec1::<u32>()?;
    poison(dev, b)?;
    let second = sample_batch(&logits, &batch)?.to_vec1::<u32>()?;
    ensure!(first == second, "{what}: two runs differ");
    let near = compare(&what, &first, &want, &params)?;
    let kept: usize = want.iter().map(|d| d.kept).sum();
    println!("{what}: {b} rows equal to the reference ({near} within noise), {kept} candidates in all");
    Ok(())
}

#[test]
fn small_shapes_match_the_reference() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x5a3b);
    for v in [1, 2, 1000] {
        for b in [1, 7, 64, 256] {
            for dtype in [DType::F32, DType::BF16] {
                check_case(&dev, &mut rng, b, v, dtype)?;
            }
        }
    }
    Ok(())
}

#[test]
fn the_release_vocabulary_matches_the_reference() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x12_9280);
    for b in [1, 7, 64, 256] {
        for dtype in [DType::F32, DType::BF16] {
            check_case(&dev, &mut rng, b, 129_280, dtype)?;
        }
    }
    Ok(())
}

/// Rows of a wider tensor (a row stride above V), a transposed tensor (copied), an f16 tensor
/// (converted), and a row sampled alone: the same ids as the batch.
#[test]
fn strided_rows_other_dtypes_and_batch_composition() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(77);
    let (b, v) = (9, 3000);
    let rows: Vec<Vec<f32>> = (0..b).map(|r| logits_row(&mut rng, r, v + 5)).collect();
    let params: Vec<SamplingParams> = (0..b).map(|r| params_row(&mut rng, r, v)).collect();
    let steps: Vec<u64> = (0..b).map(|r| step_row(&mut rng, r)).collect();
    let wide = Tensor::from_vec(rows.concat(), (b, v + 5), &dev)?;
    let narrow = wide.narrow(1, 2, v)?;
    let batch = SamplingBatch::new(params.clone(), steps.clone(), &dev)?;
    let got = sample_device(&narrow, &batch)?.to_vec1::<u32>()?;
    let seen = narrow.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
    compare("narrowed rows", &got, &reference(&seen, &params, &steps)?, &params)?;
    let transposed = narrow.t()?.contiguous()?.t()?;
    ensure!(sample_device(&transposed, &batch)?.to_vec1::<u32>()? == got, "transposed rows");
    let f16 = narrow.to_dtype(DType::F16)?;
    let seen16 = f16.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    compare("f16 rows", &sample_device(&f16, &batch)?.to_vec1::<u32>()?, &reference(&seen16, &params, &steps)?, &params)?;
    for r in 0..b {
        let one = SamplingBatch::new(vec![params[r]], vec![steps[r]], &dev)?;
        ensure!(sample_device(&narrow.narrow(0, r, 1)?, &one)?.to_vec1::<u32>()? == vec![got[r]], "row {r} alone");
    }
    // The plain-Candle switch takes the reference path on the same device: same ids.
    ensure!(with_plain_candle(|| sample_batch(&narrow, &batch))?.to_vec1::<u32>()? == got, "with_plain_candle");
    Ok(())
}

/// 8192 draws (rows) of one 5-entry row at different steps: the GPU's frequencies follow the
/// softmax of the candidates (chi² over 4 degrees of freedom, P(> 30) ≈ 5e-6), top-k 3 keeps 3.
#[test]
fn gpu_draws_follow_the_softmax() -> Result<()> {
    let dev = gpu();
    let l = [1.0f32, 0.5, -0.25, 2.0, 0.0];
    let n = 8192;
    for (t, k) in [(1.0f32, 0u32), (0.6, 0), (1.0, 3)] {
        let logits = Tensor::from_vec(l.repeat(n), (n, l.len()), &dev)?;
        let p = SamplingParams { temperature: t, top_k: k, top_p: 1.0, seed: 1234 };
        let batch = SamplingBatch::new(vec![p; n], (0..n as u64).collect(), &dev)?;
        let mut h = [0f64; 5];
        for id in sample_device(&logits, &batch)?.to_vec1::<u32>()? {
            h[id as usize] += 1.0;
        }
        let keep: Vec<usize> = if k == 3 { vec![0, 1, 3] } else { (0..5).collect() };
        let w: Vec<f64> = (0..5).map(|i| if keep.contains(&i) { ((l[i] - 2.0) as f64 / t as f64).exp() } else { 0.0 }).collect();
        let z: f64 = w.iter().sum();
        let mut chi2 = 0.0;
        for i in 0..5 {
            if w[i] == 0.0 {
                ensure!(h[i] == 0.0, "T = {t}, k = {k}: id {i} outside the top-k drawn {} times", h[i]);
            } else {
                let e = n as f64 * w[i] / z;
                chi2 += (h[i] - e).powi(2) / e;
            }
        }
        ensure!(chi2 < 30.0, "T = {t}, k = {k}: chi² = {chi2}, counts {h:?}");
    }
    Ok(())
}

/// `generation::Sampler` on a CUDA row generates the CPU's tokens for a seed.
#[test]
fn the_sampler_draws_the_same_tokens_on_cuda_and_cpu() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(5);
    for cfg in [Sampling::GREEDY, Sampling { temperature: 0.8, top_p: 0.95, seed: 3 }, Sampling { temperature: 1.5, top_p: 1.0, seed: 9 }] {
        let (mut cpu, mut cuda) = (Sampler::new(cfg)?, Sampler::new(cfg)?);
        for step in 0..40 {
            let row = logits_row(&mut rng, step % 3, 4096);
            let host = Tensor::from_vec(row, 4096, &Device::Cpu)?.to_dtype(DType::BF16)?;
            let (a, b) = (cpu.sample(&host)?, cuda.sample(&host.to_device(&dev)?)?);
            ensure!(a == b, "{cfg:?}, step {step}: CPU {a}, CUDA {b}");
        }
    }
    Ok(())
}

#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let dev = gpu();
    let logits = Tensor::ones((2, 10), DType::F32, &dev)?;
    let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 0 };
    let host_batch = SamplingBatch::new(vec![p; 2], vec![0, 1], &Device::Cpu)?;
    let e = sample_device(&logits, &host_batch).unwrap_err().to_string();
    ensure!(e.contains("build the SamplingBatch on the logits' device"), "{e}");
    let one = SamplingBatch::new(vec![p], vec![0], &dev)?;
    let e = sample_device(&logits, &one).unwrap_err().to_string();
    ensure!(e.contains("logits have 2 rows but the batch has 1 sequences"), "{e}");
    let big_k = SamplingBatch::new(vec![SamplingParams { top_k: 11, ..p }; 2], vec![0, 0], &dev)?;
    let e = sample_device(&logits, &big_k).unwrap_err().to_string();
    ensure!(e.contains("top_k = 11 exceeds the 10 logits"), "{e}");
    let e = sample_device(&logits.to_device(&Device::Cpu)?, &host_batch).unwrap_err().to_string();
    ensure!(e.contains("must be on a CUDA device"), "{e}");
    // A CUDA device holds no zero-sized tensor: an empty batch is a clear error (the rows are a
    // zero-row view of the logits, which allocates nothing).
    let empty = SamplingBatch::new(vec![], vec![], &dev)?;
    let no_rows = logits.narrow(0, 0, 0)?;
    let e = sample_device(&no_rows, &empty).unwrap_err().to_string();
    ensure!(e.contains("the batch has no sequences"), "{e}");
    let e = sample_batch(&no_rows, &empty).unwrap_err().to_string();
    ensure!(e.contains("the batch has no sequences"), "{e}");
    Ok(())
}
