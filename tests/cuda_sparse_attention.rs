//! GPU tests of `deepseek_v41::cuda::sparse_attention_two_source` (kernels/sparse_attention.cu)
//! against its CPU path (the crate's `sparse_attention_ref` on the concatenated sources).
//!
//! Random data (never zeros), both outputs' memory poisoned with NaN beforehand (the allocator
//! hands freed blocks back), −1 holes and padding, duplicates, lengths 0 / 1 / 127 / 128 / 129 /
//! 512 per source mixed in one batch, sinks on and off (−inf), H = 4, 20, 64 and 128 (two head
//! blocks), i64 and i32 indices, forced KV splits 1, 2, 3, 5 and 8 (split boundaries inside
//! and between the sources, empty splits), the 4096-index limit, and a batch of 264 tokens (the
//! prefill configuration: one CTA per token). The head-split kernel (32 heads per CTA, no split)
//! is forced over the same edge cases (H = 4, 20, 64, 100, 128: partial head blocks too), and so are
//! its ping-pong loop (`SparseAttentionKernel::HeadSplitPingPong`) and the dims-split pair
//! (`SparseAttentionKernel::DimSplitPair`, Auto's choice where it picks the head split): valid-row
//! counts around the tile and consumer boundaries, H = 40; with one tile per token the ping-pong
//! loop must give bitwise the two-stage loop's results. The all-heads kernel's
//! alternating (seesaw) tile loop is covered over 1 ... 7 tiles per split (valid counts 1, 63, 64,
//! 65, 127, 128, 129, ...), forced splits 1, 2, 3, 5 and H = 4, 64, 128.
//! Tolerance: bf16 outputs within 1 ulp, at most 0.5 % beyond (the f32 order of the dot
//! products and of the tensor-core sums differs, which can flip a bf16-rounded probability;
//! those stay within 2^-7 of the row's largest magnitude) of the crate reference for one split,
//! and of an independent model of the split-KV numerics (`split_model`) for several, where p is
//! rounded relative to each split's own max; the split runs also stay within 2^-6 of the row's
//! largest magnitude of the crate reference. The head-split kernel (both loops) has the numerics
//! of one split: the same strict comparison with the crate reference. lse within 1e-5 relative.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_sparse_attention`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::cuda::{
    sparse_attention_two_source, sparse_attention_two_source_with, SparseAttentionKernel, SparseAttentionOptions,
};
use half::bf16;

const D: usize = 512;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_sparse_attention.rs needs a CUDA device (none found)")
}

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;
#[path = "support/sparse_attention_data.rs"]
mod sparse_attention_data;
use sparse_attention_data::{index_rows, random_bf16};

/// Allocates and frees NaN buffers of the outputs' sizes so the op's fresh (uninitialized)
/// outputs likely reuse NaN memory: an element the kernel fails to write shows up as NaN.
fn poison_allocator(dev: &Device, t: usize, h: usize) -> Result<()> {
    let a = Tensor::full(f32::NAN, (t, h, D), dev)?.to_dtype(DType::BF16)?;
    let b = Tensor::full(f32::NAN, (t, h), dev)?;
    dev.synchronize()?;
    drop((a, b));
    Ok(())
}

fn ulps(a: bf16, b: bf16) -> u32 {
    let key = |x: bf16| {
        let u = x.to_bits() as i32;
        if u & 0x8000 != 0 {
            -(u & 0x7fff)
        } else {
            u
        }
    };
    (key(a) - key(b)).unsigned_abs()
}

struct Case<'a> {
    seed: u64,
    h: usize,
    win_lens: &'a [usize],
    extra_lens: &'a [usize],
    kw: usize,
    kc: usize,
    holes: usize,
    amp_q: f32,
    i32_indices: bool,
    /// Forced KV splits (None: the launcher's choice).
    splits: Option<usize>,
    /// Forced kernel (Auto: the launcher's choice).
    kernel: SparseAttentionKernel,
}

impl Default for Case<'_> {
    fn default() -> Self {
        Case { seed: 0, h: 64, win_lens: &WIN, extra_lens: &EXTRA, kw: 128, kc: 512, holes: 0, amp_q: 1.0, i32_indices: false, splits: None, kernel: SparseAttentionKernel::Auto }
    }
}

