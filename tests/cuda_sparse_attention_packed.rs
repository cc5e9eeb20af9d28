//! GPU tests of the sparse attention over PACKED cache rows (`deepseek_v41::cuda::KvRows::Packed`:
//! 528 B window rows in format A, 288 B compressed rows in format B, spec §7.2), dequantized by
//! `kernels/sparse_attention.cu`'s producer warpgroup (`kernels/include/dsv41_attn_rows.cuh`).
//!
//! The packed codes decode exactly to the fake-quantized bf16 rows the bf16 inserts store, so the
//! kernel over packed rows must be BIT-IDENTICAL to the same kernel over those bf16 rows (same
//! kernel and split count: where the packed side runs Auto — the all-heads kernel whenever a
//! source is packed — the bf16 side forces `AllHeads`, since Auto picks the dims-split pair for
//! all-bf16 decode of few tokens): that is the main assertion, on fresh random rows (never zeros), with −1 holes,
//! lengths 0 / 1 / 127 / 128 / 129 / 512, odd page sizes (indices on the last slot of the last
//! page), mixed sources (one packed, one bf16), H = 4 and 64, forced splits, the head-split
//! kernel forced (and the all-heads kernel forced), block scales spread over 2^-30 .. 2^20
//! (every UE8M0 / e4m3 scale path). The CPU path of `KvRows::Packed` (the
//! crate's unpacking + reference) is checked against the GPU within the bf16 tolerance of
//! `tests/cuda_sparse_attention.rs` (2^-6 of a row's largest magnitude), and bad inputs must
//! give errors naming the source.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_sparse_attention_packed`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::cuda::{KvRows, PackedLayout, SparseAttentionInputs, SparseAttentionKernel, SparseAttentionOptions};
use deepseek_v41::quant::QatFormat;
use half::bf16;

const D: usize = 512;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_sparse_attention_packed.rs needs a CUDA device (none found)")
}

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

/// `[n, D]` f32 rows, normal values; with `spread`, every 16-dim block gets its own factor
/// 2^e, e in -30 ..= 20 (block scales over the whole useful range).
fn random_rows(rng: &mut Rng, n: usize, spread: bool) -> Result<Tensor> {
    let mut v = Vec::with_capacity(n * D);
    for _ in 0..n * D / 16 {
        let f = if spread { 2f32.powi(rng.below(51) as i32 - 30) } else { 1.0 };
        v.extend((0..16).map(|_| f * rng.normal()));
    }
    Ok(Tensor::from_vec(v, (n, D), &Device::Cpu)?)
}

/// `[T, K]` i64: token t has `lens[t]` random valid rows of `0..n` (the last row `n - 1` always
/// among them when len > 1) then −1 padding, `holes` valid slots replaced by −1.
fn index_rows(rng: &mut Rng, lens: &[usize], k: usize, n: usize, holes: usize) -> Result<Tensor> {
    let mut v = vec![-1i64; lens.len() * k];
    for (t, &len) in lens.iter().enumerate() {
        for j in 0..len {
            v[t * k + j] = if j == 1 { n as i64 - 1 } else { rng.below(n) as i64 };
        }
        for _ in 0..holes.min(len) {
            v[t * k + rng.below(len)] = -1;
        }
    }
    Ok(Tensor::from_vec(v, (lens.len(), k), &Device::Cpu)?)
}

/// A source: the packed cache and the bf16 rows it decodes to (both on `dev`).
struct Source {
    packed: Tensor,
    layout: PackedLayout,
    bf16: Tensor,
}

fn source(rng: &mut Rng, n: usize, format: QatFormat, page: usize, spread: bool, dev: &Device) -> Result<Source> {
    let layout = PackedLayout::new(format, D, page)?;
    let rows = random_rows(rng, n, spread)?;
    let packed = layout.pack(&rows)?;
    let slots: Vec<usize> = (0..n).collect();
    let bf16 = layout.unpack(&packed, &slots)?.to_dtype(DType::BF16)?.to_device(dev)?;
    Ok(Source { packed: packed.to_device(dev)?, layout, bf16 })
}

