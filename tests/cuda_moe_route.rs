//! GPU tests of the MoE router kernel `kernels/moe_route.cu` (`cuda::moe_route_device`) against
//! its CPU reference `model::moe_route_ref` (the crate's host routing plus `sort_by_expert`):
//! ids, counts, offsets and order equal exactly, weights within `MAX_WEIGHT_ULPS` — or bit for
//! bit where the scores are exact on both sides (logits > 20, where softplus passes them through
//! and the score is an IEEE square root).
//!
//! Why a tolerance on the weights: the kernel's softplus is correctly rounded, the host's is the
//! platform libm's (glibc 2.36's log1pf differs by 1 ulp on ~1.5 % of inputs), so a score can
//! differ by 1 ulp; `s_e / (Σ s + 1e-20) · scale` compounds the differences of s_e and of the
//! sum's k terms (measured over 580K weights of these distributions: at most 5 ulp, 98.5 %
//! equal). The same 1 ulp can flip a decision between two biased scores within ~1 ulp, so the
//! random rows are drawn tie-free: the top k + 1 biased scores of every row (estimated in f64)
//! are at least ~2^-18 of their size apart (rows are redrawn otherwise). Exact ties are tested
//! with values both sides compute identically (equal logits and biases, saturated logits).
//!
//! Every call's outputs are allocated over freed poisoned memory (u32 0x5a5a5a5a, f32 NaN), so an
//! element the kernel does not write shows up as a difference.
//!
//! The NaN cases assume x86-64 (the CPU's `+inf + -inf` is the negative default NaN there).
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_moe_route`.

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::cuda::{moe_route_device, with_device_routing, with_plain_candle, DeviceRouting};
use deepseek_v41::model::{moe_route_ref, ExpertSort, Gate, Routing};
use deepseek_v41::nn::RandomWeights;
use deepseek_v41::Config;

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

/// Largest weight difference (ulp) allowed where the scores may differ by 1 ulp (module docs).
const MAX_WEIGHT_ULPS: u32 = 8;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_moe_route.rs needs a CUDA device (none found): these tests must run on a GPU")
}

/// Allocates and frees poisoned buffers of `n` elements so the next outputs likely reuse them.
fn poison(dev: &Device, n: usize) -> Result<()> {
    let a = Tensor::full(0x5a5a_5a5au32, n.max(1), dev)?;
    let b = Tensor::full(f32::NAN, n.max(1), dev)?;
    dev.synchronize()?;
    drop((a, b));
    Ok(())
}

/// One routing problem: `logits` `[t, e]` row-major, `bias` `[e]`.
struct Problem {
    t: usize,
    e: usize,
    k: usize,
    temp: f32,
    scale: f32,
    logits: Vec<f32>,
    bias: Vec<f32>,
}

impl Problem {
    fn name(&self) -> String {
        format!("T {} E {} k {} temp {}", self.t, self.e, self.k, self.temp)
    }
}

/// A [`DeviceRouting`] read back to the host.
struct Got {
    ids: Vec<u32>,
    weights: Vec<f32>,
    sort: ExpertSort,
}

fn read(r: &DeviceRouting) -> Result<Got> {
    let u32s = |t: &Tensor| -> Result<Vec<u32>> { Ok(t.flatten_all()?.to_vec1::<u32>()?) };
    Ok(Got {
        ids: u32s(&r.ids)?,
        weights: r.weights.flatten_all()?.to_vec1::<f32>()?,
        sort: ExpertSort { counts: u32s(&r.counts)?, offsets: u32s(&r.offsets)?, order: u32s(&r.order)? },
    })
}

/// The device's routing of `p` (over poisoned memory) and the CPU reference's.
fn run(dev: &Device, p: &Problem) -> Result<(Got, Routing, ExpertSort)> {
    poison(dev, p.t * p.e.max(p.k) + p.e + 1)?;
    let logits = Tensor::from_slice(&p.logits, (p.t, p.e), dev)?;
    let bias = Tensor::from_slice(&p.bias, p.e, dev)?;
    let r = moe_route_device(&logits, &bias, p.k, p.temp, p.scale)?;
    ensure!(r.ids.dims() == [p.t, p.k] && r.weights.dims() == [p.t, p.k], "{}: output shapes", p.name());
    ensure!(r.counts.dims() == [p.e] && r.offsets.dims() == [p.e + 1] && r.order.dims() == [p.t * p.k], "{}: sort shapes", p.name());
    let got = read(&r)?;
    let (routing, sort) = moe_route_ref(&p.logits, p.e, &p.bias, p.k, p.temp, p.scale)?;
    Ok((got, routing, sort))
}

/// Key of `f32::total_cmp`: the distance of two keys counts the floats between them.
fn key(x: f32) -> i64 {
    let b = x.to_bits();
    (if b >> 31 == 1 { !b } else { b | 0x8000_0000 }) as i64
}

/// Ulps between `a` and `b` (0 when both are NaN).
fn ulps(a: f32, b: f32) -> u32 {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => 0,
        (false, false) => (key(a) - key(b)).unsigned_abs().min(u32::MAX as u64) as u32,
        _ => u32::MAX,
    }
}

/// Checks the device's outputs against the reference: decisions and sort exactly, weights within
/// `max_ulps`. Returns the largest weight difference seen (ulp).
fn check(p: &Problem, got: &Got, want: &Routing, want_sort: &ExpertSort, max_ulps: u32) -> Result<u32> {
    let name = p.name();
    if let Some(t) = (0..p.t).find(|&t| got.ids[t * p.k..(t + 1) * p.k] != want.ids[t * p.k..(t + 1) * p.k]) {
        anyhow::bail!("{name}: token {t}: ids {:?}, CPU {:?}", &got.ids[t * p.k..(t + 1) * p.k], &want.ids[t * p.k..(t + 1) * p.k])
    }
    ensure!(got.sort.counts == want_sort.counts, "{name}: counts differ");
    ensure!(got.sort.offsets == want_sort.offsets, "{name}: offsets differ");
    if let Some(i) = (0..got.sort.order.len()).find(|&i| got.sort.order[i] != want_sort.order[i]) {
        anyhow::bail!("{name}: order[{i}] = {:#x}, CPU {}", got.sort.order[i], want_sort.order[i])
    }
    let mut worst = 0;
    for (i, (&g, &w)) in got.weights.iter().zip(&want.weights).enumerate() {
        let d = ulps(g, w);
        ensure!(d <= max_ulps, "{name}: weight {i} (token {}, choice {}): {g:e} vs CPU {w:e}, {d} ulp", i / p.k, i % p.k);
        worst = worst.max(d);
    }
    Ok(worst)
}

/// `sqrt(softplus(l · (1 / temp))) + b` in f64 (an estimate of the biased score) and the score.
fn biased_f64(l: f32, b: f32, temp: f32) -> (f64, f64) {
    let x = l as f64 / temp as f64;
    let s = if x > 20.0 { x } else { x.exp().ln_1p() }.sqrt();
    (s + b as f64, s)
}

/// Whether the top `k + 1` biased scores of a row are apart by more than the kernel's and the
/// host's scores can differ (1 ulp of the score plus the add's rounding), with a wide margin.
fn tie_free(row: &[f32], bias: &[f32], k: usize, temp: f32) -> bool {
    let mut v: Vec<(f64, f64)> = row.iter().zip(bias).map(|(&l, &b)| biased_f64(l, b, temp)).collect();
    v.sort_by(|a, b| b.0.total_cmp(&a.0));
    let top = &v[..(k + 1).min(v.len())];
    let mag = top.iter().map(|(b, s)| b.abs() + s.abs()).fold(0.0, f64::max);
    top.windows(2).all(|w| w[0].0 - w[1].0 > mag * 2f64.powi(-18))
}

/// How the random logits are drawn.
#[derive(Clone, Copy, Debug)]
enum Dist {
    /// Every logit in ±0.05: scores within ~2 % of each other, the bias decides much.
    NearUniform,
    /// Wide logits (σ ≈ 5), the first 8 experts favoured by +4, 1 % above 20 (softplus passes
    /// through) and 1 % at −40 (exp underflows towards 0).
    Skewed,
}

fn random_problem(rng: &mut Rng, t: usize, e: usize, k: usize, dist: Dist, temp: f32) -> Result<Problem> {
    let bias: Vec<f32> = (0..e).map(|_| (rng.uniform() - 0.5) * 0.2).collect();
    let mut logits = Vec::with_capacity(t * e);
    for _ in 0..t {
        let mut tries = 0;
        let row = loop {
            let row: Vec<f32> = (0..e)
                .map(|x| match dist {
                    Dist::NearUniform => (rng.uniform() - 0.5) * 0.1,
                    Dist::Skewed => match rng.below(100) {
                        0 => 20.0 + rng.uniform() * 30.0,
                        1 => -40.0,
                        _ => rng.normal() * 3.0 + if x < 8 { 4.0 } else { 0.0 },
                    },
                })
                .collect();
            if tie_free(&row, &bias, k, temp) {
                break row;
            }
            tries += 1;
            ensure!(tries < 200, "no tie-free row drawn for E {e} k {k} {dist:?}");
        };
        logits.extend(row);
    }
    Ok(Problem { t, e, k, temp, scale: 1.5, logits, bias })
}

/// Random tie-free logits over the shapes of the brief: E 4 / 16 / 100 / 384 / 511, k 1 / 6 / 8
/// (k = E for E = 4); T around the kernel's bounds: the one-launch path (T <= 8: a cluster of T
/// CTAs, odd sizes included), the route grid's one-token CTAs (T <= 1024) and 8-token CTAs (a partial
/// last CTA at 1025 and 4097), the one-CTA bitmap sort (T <= 256: 1, 2 and 8 bitmap words) and the
/// chunked sort beyond (512 / 2048 tokens); E 100 / 384 / 511 are not multiples of the 256 or
/// 512 scoring threads; near-uniform and skewed logits; gate_temp 1 and 0.8.
#[test]
fn random_logits_match_the_cpu_reference() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x5eed_0008);
    let mut worst = 0;
    let mut runs = 0;
    for e in [4usize, 16, 100, 384, 511] {
        let mut ks: Vec<usize> = [1usize, 6, 8].iter().map(|&k| k.min(e)).collect();
        ks.dedup();
        for &k in &ks {
            for t in [1usize, 2, 3, 5, 8, 9, 63, 64, 65, 256, 257, 1024, 1025, 4097] {
                for dist in [Dist::NearUniform, Dist::Skewed] {
                    let temp = if (t + k) % 2 == 0 { 1.0 } else { 0.8 };
                    let p = random_problem(&mut rng, t, e, k, dist, temp)?;
                    let (got, want, sort) = run(&dev, &p)?;
                    worst = worst.max(check(&p, &got, &want, &sort, MAX_WEIGHT_ULPS).with_context(|| format!("{dist:?}"))?);
                    runs += 1;
                }
            }
        }
    }
    eprintln!("{runs} runs; largest weight difference {worst} ulp");
    Ok(())
}

/// Logits in (20, 60]: softplus passes them through and the scores are IEEE square roots on both
/// sides, so everything is bit exact, weights included. Logits on a grid of 1/8 plus the squares
/// 25, 36, 49 with biases in {0, 0.5, 1, 2} make many exact ties (equal logits and biases, and
/// √25 + 1 = √36 + 0), which must go to the lower expert id.
#[test]
fn saturated_logits_are_bit_exact_with_ties() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x5a7);
    let mut tied_rows = 0;
    for (e, k) in [(16usize, 6usize), (384, 6), (511, 8), (384, 1), (16, 16)] {
        for t in [1usize, 5, 9, 65, 256, 1025, 4097] {
            for temp in [1.0f32, 0.5] {
                let bias: Vec<f32> = (0..e).map(|_| [0.0, 0.5, 1.0, 2.0][rng.below(4)]).collect();
                let logits: Vec<f32> = (0..t * e)
                    .map(|_| match rng.below(10) {
                        0 => [25.0, 36.0, 49.0][rng.below(3)],
                        _ => 21.0 + rng.below(240) as f32 / 8.0,
                    })
                    .collect();
                let p = Problem { t, e, k, temp, scale: 2.5, logits, bias };
                let (got, want, sort) = run(&dev, &p)?;
                check(&p, &got, &want, &sort, 0)?;
                tied_rows += boundary_ties(&p, &want);
            }
        }
    }
    ensure!(tied_rows > 1000, "only {tied_rows} rows had a tie at the k boundary");
    Ok(())
}

/// Rows whose k-th biased score equals an unselected expert's (a tie decided by the id).
fn boundary_ties(p: &Problem, want: &Routing) -> usize {
    let scale = (1.0 / p.temp as f64) as f32;
    (0..p.t)
        .filter(|&t| {
            let biased: Vec<f32> = (0..p.e)
                .map(|x| {
                    let l = p.logits[t * p.e + x];
                    let l = if p.temp == 1.0 { l } else { l * scale + 0.0 };
                    (if l > 20.0 { l } else { l.exp().ln_1p() }).sqrt() + p.bias[x]
                })
                .collect();
            let sel = &want.ids[t * p.k..(t + 1) * p.k];
            let last = biased[sel[p.k - 1] as usize];
            (0..p.e).any(|x| biased[x] == last && !sel.contains(&(x as u32)))
        })
        .count()
}

/// Exact ties of ordinary (non-saturated) scores: logits from a small set, so equal logits with
/// equal biases give equal biased scores on both sides; different values are far apart. A row of
/// all-equal logits with zero bias takes experts 0..k in order.
#[test]
fn exact_ties_pick_the_lowest_ids() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x71e5);
    let (mut tied, mut rows) = (0, 0);
    for (e, k) in [(4usize, 4usize), (4, 2), (16, 6), (384, 6), (511, 8)] {
        for t in [1usize, 5, 9, 65, 256, 1025, 4097] {
            let bias: Vec<f32> = (0..e).map(|_| [0.0, 0.25][rng.below(2)]).collect();
            let mut logits: Vec<f32> = (0..t * e).map(|_| [-1.0, 0.5, 2.0][rng.below(3)]).collect();
            // Token 0: all equal logits; with zero bias the ids are 0..k.
            logits[..e].fill(0.3);
            let p = Problem { t, e, k, temp: 1.0, scale: 1.5, logits, bias: bias.clone() };
            let (got, want, sort) = run(&dev, &p)?;
            check(&p, &got, &want, &sort, MAX_WEIGHT_ULPS)?;
            tied += boundary_ties(&p, &want);
            rows += t;
            let zero = Problem { t: 1, e, k, temp: 1.0, scale: 1.5, logits: vec![0.3; e], bias: vec![0.0; e] };
            let (got, want, sort) = run(&dev, &zero)?;
            check(&zero, &got, &want, &sort, MAX_WEIGHT_ULPS)?;
            ensure!(got.ids == (0..k as u32).collect::<Vec<_>>(), "E {e}: all-equal row chose {:?}", got.ids);
            ensure!(got.weights.iter().all(|&w| w == got.weights[0]), "E {e}: equal scores, unequal weights");
        }
    }
    ensure!(tied * 3 >= rows, "only {tied} of {rows} rows have a tie at the k boundary");
    Ok(())
}

/// NaN and infinite logits and biases, on saturated rows (so the rest is exact): a +NaN logit
/// ranks above every number (ties among NaNs by id), −NaN below every number, a NaN bias likewise
/// by its sign, and +inf + −inf is the CPU's negative default NaN; a token with a NaN or +inf
/// score among its choices gets NaN weights where the CPU does.
#[test]
fn nan_and_inf_scores_rank_like_total_cmp() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x4a4);
    for (e, k) in [(16usize, 6usize), (384, 8)] {
        let t = 65;
        let mut bias: Vec<f32> = (0..e).map(|_| rng.below(4) as f32 * 0.5).collect();
        bias[3] = f32::NAN;
        bias[5] = -f32::NAN;
        bias[7] = f32::NEG_INFINITY;
        let mut logits: Vec<f32> = (0..t * e).map(|_| 21.0 + rng.below(240) as f32 / 8.0).collect();
        // An expert of an odd id above 7: its bias is a number (a NaN logit with a NaN bias takes
        // the NaN of whichever operand the CPU's compiled add puts first).
        let plain = |rng: &mut Rng| 9 + 2 * rng.below((e - 9) / 2);
        for row in 0..t {
            let r = &mut logits[row * e..(row + 1) * e];
            match row % 6 {
                0 => {}
                1 => r[plain(&mut rng)] = f32::NAN,
                2 => r.iter_mut().step_by(2).for_each(|l| *l = f32::NAN), // more NaNs than k
                3 => r[plain(&mut rng)] = -f32::NAN,
                4 => r[7] = f32::INFINITY, // +inf + −inf bias
                _ => r[plain(&mut rng)] = f32::INFINITY,
            }
        }
        let p = Problem { t, e, k, temp: 1.0, scale: 1.5, logits, bias };
        let (got, want, sort) = run(&dev, &p)?;
        check(&p, &got, &want, &sort, 0)?;
        // The NaN bias of expert 3 wins every row without a NaN logit (it is then tied by id).
        ensure!(got.ids[0] == 3, "row 0 chose {:?}", &got.ids[..k]);
        ensure!(!got.ids[..k].contains(&5), "the −NaN bias of expert 5 was chosen");
        ensure!(got.weights.iter().any(|w| w.is_nan()), "no NaN weight");
    }
    Ok(())
}

/// Experts without tokens (E = 511 for one token; a bias that keeps 3 experts out of every row)
/// and one expert chosen by every token (a huge bias): counts 0 and T, repeated offsets.
#[test]
fn idle_experts_and_one_expert_for_every_token() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x1d1e);
    for (t, e, k) in [(1usize, 511usize, 8usize), (4097, 384, 6), (64, 16, 8), (9, 4, 1)] {
        let mut bias: Vec<f32> = (0..e).map(|_| rng.below(3) as f32).collect();
        bias[e / 2] = 1e30;
        if e > 4 {
            bias[..3].fill(-1e30);
        }
        let logits: Vec<f32> = (0..t * e).map(|_| 21.0 + rng.below(240) as f32 / 8.0).collect();
        let p = Problem { t, e, k, temp: 1.0, scale: 1.5, logits, bias };
        let (got, want, sort) = run(&dev, &p)?;
        check(&p, &got, &want, &sort, 0)?;
        ensure!(got.sort.counts[e / 2] as usize == t, "T {t} E {e}: expert {} has {} slots", e / 2, got.sort.counts[e / 2]);
        ensure!((0..t).all(|x| got.ids[x * k] as usize == e / 2), "T {t} E {e}: the favoured expert is not first");
        if e > 4 {
            ensure!(got.sort.counts[..3].iter().all(|&c| c == 0), "T {t} E {e}: excluded experts got slots");
        }
        ensure!(got.sort.offsets[e] as usize == t * k, "offsets[E]");
    }
    Ok(())
}

/// Views (transposed logits, a strided bias with an offset) give the same outputs as contiguous
/// copies.
#[test]
fn views_equal_contiguous_inputs() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x71e3);
    let (t, e, k) = (70usize, 384usize, 6usize);
    let p = random_problem(&mut rng, t, e, k, Dist::Skewed, 0.8)?;
    let logits = Tensor::from_slice(&p.logits, (t, e), &dev)?;
    let bias = Tensor::from_slice(&p.bias, e, &dev)?;
    let logits_view = logits.t()?.contiguous()?.t()?;
    ensure!(!logits_view.is_contiguous(), "the logits view is contiguous");
    let bias_view = Tensor::stack(&[&bias.zeros_like()?, &bias], 1)?.narrow(1, 1, 1)?.squeeze(1)?;
    ensure!(!bias_view.is_contiguous(), "the bias view is contiguous");
    let a = read(&moe_route_device(&logits, &bias, k, p.temp, p.scale)?)?;
    let b = read(&moe_route_device(&logits_view, &bias_view, k, p.temp, p.scale)?)?;
    ensure!(a.ids == b.ids && a.sort == b.sort, "views change the decision");
    ensure!(a.weights.iter().zip(&b.weights).all(|(x, y)| x.to_bits() == y.to_bits()), "views change the weights");
    Ok(())
}

/// Bad inputs are errors naming the value, never panics; T = 0 gives empty outputs.
#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let dev = gpu();
    let logits = Tensor::ones((3, 16), DType::F32, &dev)?;
    let bias = Tensor::zeros(16, DType::F32, &dev)?;
    let err = |r: candle_core::Result<DeviceRouting>, what: &str, needle: &str| -> Result<()> {
        match r {
            Ok(_) => anyhow::bail!("{what} accepted"),
            Err(e) => ensure!(e.to_string().contains(needle), "{what}: error {e} does not name {needle}"),
        }
        Ok(())
    };
    err(moe_route_device(&logits, &bias, 0, 1.0, 1.5), "k = 0", "k = 0")?;
    err(moe_route_device(&logits, &bias, 17, 1.0, 1.5), "k = 17", "k = 17")?;
    let small = Tensor::ones((3, 4), DType::F32, &dev)?;
    err(moe_route_device(&small, &Tensor::zeros(4, DType::F32, &dev)?, 5, 1.0, 1.5), "k > E", "k = 5")?;
    let wide = Tensor::ones((2, 513), DType::F32, &dev)?;
    err(moe_route_device(&wide, &Tensor::zeros(513, DType::F32, &dev)?, 6, 1.0, 1.5), "E = 513", "513")?;
    err(moe_route_device(&logits.to_dtype(DType::BF16)?, &bias, 6, 1.0, 1.5), "bf16 logits", "BF16")?;
    err(moe_route_device(&logits.flatten_all()?, &bias, 6, 1.0, 1.5), "1-D logits", "[48]")?;
    err(moe_route_device(&logits.to_device(&Device::Cpu)?, &bias, 6, 1.0, 1.5), "CPU logits", "Cpu")?;
    err(moe_route_device(&logits, &Tensor::zeros(15, DType::F32, &dev)?, 6, 1.0, 1.5), "bias [15]", "[15]")?;
    err(moe_route_device(&logits, &bias.to_device(&Device::Cpu)?, 6, 1.0, 1.5), "CPU bias", "Cpu")?;
    err(moe_route_device(&logits, &bias.to_dtype(DType::F64)?, 6, 1.0, 1.5), "f64 bias", "F64")?;
    for temp in [0.0f32, -1.0, f32::NAN, f32::INFINITY, 1e-39] {
        err(moe_route_device(&logits, &bias, 6, temp, 1.5), "bad temp", &format!("{temp}"))?;
    }
    for scale in [f32::NAN, f32::INFINITY] {
        err(moe_route_device(&logits, &bias, 6, 1.0, scale), "bad route_scale", &format!("{scale}"))?;
    }
    // 2^27 tokens of k = 16 overflow the u32 slot indices (a broadcast view: nothing allocated).
    let huge = Tensor::zeros((1, 16), DType::F32, &dev)?.broadcast_as((1usize << 27, 16))?;
    err(moe_route_device(&huge, &bias, 16, 1.0, 1.5), "T·k = 2^31", "2^31")?;

    let none = moe_route_device(&Tensor::zeros((0, 16), DType::F32, &dev)?, &bias, 6, 1.0, 1.5)?;
    let got = read(&none)?;
    ensure!(none.ids.dims() == [0, 6] && got.ids.is_empty() && got.sort.order.is_empty(), "T = 0: non-empty outputs");
    ensure!(got.sort.counts == vec![0; 16] && got.sort.offsets == vec![0; 17], "T = 0: counts / offsets");
    Ok(())
}

fn fixtures() -> PathBuf {
    let built = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny"));
    // Packed binaries run on the GPU machine from the repository root.
    if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures/v41-tiny")
    }
}

/// `model::Gate::route` with the device routing (`cuda::with_device_routing`) against the host
/// routing and the reference on the gate's own logits (random weights, 384 experts, top-6,
/// gate_temp 1 and 0.7): the host routing equals the reference bit for bit; the device routing
/// equals it on every tie-free row (weights within `MAX_WEIGHT_ULPS`), and with plain Candle ops
/// the device routing is off.
#[test]
fn gate_routes_on_the_device_inside_the_scope() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x6a7e);
    let mut cfg = Config::from_file(fixtures().join("config.json"))?;
    cfg.n_routed_experts = 384;
    cfg.num_experts_per_tok = 6;
    let (e, k, d) = (384usize, 6usize, cfg.hidden_size);
    let mut checked = 0;
    for (temp, t) in [(1.0f64, 1usize), (1.0, 200), (0.7, 1), (0.7, 200)] {
        cfg.gate_temp = temp;
        let gate = Gate::new(&cfg, RandomWeights::new(5).var_builder(DType::BF16, &dev).pp("gate"))?;
        let x = Tensor::from_vec((0..t * d).map(|_| rng.normal()).collect::<Vec<f32>>(), (t, d), &dev)?.to_dtype(DType::BF16)?;
        let logits = gate.logits(&x)?.flatten_all()?.to_vec1::<f32>()?;
        let bias = RandomWeights::new(5).var_builder(DType::F32, &Device::Cpu).pp("gate").get(e, "bias")?.to_vec1::<f32>()?;
        let (want, _) = moe_route_ref(&logits, e, &bias, k, temp as f32, cfg.routed_scaling_factor as f32)?;
        let host = gate.route(&x)?;
        ensure!(host == want, "temp {temp} T {t}: the host routing differs from the reference");
        let plain = with_plain_candle(|| with_device_routing(|| gate.route(&x)))?;
        ensure!(plain == want, "temp {temp} T {t}: plain Candle ops did not keep the host routing");
        let device = with_device_routing(|| gate.route(&x))?;
        ensure!(device.k == k && device.ids.len() == t * k, "temp {temp} T {t}: device routing shape");
        for row in 0..t {
            if !tie_free(&logits[row * e..(row + 1) * e], &bias, k, temp as f32) {
                continue;
            }
            let r = row * k..(row + 1) * k;
            let (got, exp) = (&device.ids[r.clone()], &want.ids[r.clone()]);
            ensure!(got == exp, "temp {temp} row {row}: device {got:?}, reference {exp:?}");
            for i in r {
                ensure!(ulps(device.weights[i], want.weights[i]) <= MAX_WEIGHT_ULPS, "temp {temp} weight {i}");
            }
            checked += 1;
        }
    }
    ensure!(checked >= 300, "only {checked} tie-free rows");
    Ok(())
}