/// Independent model of the kernel's split-KV numerics (its header comment): the valid rows
/// (window then extra, holes removed) are cut into `splits` ranges of whole 64-row blocks; each
/// range runs the reference's blocked online softmax from the −1e30 floor (p rounded to bf16
/// relative to the range's running max, f32 denominators of unrounded p); the ranges are merged
/// with weights e^{m_r − M} / (Σ_r e^{m_r − M} den_r + e^{sink − M}). Output rounded to bf16.
/// With one split this is exactly the crate's `sparse_attention_ref`.
fn split_model(q: &[f32], rows: &[Vec<&[f32]>], h: usize, sink: &[f32], scale: f32, splits: usize) -> Vec<bf16> {
    const BLOCK: usize = 64;
    let mut out = vec![bf16::ZERO; rows.len() * h * D];
    for (ti, tr) in rows.iter().enumerate() {
        let count = tr.len();
        let per = count.div_ceil(BLOCK).div_ceil(splits) * BLOCK;
        for hi in 0..h {
            let qr = &q[(ti * h + hi) * D..][..D];
            let mut parts = Vec::new(); // (m, den, acc) per split
            for r in 0..splits {
                let lo = (r * per).min(count);
                let hi_ = (lo + per).min(count);
                let (mut m, mut den, mut acc) = (-1e30f32, 0f32, vec![0f32; D]);
                for blk in tr[lo..hi_].chunks(BLOCK) {
                    let l: Vec<f32> = blk.iter().map(|k| scale * qr.iter().zip(*k).map(|(a, b)| a * b).sum::<f32>()).collect();
                    let m_new = l.iter().fold(m, |a, &b| a.max(b));
                    let alpha = (m - m_new).exp();
                    den *= alpha;
                    acc.iter_mut().for_each(|o| *o *= alpha);
                    for (&li, k) in l.iter().zip(blk) {
                        let p = (li - m_new).exp();
                        den += p;
                        let pb = bf16::from_f32(p).to_f32();
                        acc.iter_mut().zip(*k).for_each(|(o, &v)| *o += pb * v);
                    }
                    m = m_new;
                }
                parts.push((m, den, acc));
            }
            let big = parts.iter().fold(-1e30f32, |a, p| a.max(p.0));
            let wsum: f32 = parts.iter().map(|p| (p.0 - big).exp() * p.1).sum();
            let den = wsum + (sink[hi] - big).exp();
            let ok = den > 0.0 && den.is_finite();
            let o = &mut out[(ti * h + hi) * D..][..D];
            for (d, od) in o.iter_mut().enumerate() {
                let v: f32 = parts.iter().map(|p| if ok { (p.0 - big).exp() / den * p.2[d] } else { 0.0 }).sum();
                *od = bf16::from_f32(v);
            }
        }
    }
    out
}

/// Per-token valid rows (window then extra) as f32 slices of the host sources.
fn valid_rows<'a>(iw: &[i64], kw: usize, kvw: &'a [f32], ic: &[i64], kc: usize, kvc: &'a [f32], t: usize) -> Vec<Vec<&'a [f32]>> {
    (0..t)
        .map(|ti| {
            let w = iw[ti * kw..][..kw].iter().filter(|&&i| i >= 0).map(|&i| &kvw[i as usize * D..][..D]);
            let c = ic[ti * kc..][..kc].iter().filter(|&&i| i >= 0).map(|&i| &kvc[i as usize * D..][..D]);
            w.chain(c).collect()
        })
        .collect()
}

/// Compares bf16 outputs: all within 1 ulp except at most 0.5 %, those within 2^-7 of the row's
/// largest magnitude (cancellation in P·V). Returns (at 1 ulp, beyond).
fn compare(what: &str, c: &Case, og: &[bf16], oc: &[bf16]) -> Result<(usize, usize)> {
    let (mut one, mut two) = (0usize, 0usize);
    for (i, (&a, &b)) in og.iter().zip(oc).enumerate() {
        ensure!(a.is_finite(), "seed {}: out[{i}] = {a} (unwritten or overflow)", c.seed);
        let u = ulps(a, b);
        if u >= 2 {
            let row = &oc[i / D * D..][..D];
            let amax = row.iter().map(|x| x.to_f32().abs()).fold(0f32, f32::max);
            ensure!(
                (a.to_f32() - b.to_f32()).abs() <= amax * 2f32.powi(-7),
                "seed {} vs {what}: out[t{} h{} d{}] gpu {a} want {b} ({u} ulps, row amax {amax})",
                c.seed,
                i / D / c.h,
                i / D % c.h,
                i % D
            );
            two += 1;
        } else if u == 1 {
            one += 1;
        }
    }
    ensure!(two * 200 <= og.len(), "seed {} vs {what}: {two} of {} outputs beyond 1 ulp", c.seed, og.len());
    Ok((one, two))
}