struct Case<'a> {
    seed: u64,
    h: usize,
    win_lens: &'a [usize],
    extra_lens: &'a [usize],
    holes: usize,
    /// Page sizes of the window / extra caches.
    pages: (usize, usize),
    /// Which sources are packed (window, extra); the others are passed as bf16 rows.
    packed: (bool, bool),
    spread: bool,
    splits: Option<usize>,
    kernel: SparseAttentionKernel,
    /// Also compare with the CPU path (slow for large batches).
    cpu: bool,
    /// Rows of the window / extra sources (None: a few pages, the last one part-filled).
    rows: Option<(usize, usize)>,
}

impl Default for Case<'_> {
    fn default() -> Self {
        Case {
            seed: 0,
            h: 64,
            win_lens: &WIN,
            extra_lens: &EXTRA,
            holes: 0,
            pages: (64, 64),
            packed: (true, true),
            spread: false,
            splits: None,
            kernel: SparseAttentionKernel::Auto,
            cpu: true,
            rows: None,
        }
    }
}

const WIN: [usize; 10] = [0, 1, 127, 128, 128, 0, 64, 128, 1, 100];
const EXTRA: [usize; 10] = [0, 0, 1, 129, 512, 127, 128, 512, 300, 0];

fn host(x: &Tensor) -> Result<Vec<u16>> {
    Ok(x.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<bf16>()?.iter().map(|v| v.to_bits()).collect())
}

fn pick(s: &Source, packed: bool) -> KvRows<'_> {
    if packed {
        KvRows::Packed(&s.packed, s.layout)
    } else {
        KvRows::Bf16(&s.bf16)
    }
}

