//! GPU tests of the small-head-dim sparse attention (`kernels/sparse_attention_small.cu`,
//! `cuda::sparse_attention_small`) against the CPU reference `attention::sparse_attention_ref`
//! (the window's rows followed by the extra source's, indices shifted, out-of-range ones as −1):
//! random bf16 rows and queries, head dims 1, 33, 64, 128, 512, 1–4 heads, valid-row counts
//! that cross the reference's 64-row softmax blocks and the kernel's 128-entry index chunks,
//! −1, out-of-range and duplicate indices, an empty extra list, a source without rows, tokens with no valid row (with
//! and without a sink), logits spread wide enough that the running max moves between blocks, and
//! more than 65,535 (token, head) pairs; outputs allocated over NaN-poisoned memory; the errors.
//!
//! Tolerance: the kernel follows the reference's order except in the dot products' f32 summation
//! and `expf`'s last bit, so an output may differ by about one bf16 ulp of the row's largest
//! value; most are equal (the test requires ≥ 90 %).
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_sparse_attention_small`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::sparse_attention_ref;
use deepseek_v41::cuda::sparse_attention_small;

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_sparse_attention_small.rs needs a CUDA device (none found): these tests must run on a GPU")
}

fn poison(dev: &Device, n: usize) -> Result<()> {
    drop(Tensor::full(f32::NAN, n.max(1), dev)?);
    Ok(())
}

struct Case {
    t: usize,
    h: usize,
    d: usize,
    nw: usize,
    ne: usize,
    kw: usize,
    ke: usize,
    /// Logit spread: queries scaled by this (wide: the running max moves between blocks).
    spread: f32,
    sink: Option<f32>,
}

/// Random indices: mostly valid, some −1, some out of range, some duplicates.
fn indices(rng: &mut Rng, t: usize, k: usize, n: usize) -> Vec<i64> {
    let mut v = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut prev = 0i64;
        for _ in 0..k {
            let r = rng.below(20);
            let i = match r {
                0 | 1 => -1,
                2 => n as i64 + rng.below(5) as i64, // past the source: none
                3 if n > 0 => prev,                   // a duplicate
                _ if n > 0 => rng.below(n) as i64,
                _ => -1,
            };
            prev = if i >= 0 && (i as usize) < n { i } else { prev };
            v.push(i);
        }
    }
    v
}

fn run(case: &Case, rng: &mut Rng, dev: &Device) -> Result<(usize, usize)> {
    let Case { t, h, d, nw, ne, kw, ke, spread, sink } = *case;
    let cpu = Device::Cpu;
    let rows = |rng: &mut Rng, n: usize| -> Result<Tensor> { Ok(Tensor::from_vec((0..n * d).map(|_| rng.normal()).collect::<Vec<f32>>(), (n, d), &cpu)?.to_dtype(DType::BF16)?) };
    let q = Tensor::from_vec((0..t * h * d).map(|_| rng.normal() * spread).collect::<Vec<f32>>(), (t, h, d), &cpu)?.to_dtype(DType::BF16)?;
    let (w, e) = (rows(rng, nw)?, rows(rng, ne)?);
    let (iw, ie) = (indices(rng, t, kw, nw), indices(rng, t, ke, ne));
    let sinks: Vec<f32> = (0..h).map(|i| sink.map_or(f32::NEG_INFINITY, |s| s + i as f32)).collect();
    let scale = (d as f32).powf(-0.5);
    // The reference over [window ; extra] with the extra indices shifted.
    let mut all = Vec::with_capacity(t);
    for ti in 0..t {
        let mut row: Vec<i64> = iw[ti * kw..(ti + 1) * kw].iter().map(|&i| if i >= 0 && (i as usize) < nw { i } else { -1 }).collect();
        row.extend(ie[ti * ke..(ti + 1) * ke].iter().map(|&i| if i >= 0 && (i as usize) < ne { i + nw as i64 } else { -1 }));
        all.push(row);
    }
    let kv = Tensor::cat(&[&w, &e], 0)?;
    let sink_t = Tensor::from_vec(sinks.clone(), h, &cpu)?;
    let want = sparse_attention_ref(&q, &kv, &all, &sink_t, scale)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;

    poison(dev, t * h * d)?;
    let got = sparse_attention_small(
        &q.to_device(dev)?,
        &w.to_device(dev)?,
        &Tensor::from_vec(iw, (t, kw), dev)?,
        &e.to_device(dev)?,
        &Tensor::from_vec(ie, (t, ke), dev)?,
        &Tensor::from_vec(sinks, h, dev)?,
        scale,
    )?;
    ensure!(got.dims() == [t, h, d] && got.dtype() == DType::BF16, "shape {:?} dtype {:?}", got.shape(), got.dtype());
    let got = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut equal = 0;
    for (r, (g, w)) in got.chunks(d).zip(want.chunks(d)).enumerate() {
        let amax = w.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (c, (a, b)) in g.iter().zip(w).enumerate() {
            ensure!(a.is_finite(), "t {t} h {h} d {d}: row {r} dim {c} is {a} (an unwritten or NaN output)");
            ensure!((a - b).abs() <= amax * 2f32.powi(-7) + 1e-30, "t {t} h {h} d {d}: row {r} dim {c}: {a} vs the reference's {b} (row max {amax})");
            equal += (a == b) as usize;
        }
    }
    Ok((equal, got.len()))
}

#[test]
fn matches_the_cpu_reference() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x5a_0001);
    let cases = [
        // The embedded model's decode step: window 32 + top-16, 4 heads of 128.
        Case { t: 1, h: 4, d: 128, nw: 64, ne: 40, kw: 32, ke: 16, spread: 1.0, sink: Some(0.5) },
        Case { t: 5, h: 4, d: 128, nw: 64, ne: 40, kw: 32, ke: 16, spread: 1.0, sink: None },
        // Several softmax blocks and index chunks, the max moving between blocks.
        Case { t: 3, h: 2, d: 64, nw: 300, ne: 500, kw: 100, ke: 200, spread: 6.0, sink: Some(-2.0) },
        Case { t: 2, h: 1, d: 512, nw: 700, ne: 10, kw: 300, ke: 5, spread: 3.0, sink: Some(1.0) },
        // Odd dims, no extra list, one dim.
        Case { t: 4, h: 3, d: 33, nw: 50, ne: 1, kw: 70, ke: 0, spread: 2.0, sink: Some(0.0) },
        Case { t: 6, h: 2, d: 1, nw: 9, ne: 9, kw: 7, ke: 3, spread: 1.0, sink: None },
        // A source without rows (a prefill before the first compressed entry): its indices are none.
        Case { t: 3, h: 2, d: 128, nw: 40, ne: 0, kw: 32, ke: 16, spread: 1.0, sink: Some(0.0) },
        Case { t: 3, h: 2, d: 128, nw: 0, ne: 20, kw: 8, ke: 16, spread: 1.0, sink: Some(0.0) },
        // Prefill-like: many tokens.
        Case { t: 200, h: 4, d: 128, nw: 256, ne: 64, kw: 32, ke: 16, spread: 1.0, sink: Some(0.25) },
    ];
    for c in &cases {
        let (equal, total) = run(c, &mut rng, &dev)?;
        println!("t {} h {} d {} kw {} ke {}: {equal} of {total} outputs equal the reference", c.t, c.h, c.d, c.kw, c.ke);
        ensure!(equal * 10 >= total * 9, "t {} h {} d {}: only {equal} of {total} outputs equal the reference", c.t, c.h, c.d);
    }
    Ok(())
}

/// Tokens without a valid row give zeros (with and without a sink); more than 65,535 (token, head)
/// pairs run.
#[test]
fn empty_rows_and_large_grids() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x5a_0002);
    let (t, h, d) = (3usize, 2usize, 16usize);
    let q = Tensor::from_vec((0..t * h * d).map(|_| rng.normal()).collect::<Vec<f32>>(), (t, h, d), &dev)?.to_dtype(DType::BF16)?;
    let rows = Tensor::from_vec((0..8 * d).map(|_| rng.normal()).collect::<Vec<f32>>(), (8, d), &dev)?.to_dtype(DType::BF16)?;
    let none = Tensor::from_vec(vec![-1i64, 9, -5, 8, -1, -1], (t, 2), &dev)?;
    let empty = Tensor::zeros((t, 0), DType::I64, &dev)?;
    for sink in [f32::NEG_INFINITY, 3.0] {
        poison(&dev, t * h * d)?;
        let out = sparse_attention_small(&q, &rows, &none, &rows, &empty, &Tensor::new(&[sink, sink][..], &dev)?, 0.25)?;
        let v = out.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        ensure!(v.iter().all(|&x| x == 0.0), "sink {sink}: tokens without valid rows must give zeros, got {:?}", &v[..4]);
    }
    let case = Case { t: 70_000, h: 1, d: 8, nw: 16, ne: 4, kw: 3, ke: 2, spread: 1.0, sink: Some(0.0) };
    let (equal, total) = run(&case, &mut rng, &dev)?;
    ensure!(equal * 10 >= total * 9, "70,000 tokens: only {equal} of {total} equal");
    Ok(())
}

#[test]
fn errors() -> Result<()> {
    let dev = gpu();
    let q = Tensor::zeros((2, 2, 16), DType::BF16, &dev)?;
    let rows = Tensor::zeros((4, 16), DType::BF16, &dev)?;
    let idx = Tensor::zeros((2, 3), DType::I64, &dev)?;
    let sink = Tensor::zeros(2, DType::F32, &dev)?;
    let wide = Tensor::zeros((2, 2, 520), DType::BF16, &dev)?;
    let wide_rows = Tensor::zeros((4, 520), DType::BF16, &dev)?;
    ensure!(sparse_attention_small(&wide, &wide_rows, &idx, &wide_rows, &idx, &sink, 1.0).is_err(), "d 520 accepted");
    ensure!(sparse_attention_small(&q, &rows, &idx.narrow(0, 0, 1)?, &rows, &idx, &sink, 1.0).is_err(), "indices of another T accepted");
    ensure!(sparse_attention_small(&q, &rows, &idx.to_dtype(DType::U32)?, &rows, &idx, &sink, 1.0).is_err(), "u32 indices accepted");
    ensure!(sparse_attention_small(&q, &rows, &idx, &rows, &idx, &sink.narrow(0, 0, 1)?, 1.0).is_err(), "a sink of another H accepted");
    ensure!(sparse_attention_small(&q.to_dtype(DType::F32)?, &rows, &idx, &rows, &idx, &sink, 1.0).is_err(), "f32 q accepted");
    ensure!(sparse_attention_small(&q.to_device(&Device::Cpu)?, &rows, &idx, &rows, &idx, &sink, 1.0).is_err(), "a CPU q accepted");
    Ok(())
}