fn run_case(c: &Case) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(c.seed);
    let t = c.win_lens.len();
    let (nw, nc) = (257usize, 1031usize);
    let q = random_bf16(&mut rng, &[t, c.h, D], c.amp_q)?;
    let kvw = random_bf16(&mut rng, &[nw, D], 1.0)?;
    let kvc = random_bf16(&mut rng, &[nc, D], 1.0)?;
    let iw_v = index_rows(&mut rng, c.win_lens, c.kw, nw, c.holes);
    let ic_v = index_rows(&mut rng, c.extra_lens, c.kc, nc, c.holes);
    let mut iw = Tensor::from_vec(iw_v.clone(), (t, c.kw), &Device::Cpu)?;
    let mut ic = Tensor::from_vec(ic_v.clone(), (t, c.kc), &Device::Cpu)?;
    if c.i32_indices {
        iw = iw.to_dtype(DType::I32)?;
        ic = ic.to_dtype(DType::I32)?;
    }
    // Heads alternate: sink on (values around the logits' range), off (−inf).
    let sink_v: Vec<f32> = (0..c.h).map(|i| if i % 3 == 1 { f32::NEG_INFINITY } else { 2.0 * rng.normal() }).collect();
    let sink = Tensor::new(sink_v.as_slice(), &Device::Cpu)?;
    let scale = (D as f32).powf(-0.5);

    let (out_c, lse_c) = sparse_attention_two_source(&q, &kvw, &iw, &kvc, &ic, &sink, scale)?;
    let g = |x: &Tensor| x.to_device(&dev);
    let (qg, kvwg, iwg, kvcg, icg, sg) = (g(&q)?, g(&kvw)?, g(&iw)?, g(&kvc)?, g(&ic)?, g(&sink)?);
    poison_allocator(&dev, t, c.h)?;
    let run = |num_splits: Option<usize>, kernel: SparseAttentionKernel| {
        sparse_attention_two_source_with(&qg, &kvwg, &iwg, &kvcg, &icg, &sg, scale, SparseAttentionOptions { num_splits, kernel })
    };
    let (out_g, lse_g) = run(c.splits, c.kernel)?;
    ensure!(out_g.dims() == [t, c.h, D] && lse_g.dims() == [t, c.h], "output shapes {:?} {:?}", out_g.shape(), lse_g.shape());
    let og = out_g.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<bf16>()?;

    // The configuration in effect: forced, or the launcher's choice (bit-identical to one forced
    // run: the head-split kernel, or the all-heads kernel with some split count). `splits`: the
    // numerics' split count (1 for the head-split kernel).
    let same = |num_splits, kernel| -> Result<bool> { Ok(run(num_splits, kernel)?.0.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<bf16>()? == og) };
    let (kernel, splits) = match (c.kernel, c.splits) {
        (SparseAttentionKernel::HeadSplit, _) => ("head-split", 1),
        (SparseAttentionKernel::HeadSplitPingPong, _) => ("head-split ping-pong", 1),
        (SparseAttentionKernel::DimSplitPair, _) => ("dims-split pair", 1),
        (_, Some(s)) => ("all-heads", s),
        (SparseAttentionKernel::AllHeads, None) | (SparseAttentionKernel::Auto, None) => {
            let mut found = None;
            if c.kernel == SparseAttentionKernel::Auto && same(None, SparseAttentionKernel::DimSplitPair)? {
                found = Some(("dims-split pair", 1));
            }
            if found.is_none() && c.kernel == SparseAttentionKernel::Auto && same(None, SparseAttentionKernel::HeadSplitPingPong)? {
                found = Some(("head-split ping-pong", 1));
            }
            for s in 1..=8 {
                if found.is_none() && same(Some(s), SparseAttentionKernel::AllHeads)? {
                    found = Some(("all-heads", s));
                }
            }
            found.ok_or_else(|| anyhow::anyhow!("seed {}: the default run matches no forced kernel and split count", c.seed))?
        }
    };

    // Strict: against the crate reference for one split, against the split model otherwise.
    let oc = out_c.flatten_all()?.to_vec1::<bf16>()?;
    let (one, two) = if splits == 1 {
        compare("reference", c, &og, &oc)?
    } else {
        let f = |x: &Tensor| -> Result<Vec<f32>> { Ok(x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?) };
        let (qv, kvwv, kvcv) = (f(&q)?, f(&kvw)?, f(&kvc)?);
        let rows = valid_rows(&iw_v, c.kw, &kvwv, &ic_v, c.kc, &kvcv, t);
        let model = split_model(&qv, &rows, c.h, &sink_v, scale, splits);
        // Loose: the crate reference within bf16 rounding of the probabilities.
        for (i, (&a, &b)) in og.iter().zip(&oc).enumerate() {
            let row = &oc[i / D * D..][..D];
            let amax = row.iter().map(|x| x.to_f32().abs()).fold(0f32, f32::max);
            ensure!(
                (a.to_f32() - b.to_f32()).abs() <= amax * 2f32.powi(-6),
                "seed {} splits {splits}: out[{i}] gpu {a} reference {b} (row amax {amax})",
                c.seed
            );
        }
        compare("split model", c, &og, &model)?
    };
    eprintln!(
        "seed {} {kernel} splits {splits} ({:?}, {:?}): {} outputs, {one} at 1 ulp, {two} at >= 2 ulps",
        c.seed,
        c.kernel,
        c.splits,
        og.len()
    );

    let lg = lse_g.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    let lc = lse_c.flatten_all()?.to_vec1::<f32>()?;
    for (i, (&a, &b)) in lg.iter().zip(&lc).enumerate() {
        let ok = if b == f32::NEG_INFINITY { a == b } else { (a - b).abs() <= 1e-5 * b.abs().max(1.0) };
        ensure!(ok, "seed {}: lse[t{} h{}] gpu {a} cpu {b}", c.seed, i / c.h, i % c.h);
    }
    // Empty rows: zeros and −inf.
    for (ti, (&lw, &lc_)) in c.win_lens.iter().zip(c.extra_lens).enumerate() {
        if lw == 0 && lc_ == 0 {
            ensure!(og[ti * c.h * D..][..c.h * D].iter().all(|x| x.to_f32() == 0.0), "empty token {ti} not zero");
            ensure!(lg[ti * c.h..][..c.h].iter().all(|&x| x == f32::NEG_INFINITY), "empty token {ti} lse not -inf");
        }
    }
    Ok(())
}