fn run_case(c: &Case) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(c.seed);
    let t = c.win_lens.len();
    let (kw, kc) = (128.max(*c.win_lens.iter().max().unwrap_or(&0)), 512);
    // Source sizes that do not fill their last page.
    let (nw, nc) = c.rows.unwrap_or((c.pages.0 * 3 + 1, c.pages.1 * 9 + 5));
    let win = source(&mut rng, nw, QatFormat::Fp8Ue8m0B32, c.pages.0, c.spread, &dev)?;
    let ext = source(&mut rng, nc, QatFormat::Fp4E4m3B16, c.pages.1, c.spread, &dev)?;
    let q = (random_rows(&mut rng, t * c.h, false)?.reshape((t, c.h, D))?).to_dtype(DType::BF16)?.to_device(&dev)?;
    let iw = index_rows(&mut rng, c.win_lens, kw, nw, c.holes)?.to_device(&dev)?;
    let ic = index_rows(&mut rng, c.extra_lens, kc, nc, c.holes)?.to_device(&dev)?;
    let sink_v: Vec<f32> = (0..c.h).map(|i| if i % 3 == 1 { f32::NEG_INFINITY } else { 2.0 * rng.normal() }).collect();
    let sink = Tensor::new(sink_v.as_slice(), &dev)?;
    let scale = (D as f32).powf(-0.5);
    let opts = SparseAttentionOptions { num_splits: c.splits, kernel: c.kernel };
    // The kernel Auto runs when a source is packed (every case packs at least one).
    let opts_bf16 = match c.kernel {
        SparseAttentionKernel::Auto => SparseAttentionOptions { kernel: SparseAttentionKernel::AllHeads, ..opts },
        _ => opts,
    };
    let attend = |window: KvRows, extra: KvRows, opts: SparseAttentionOptions| {
        SparseAttentionInputs { q: &q, window, idx_window: &iw, extra, idx_extra: &ic, sink: &sink, scale }.forward(opts)
    };
    ensure!(c.packed.0 || c.packed.1, "seed {}: a case packs at least one source", c.seed);
    let (out_p, lse_p) = attend(pick(&win, c.packed.0), pick(&ext, c.packed.1), opts)?;
    let (out_b, lse_b) = attend(KvRows::Bf16(&win.bf16), KvRows::Bf16(&ext.bf16), opts_bf16)?;
    let (op, ob) = (host(&out_p)?, host(&out_b)?);
    if let Some(i) = op.iter().zip(&ob).position(|(a, b)| a != b) {
        anyhow::bail!(
            "seed {}: packed {:?} out[t{} h{} d{}] = {:#06x}, bf16 rows give {:#06x}",
            c.seed,
            c.packed,
            i / D / c.h,
            i / D % c.h,
            i % D,
            op[i],
            ob[i]
        )
    }
    let (lp, lb) = (lse_p.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?, lse_b.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?);
    ensure!(lp.iter().zip(&lb).all(|(a, b)| a.to_bits() == b.to_bits()), "seed {}: lse differs packed vs bf16", c.seed);
    ensure!(op.iter().all(|&u| bf16::from_bits(u).is_finite()), "seed {}: a non-finite output (unwritten?)", c.seed);

    if !c.cpu {
        eprintln!("seed {} packed {:?} pages {:?} splits {:?} {:?}: {} outputs bit-identical to bf16 rows", c.seed, c.packed, c.pages, c.splits, c.kernel, op.len());
        return Ok(());
    }
    // The CPU path of the packed sources (unpack + reference) against the GPU, bf16 tolerance.
    let cpu = |x: &Tensor| x.to_device(&Device::Cpu);
    let (qc, iwc, icc, sc) = (cpu(&q)?, cpu(&iw)?, cpu(&ic)?, cpu(&sink)?);
    let (wp, ep) = (cpu(&win.packed)?, cpu(&ext.packed)?);
    let (out_c, _) = SparseAttentionInputs {
        q: &qc,
        window: KvRows::Packed(&wp, win.layout),
        idx_window: &iwc,
        extra: KvRows::Packed(&ep, ext.layout),
        idx_extra: &icc,
        sink: &sc,
        scale,
    }
    .forward(opts)?;
    let oc = out_c.flatten_all()?.to_vec1::<bf16>()?;
    for (i, (&a, &b)) in op.iter().zip(&oc).enumerate() {
        let row = &oc[i / D * D..][..D];
        let amax = row.iter().map(|x| x.to_f32().abs()).fold(0f32, f32::max);
        let a = bf16::from_bits(a).to_f32();
        ensure!(
            (a - b.to_f32()).abs() <= amax * 2f32.powi(-6),
            "seed {}: out[t{} h{} d{}] gpu {a} cpu {b} (row amax {amax})",
            c.seed,
            i / D / c.h,
            i / D % c.h,
            i % D
        );
    }
    eprintln!("seed {} packed {:?} pages {:?} splits {:?} {:?}: {} outputs bit-identical to bf16 rows", c.seed, c.packed, c.pages, c.splits, c.kernel, op.len());
    Ok(())
}

#[test]
fn packed_window_and_compressed_rows_equal_their_bf16_rows() -> Result<()> {
    run_case(&Case { seed: 1, h: 4, ..Case::default() })?;
    run_case(&Case { seed: 2, holes: 7, pages: (7, 13), ..Case::default() })
}

#[test]
fn one_packed_source_next_to_bf16_rows() -> Result<()> {
    run_case(&Case { seed: 3, packed: (true, false), pages: (1, 64), ..Case::default() })?;
    run_case(&Case { seed: 4, packed: (false, true), pages: (64, 3), holes: 3, ..Case::default() })
}

#[test]
fn block_scales_over_the_whole_range() -> Result<()> {
    run_case(&Case { seed: 5, spread: true, pages: (5, 11), ..Case::default() })?;
    run_case(&Case { seed: 6, h: 4, spread: true, splits: Some(1), ..Case::default() })
}