const WIN: [usize; 10] = [0, 1, 127, 128, 128, 0, 64, 128, 1, 100];
const EXTRA: [usize; 10] = [0, 0, 1, 129, 512, 127, 128, 512, 300, 0];

#[test]
fn mixed_lengths_h4_i64() -> Result<()> {
    run_case(&Case { seed: 1, h: 4, ..Case::default() })
}

#[test]
fn mixed_lengths_h64_i32_with_holes() -> Result<()> {
    run_case(&Case { seed: 2, holes: 9, i32_indices: true, ..Case::default() })
}

#[test]
fn sharp_logits_move_the_running_max_h64() -> Result<()> {
    // Larger q: logits spread over tens of units, so block maxima change often.
    run_case(&Case { seed: 3, kw: 130, kc: 520, holes: 3, amp_q: 6.0, ..Case::default() })?;
    run_case(&Case { seed: 13, kw: 130, kc: 520, holes: 3, amp_q: 6.0, splits: Some(1), ..Case::default() })
}

#[test]
fn odd_heads_and_window_only() -> Result<()> {
    let (win, extra) = (&[128, 5, 0, 77][..], &[0, 0, 0, 0][..]);
    run_case(&Case { seed: 4, h: 20, win_lens: win, extra_lens: extra, kc: 1, holes: 2, amp_q: 2.0, ..Case::default() })
}

#[test]
fn decode_batch_flash_shapes() -> Result<()> {
    let win = [128usize; 33];
    let extra: Vec<usize> = (0..33).map(|i| [512, 511, 129, 1, 0][i % 5]).collect();
    run_case(&Case { seed: 5, win_lens: &win, extra_lens: &extra, amp_q: 1.5, ..Case::default() })
}

#[test]
fn forced_splits_cover_boundaries() -> Result<()> {
    // 1 ... 8 splits over the same mixed batch: boundaries at multiples of 64 valid rows fall
    // inside the window part, at its end and inside the extra part; many splits are empty.
    for (i, s) in [1usize, 2, 3, 5, 8].into_iter().enumerate() {
        run_case(&Case { seed: 20 + i as u64, holes: 5, amp_q: 3.0, splits: Some(s), ..Case::default() })?;
        run_case(&Case { seed: 30 + i as u64, h: 4, holes: 1, splits: Some(s), ..Case::default() })?;
    }
    Ok(())
}

#[test]
fn seesaw_tile_parities_valid_counts_and_splits() -> Result<()> {
    // The all-heads kernel's tile loop alternates the tiles between its two compute warpgroups
    // (tile j's S and softmax by warpgroup j % 2, P.V halves by both): valid counts 1, 63, 64,
    // 65, 127, 128, 129, 191, 256, 257, 420 give 1 ... 7 tiles per token, so with 1, 2, 3 and 5
    // forced splits and the launcher's choice a split has an odd or even number of tiles, ends
    // on either warpgroup, or has a single tile (warpgroup 1 owns none) or none; H = 4, 64 and
    // 128 (second head block); sharper logits so that the running max moves between tiles.
    let win = [1usize, 63, 64, 65, 127, 128, 0, 0, 64, 128, 100, 3];
    let extra = [0usize, 0, 0, 0, 0, 0, 129, 191, 192, 129, 320, 5];
    let all = SparseAttentionKernel::AllHeads;
    let mut seed = 200;
    for h in [4usize, 64, 128] {
        for splits in [None, Some(1), Some(2), Some(3), Some(5)] {
            run_case(&Case { seed, h, win_lens: &win, extra_lens: &extra, amp_q: 3.0, splits, kernel: all, ..Case::default() })?;
            seed += 1;
        }
    }
    // Prefill-shaped tokens (window = the previous positions, short at the start) with -1 holes.
    let win: Vec<usize> = (0..140).map(|i| (i + 1).min(128)).collect();
    let extra: Vec<usize> = (0..140).map(|i| [512, 448, 65, 0, 200][i % 5]).collect();
    run_case(&Case { seed: 230, h: 4, win_lens: &win, extra_lens: &extra, holes: 7, amp_q: 3.0, kernel: all, ..Case::default() })
}

#[test]
fn per_source_lengths_0_1_127_128_129_512() -> Result<()> {
    let lens = [0usize, 1, 127, 128, 129, 512];
    let win: Vec<usize> = (0..36).map(|i| lens[i % 6]).collect();
    let extra: Vec<usize> = (0..36).map(|i| lens[i / 6]).collect();
    for splits in [None, Some(1), Some(4)] {
        run_case(&Case { seed: 40, win_lens: &win, extra_lens: &extra, kw: 512, splits, ..Case::default() })?;
    }
    Ok(())
}

#[test]
fn two_head_blocks_h128() -> Result<()> {
    run_case(&Case { seed: 50, h: 128, holes: 4, ..Case::default() })?;
    run_case(&Case { seed: 51, h: 100, holes: 4, splits: Some(3), ..Case::default() })
}

#[test]
fn index_limit_4096_per_token() -> Result<()> {
    let (win, extra) = (&[2048usize, 1000, 0][..], &[2048usize, 2048, 5][..]);
    run_case(&Case { seed: 60, h: 4, win_lens: win, extra_lens: extra, kw: 2048, kc: 2048, holes: 30, ..Case::default() })?;
    run_case(&Case { seed: 61, h: 4, win_lens: win, extra_lens: extra, kw: 2048, kc: 2048, splits: Some(8), ..Case::default() })
}

#[test]
fn prefill_batch_one_cta_per_token() -> Result<()> {
    // 264 tokens (two waves of 132 SMs): the launcher picks one split, the prefill
    // configuration. Window = the previous 128 positions of a sequence (short at the start),
    // extra = 512 of the pool (fewer for some tokens). H = 8 keeps the CPU reference quick.
    let win: Vec<usize> = (0..264).map(|i| (i + 1).min(128)).collect();
    let extra: Vec<usize> = (0..264).map(|i| if i % 7 == 3 { 200 } else { 512 }).collect();
    run_case(&Case { seed: 70, h: 8, win_lens: &win, extra_lens: &extra, ..Case::default() })
}