#[test]
fn lengths_and_forced_splits() -> Result<()> {
    let lens = [0usize, 1, 127, 128, 129, 512];
    let win: Vec<usize> = (0..36).map(|i| lens[i % 6].min(128)).collect();
    let extra: Vec<usize> = (0..36).map(|i| lens[i / 6]).collect();
    for (i, splits) in [Some(1), Some(2), Some(3), Some(5)].into_iter().enumerate() {
        run_case(&Case { seed: 10 + i as u64, win_lens: &win, extra_lens: &extra, holes: 2, pages: (16, 33), splits, ..Case::default() })?;
    }
    Ok(())
}

#[test]
fn both_kernels_forced() -> Result<()> {
    let lens = [0usize, 1, 127, 128, 129, 512];
    let win: Vec<usize> = (0..36).map(|i| lens[i % 6].min(128)).collect();
    let extra: Vec<usize> = (0..36).map(|i| lens[i / 6]).collect();
    let hs = SparseAttentionKernel::HeadSplit;
    run_case(&Case { seed: 20, win_lens: &win, extra_lens: &extra, holes: 2, pages: (16, 33), kernel: hs, ..Case::default() })?;
    run_case(&Case { seed: 21, h: 4, spread: true, pages: (5, 11), kernel: hs, ..Case::default() })?;
    run_case(&Case { seed: 22, packed: (false, true), pages: (64, 3), holes: 3, kernel: hs, ..Case::default() })?;
    run_case(&Case { seed: 23, holes: 7, pages: (7, 13), kernel: SparseAttentionKernel::AllHeads, ..Case::default() })
}

#[test]
fn a_full_gpu_of_decode_tokens() -> Result<()> {
    // 256 tokens of 128 window + 512 extra rows: every SM busy, copies slow to land (a run at
    // this load found the producer expanding rows whose copies had not landed only at such loads).
    let (win, extra) = ([128usize; 256], [512usize; 256]);
    for (splits, kernel) in [(None, SparseAttentionKernel::Auto), (Some(2), SparseAttentionKernel::Auto), (None, SparseAttentionKernel::HeadSplit)] {
        let rows = Some((256 * 128, 1 << 17));
        run_case(&Case { seed: 70, win_lens: &win, extra_lens: &extra, splits, kernel, cpu: false, rows, ..Case::default() })?;
    }
    Ok(())
}

#[test]
fn bad_packed_sources_are_errors_naming_them() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(9);
    let q = random_rows(&mut rng, 4, false)?.reshape((1, 4, D))?.to_dtype(DType::BF16)?.to_device(&dev)?;
    let idx = Tensor::new(&[[0i64, 1]], &dev)?;
    let sink = Tensor::new(&[0f32; 4], &dev)?;
    let rows = Tensor::zeros((2, D), DType::BF16, &dev)?;
    let index_keys = PackedLayout::new(QatFormat::Fp4Ue8m0B32, D, 4)?;
    let cache = index_keys.zeros(1, &dev)?;
    let attend = |window| {
        SparseAttentionInputs { q: &q, window, idx_window: &idx, extra: KvRows::Bf16(&rows), idx_extra: &idx, sink: &sink, scale: 1.0 }
            .forward(SparseAttentionOptions::default())
    };
    let err = attend(KvRows::Packed(&cache, index_keys)).unwrap_err().to_string();
    ensure!(err.contains("window") && err.contains("format A"), "{err}");
    let a = PackedLayout::new(QatFormat::Fp8Ue8m0B32, D, 4)?;
    let wrong = Tensor::zeros((1, a.page_bytes() - 16), DType::U8, &dev)?;
    let err = attend(KvRows::Packed(&wrong, a)).unwrap_err().to_string();
    ensure!(err.contains("window") && err.contains(&a.page_bytes().to_string()), "{err}");
    Ok(())
}