#[test]
fn head_split_kernel_over_the_edge_cases() -> Result<()> {
    // The head-split kernel forced over the cases above: mixed lengths with holes and i32
    // indices, every per-source length pair, sharp logits, partial head blocks (H = 4, 20,
    // 100), two and four head blocks (H = 64, 128), a decode batch, the 4096-index limit and
    // window-only tokens; also forced with num_splits = 1 (allowed) and the all-heads kernel
    // forced without splits (the launcher's split count).
    let hs = SparseAttentionKernel::HeadSplit;
    run_case(&Case { seed: 100, h: 4, kernel: hs, ..Case::default() })?;
    run_case(&Case { seed: 101, holes: 9, i32_indices: true, kernel: hs, ..Case::default() })?;
    run_case(&Case { seed: 102, kw: 130, kc: 520, holes: 3, amp_q: 6.0, kernel: hs, ..Case::default() })?;
    let lens = [0usize, 1, 127, 128, 129, 512];
    let win: Vec<usize> = (0..36).map(|i| lens[i % 6]).collect();
    let extra: Vec<usize> = (0..36).map(|i| lens[i / 6]).collect();
    run_case(&Case { seed: 103, win_lens: &win, extra_lens: &extra, kw: 512, holes: 2, kernel: hs, ..Case::default() })?;
    run_case(&Case { seed: 104, h: 128, holes: 4, kernel: hs, ..Case::default() })?;
    run_case(&Case { seed: 105, h: 100, holes: 4, splits: Some(1), kernel: hs, ..Case::default() })?;
    let (win, extra) = (&[128, 5, 0, 77][..], &[0, 0, 0, 0][..]);
    run_case(&Case { seed: 106, h: 20, win_lens: win, extra_lens: extra, kc: 1, holes: 2, amp_q: 2.0, kernel: hs, ..Case::default() })?;
    let win = [128usize; 33];
    let extra: Vec<usize> = (0..33).map(|i| [512, 511, 129, 1, 0][i % 5]).collect();
    run_case(&Case { seed: 107, win_lens: &win, extra_lens: &extra, amp_q: 1.5, kernel: hs, ..Case::default() })?;
    let (win, extra) = (&[2048usize, 1000, 0][..], &[2048usize, 2048, 5][..]);
    run_case(&Case { seed: 108, h: 4, win_lens: win, extra_lens: extra, kw: 2048, kc: 2048, holes: 30, kernel: hs, ..Case::default() })?;
    run_case(&Case { seed: 109, kernel: SparseAttentionKernel::AllHeads, ..Case::default() })
}

#[test]
fn sink_changes_output_and_matches_lse_identity() -> Result<()> {
    // Negative control and identity: out(sink) = out(no sink) / (1 + e^{sink - lse}).
    let dev = gpu();
    let mut rng = Rng(6);
    let (t, h) = (3, 4);
    let q = random_bf16(&mut rng, &[t, h, D], 1.0)?.to_device(&dev)?;
    let kv = random_bf16(&mut rng, &[200, D], 1.0)?.to_device(&dev)?;
    let iw = Tensor::from_vec(index_rows(&mut rng, &[100, 40, 128], 128, 200, 0), (t, 128), &dev)?;
    let ic = Tensor::from_vec(index_rows(&mut rng, &[64, 0, 10], 64, 200, 0), (t, 64), &dev)?;
    let none = Tensor::full(f32::NEG_INFINITY, h, &dev)?;
    let sink = Tensor::new(&[0.5f32, 1.0, 2.0, 3.0], &dev)?;
    let (o0, lse) = sparse_attention_two_source(&q, &kv, &iw, &kv, &ic, &none, 0.05)?;
    let (o1, lse1) = sparse_attention_two_source(&q, &kv, &iw, &kv, &ic, &sink, 0.05)?;
    ensure!(lse.to_vec2::<f32>()? == lse1.to_vec2::<f32>()?, "lse must not depend on the sink");
    let o0 = o0.to_dtype(DType::F32)?.to_vec3::<f32>()?;
    let o1 = o1.to_dtype(DType::F32)?.to_vec3::<f32>()?;
    let lse = lse.to_vec2::<f32>()?;
    let sinks = [0.5f32, 1.0, 2.0, 3.0];
    let mut differs = false;
    for ti in 0..t {
        for hi in 0..h {
            let f = 1.0 / (1.0 + (sinks[hi] - lse[ti][hi]).exp());
            for d in 0..D {
                let (a, b) = (o1[ti][hi][d], o0[ti][hi][d] * f);
                differs |= a != o0[ti][hi][d];
                ensure!((a - b).abs() <= 1e-2 * b.abs() + 1e-4, "t{ti} h{hi} d{d}: {a} vs {b}");
            }
        }
    }
    ensure!(differs, "the sink had no effect");
    Ok(())
}

#[test]
fn rejects_bad_shapes_and_dtypes() -> Result<()> {
    let dev = gpu();
    let q = Tensor::zeros((2, 4, D), DType::BF16, &dev)?;
    let kv = Tensor::zeros((8, D), DType::BF16, &dev)?;
    let idx = Tensor::zeros((2, 3), DType::I64, &dev)?;
    let sink = Tensor::zeros(4, DType::F32, &dev)?;
    let bad_sink = Tensor::zeros(5, DType::F32, &dev)?;
    let e = sparse_attention_two_source(&q, &kv, &idx, &kv, &idx, &bad_sink, 1.0).unwrap_err().to_string();
    ensure!(e.contains("sink [5]"), "{e}");
    // Built on the host: candle's CUDA backend has no i64 -> i32 cast kernel.
    let idx32 = Tensor::zeros((2, 3), DType::I32, &Device::Cpu)?.to_device(&dev)?;
    let e = sparse_attention_two_source(&q, &kv, &idx, &kv, &idx32, &sink, 1.0).unwrap_err().to_string();
    ensure!(e.contains("both be i64 or both i32"), "{e}");
    let q256 = Tensor::zeros((2, 4, 256), DType::BF16, &dev)?;
    let kv256 = Tensor::zeros((8, 256), DType::BF16, &dev)?;
    let e = sparse_attention_two_source(&q256, &kv256, &idx, &kv256, &idx, &sink, 1.0).unwrap_err().to_string();
    ensure!(e.contains("head_dim 512"), "{e}");
    let bad = SparseAttentionOptions { num_splits: Some(9), ..Default::default() };
    let e = sparse_attention_two_source_with(&q, &kv, &idx, &kv, &idx, &sink, 1.0, bad).unwrap_err().to_string();
    ensure!(e.contains("num_splits"), "{e}");
    for kernel in [SparseAttentionKernel::HeadSplit, SparseAttentionKernel::HeadSplitPingPong, SparseAttentionKernel::DimSplitPair] {
        let bad = SparseAttentionOptions { num_splits: Some(2), kernel };
        let e = sparse_attention_two_source_with(&q, &kv, &idx, &kv, &idx, &sink, 1.0, bad).unwrap_err().to_string();
        ensure!(e.contains(&format!("{kernel:?}")) && e.contains("does not split the rows, got num_splits 2"), "{e}");
    }
    let wide = Tensor::zeros((2, 4094), DType::I64, &dev)?;
    let e = sparse_attention_two_source(&q, &kv, &wide, &kv, &idx, &sink, 1.0).unwrap_err().to_string();
    ensure!(e.contains("4096 indices"), "{e}");
    Ok(())
}

#[test]
fn head_split_pingpong_over_the_edge_cases() -> Result<()> {
    two_consumer_edge_cases(SparseAttentionKernel::HeadSplitPingPong, 120)
}

#[test]
fn dim_split_pair_over_the_edge_cases() -> Result<()> {
    // The same cases for the dims-split pair (2-CTA clusters exchanging partial scores, P tiles
    // and the final factors; its merge slots for 2, 3, 4 and more tiles).
    two_consumer_edge_cases(SparseAttentionKernel::DimSplitPair, 130)
}

/// The kernels with two consumers on alternate tiles (a running-max hand-over, one merge) against
/// the crate reference at the head-split tolerance. Valid rows per token 0, 1, 63, 64, 65, 127,
/// 128, 129, 640 and 192 / 320 / 428 / 513 (3, 5, 7, 9 tiles: the consumer of the last tile
/// alternates; with one tile consumer B has none), window-only and extra-only tokens; H = 64, 4,
/// 40 (a partial head block), 100 (two blocks); no holes (exact counts), holes + i32 indices,
/// sharp logits (the running max moves between the consumers' tiles), a B = 64 decode batch and
/// the 4096-index limit (fewer slots).
fn two_consumer_edge_cases(pp: SparseAttentionKernel, seed: u64) -> Result<()> {
    let win = [0usize, 1, 63, 64, 64, 127, 128, 128, 128, 128, 100, 128, 0, 5, 128, 1];
    let extra = [0usize, 0, 0, 0, 1, 0, 0, 1, 512, 64, 220, 300, 129, 507, 385, 512];
    run_case(&Case { seed, win_lens: &win, extra_lens: &extra, kernel: pp, ..Case::default() })?;
    run_case(&Case { seed: seed + 1, h: 4, win_lens: &win, extra_lens: &extra, holes: 3, i32_indices: true, kernel: pp, ..Case::default() })?;
    run_case(&Case { seed: seed + 2, h: 40, win_lens: &win, extra_lens: &extra, holes: 5, amp_q: 6.0, kernel: pp, ..Case::default() })?;
    run_case(&Case { seed: seed + 3, h: 100, holes: 4, splits: Some(1), kernel: pp, ..Case::default() })?;
    let lens = [0usize, 1, 127, 128, 129, 512];
    let w36: Vec<usize> = (0..36).map(|i| lens[i % 6]).collect();
    let e36: Vec<usize> = (0..36).map(|i| lens[i / 6]).collect();
    run_case(&Case { seed: seed + 4, win_lens: &w36, extra_lens: &e36, kw: 512, holes: 2, amp_q: 3.0, kernel: pp, ..Case::default() })?;
    let w64 = [128usize; 64];
    let e64: Vec<usize> = (0..64).map(|i| [512, 511, 129, 1, 0, 449][i % 6]).collect();
    run_case(&Case { seed: seed + 5, win_lens: &w64, extra_lens: &e64, amp_q: 1.5, kernel: pp, ..Case::default() })?;
    let (win, extra) = (&[2048usize, 1000, 0][..], &[2048usize, 2048, 5][..]);
    run_case(&Case { seed: seed + 6, h: 4, win_lens: win, extra_lens: extra, kw: 2048, kc: 2048, holes: 30, kernel: pp, ..Case::default() })
}

#[test]
fn head_split_pingpong_with_one_tile_is_the_two_stage_result() -> Result<()> {
    // With at most 64 valid rows per token consumer A does the one tile and nothing is merged:
    // the same products, softmax and epilogue as the two-stage loop, so bitwise its outputs and
    // lse (a check of the one-consumer path that does not depend on the tolerance).
    let dev = gpu();
    let mut rng = Rng(127);
    let (t, h, nw, nc) = (40usize, 64usize, 257usize, 1031usize);
    let wl: Vec<usize> = (0..t).map(|i| [0, 1, 17, 33, 64, 63][i % 6]).collect();
    let el: Vec<usize> = wl.iter().enumerate().map(|(i, &w)| (64 - w).min(i % 37)).collect();
    let q = random_bf16(&mut rng, &[t, h, D], 2.0)?.to_device(&dev)?;
    let kvw = random_bf16(&mut rng, &[nw, D], 1.0)?.to_device(&dev)?;
    let kvc = random_bf16(&mut rng, &[nc, D], 1.0)?.to_device(&dev)?;
    let iw = Tensor::from_vec(index_rows(&mut rng, &wl, 128, nw, 0), (t, 128), &dev)?;
    let ic = Tensor::from_vec(index_rows(&mut rng, &el, 512, nc, 0), (t, 512), &dev)?;
    let sink_v: Vec<f32> = (0..h).map(|i| if i % 3 == 1 { f32::NEG_INFINITY } else { 2.0 * rng.normal() }).collect();
    let sink = Tensor::new(sink_v.as_slice(), &dev)?;
    let run = |kernel| -> Result<(Vec<bf16>, Vec<f32>)> {
        poison_allocator(&dev, t, h)?;
        let opts = SparseAttentionOptions { num_splits: None, kernel };
        let (o, l) = sparse_attention_two_source_with(&q, &kvw, &iw, &kvc, &ic, &sink, 0.05, opts)?;
        Ok((o.flatten_all()?.to_vec1::<bf16>()?, l.flatten_all()?.to_vec1::<f32>()?))
    };
    let (o1, l1) = run(SparseAttentionKernel::HeadSplitPingPong)?;
    let (o2, l2) = run(SparseAttentionKernel::HeadSplit)?;
    ensure!(o1.iter().all(|x| x.is_finite()), "non-finite output");
    let diff = o1.iter().zip(&o2).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    ensure!(diff == 0, "{diff} of {} outputs differ between the ping-pong and two-stage loops", o1.len());
    ensure!(l1.iter().zip(&l2).all(|(a, b)| a.to_bits() == b.to_bits()), "lse differs");
    Ok(())
}
