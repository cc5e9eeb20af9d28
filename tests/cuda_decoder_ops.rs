//! GPU tests of the decoder's small-op kernels, `kernels/decoder_ops.cu` (RMSNorm, the mHC mixes'
//! rsqrt factor, the mHC collapse and post, the Engram gate, the MoE's f32 accumulation),
//! `kernels/mhc_mixes.cu` (one sublayer's mHC coefficients in one launch), `kernels/mhc_norm.cu`
//! (a collapse and its norm, after a post), the indexer's head-weight
//! rounding (`scale_round_device`) and
//! `kernels/swiglu.cu` (the MoE experts' clamped SwiGLU), `kernels/compress_pool.cu` (the
//! ratio-2 compressor's pooling and carry of the batched decode step) and `kernels/page_rows.cu`
//! (its top-k entries mapped to page-pool rows):
//! every output bit for bit equal to the Candle op sequence each kernel replaces, run on the same
//! GPU (`cuda::with_plain_candle`), and close to the CPU reference; fresh random rows of many
//! widths (below, at and above candle's 32-element small reduction, around its float4 and
//! 1024-thread boundaries), bf16 and f32, outputs allocated over NaN-poisoned memory, and the
//! shape errors.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_decoder_ops`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use deepseek_v41::attention::{compress_pool_ref, page_rows_ref};
use deepseek_v41::cuda::{
    accumulate_device, collapse_device, collapse_norm_device, mhc_norm_supported, mhc_post_norm_device, MHC_NORM_MAX_D, compress_pool_device, mhc_mixes_device, mhc_mixes_supported, mhc_post_device, page_rows_device, rms_norm_device, rms_scale_device,
    scale_round_device, split_sinkhorn_device, swiglu_device, with_plain_candle,
};
use deepseek_v41::model::{collapse, collapse_norm, engram_mix, post, post_collapse_norm, split_sinkhorn, Expert};
use deepseek_v41::nn::{RandomWeights, RmsNorm};
use deepseek_v41::Numerics;

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

#[path = "support/warp_sum.rs"]
mod warp_sum;
use warp_sum::xor_butterfly;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_decoder_ops.rs needs a CUDA device (none found): these tests must run on a GPU")
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// Frees `n` f32 of NaN on `dev` so the next allocations of the stream-ordered pool are likely to
/// reuse poisoned memory (an element a kernel forgets to write then shows up as NaN).
fn poison(dev: &Device, n: usize) -> Result<()> {
    drop(Tensor::full(f32::NAN, n.max(1), dev)?);
    Ok(())
}

/// `rows × n` random values, each row with its own magnitude (2^-12 … 2^12), a few exact zeros
/// and negative zeros; row 1 (when there is one) all zero.
fn rows(rng: &mut Rng, rows: usize, n: usize) -> Vec<f32> {
    (0..rows * n)
        .map(|i| {
            let r = i / n;
            if r == 1 {
                return 0.0;
            }
            let scale = 2f32.powi((r * 7 % 25) as i32 - 12);
            match rng.below(40) {
                0 => 0.0,
                1 => -0.0,
                _ => rng.normal() * scale,
            }
        })
        .collect()
}

fn differing(a: &Tensor, b: &Tensor) -> Result<usize> {
    let (a, b) = (bits(a)?, bits(b)?);
    ensure!(a.len() == b.len(), "lengths {} vs {}", a.len(), b.len());
    Ok(a.iter().zip(&b).filter(|(x, y)| x != y).count())
}

/// Max |x| over the elements of `x` (f32).
fn max_abs(x: &Tensor) -> Result<f32> {
    Ok(x.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// Max |a − b| / max(|b|, 1e-30) over the elements (both moved to the CPU as f32).
fn max_rel(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = (a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?, b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?);
    let (a, b) = (a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
    Ok(a.iter().zip(&b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-30)).fold(0.0, f32::max))
}

#[test]
fn rms_norm_kernel_equals_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let cpu = Device::Cpu;
    let mut rng = Rng(0x7a11);
    let widths = [1usize, 5, 31, 32, 33, 64, 100, 128, 192, 257, 768, 1023, 1024, 1030, 3001];
    for (case, &n) in widths.iter().enumerate() {
        let t = [1usize, 3, 50][case % 3];
        for dtype in [DType::BF16, DType::F32] {
            for eps in [1e-20, 1e-6] {
                let x = Tensor::from_vec(rows(&mut rng, t, n), (t, n), &dev)?.to_dtype(dtype)?;
                let w: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
                let norm = RmsNorm::from_weight(Tensor::from_vec(w, n, &dev)?, eps)?;
                poison(&dev, t * n)?;
                let kernel = norm.forward(&x)?;
                let ops = with_plain_candle(|| norm.forward(&x))?;
                ensure!(kernel.dims() == x.dims() && kernel.dtype() == dtype, "n {n}: {:?} {:?}", kernel.shape(), kernel.dtype());
                let d = differing(&kernel, &ops)?;
                ensure!(d == 0, "n {n}, T {t}, {dtype:?}, eps {eps}: {d} of {} values differ from the Candle ops", t * n);
                ensure!(bits(&kernel)?.iter().all(|&b| !f32::from_bits(b).is_nan()), "n {n}: NaN in the output");
                // The CPU reference sums in another order: equal up to rounding.
                let host = RmsNorm::from_weight(norm.weight().to_device(&cpu)?, eps)?.forward(&x.to_device(&cpu)?)?;
                let tol = if dtype == DType::BF16 { 8e-3 } else { 1e-5 };
                let r = max_rel(&kernel, &host)?;
                ensure!(r <= tol, "n {n}, {dtype:?}: relative difference {r} from the CPU reference");
            }
        }
    }
    // Rank 3 and a non-contiguous input (a transposed view) take the same path.
    let x = Tensor::from_vec(rows(&mut rng, 6 * 40, 64), (64, 6, 40), &dev)?.to_dtype(DType::BF16)?.transpose(0, 2)?;
    let norm = RmsNorm::from_weight(Tensor::from_vec((0..64).map(|_| rng.normal()).collect::<Vec<f32>>(), 64, &dev)?, 1e-6)?;
    let (kernel, ops) = (norm.forward(&x)?, with_plain_candle(|| norm.forward(&x))?);
    ensure!(kernel.dims() == [40, 6, 64] && differing(&kernel, &ops)? == 0, "rank-3 strided input differs");
    // Negative control: eps matters for a tiny row, and the weight is applied.
    let tiny = Tensor::from_vec(vec![1e-12f32; 64], (1, 64), &dev)?;
    let a = rms_norm_device(&tiny, norm.weight(), 1e-20)?;
    let b = rms_norm_device(&tiny, norm.weight(), 1e-6)?;
    ensure!(differing(&a, &b)? > 0, "eps is ignored");
    let ones = rms_norm_device(&tiny, &Tensor::ones(64, DType::F32, &dev)?, 1e-20)?;
    ensure!(differing(&a, &ones)? > 0, "the weight is ignored");
    // Errors: weight shape, CPU input, empty rows.
    ensure!(rms_norm_device(&tiny, &Tensor::ones(63, DType::F32, &dev)?, 1e-6).is_err(), "wrong weight shape accepted");
    ensure!(rms_norm_device(&tiny.to_device(&cpu)?, &Tensor::ones(64, DType::F32, &cpu)?, 1e-6).is_err(), "CPU input accepted");
    let empty = rms_norm_device(&Tensor::zeros((0, 64), DType::BF16, &dev)?, norm.weight(), 1e-6)?;
    ensure!(empty.dims() == [0, 64], "empty input: {:?}", empty.shape());
    Ok(())
}

#[test]
fn mhc_scale_kernel_equals_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x5ca1e);
    for (n, t) in [(768usize, 1usize), (768, 37), (20, 4), (33, 2), (4096, 3), (1, 5), (1500, 9)] {
        for dtype in [DType::BF16, DType::F32] {
            for eps in [1e-20, 1e-6] {
                let x = Tensor::from_vec(rows(&mut rng, t, n), (t, n), &dev)?.to_dtype(dtype)?;
                poison(&dev, 2 * t * n)?;
                let (xf, scale) = rms_scale_device(&x, eps)?;
                let (of, os) = with_plain_candle(|| -> candle_core::Result<(Tensor, Tensor)> {
                    let xf = x.to_dtype(DType::F32)?;
                    let s = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
                    Ok((xf, s))
                })?;
                ensure!(xf.dims() == [t, n] && scale.dims() == [t, 1], "shapes {:?} {:?}", xf.shape(), scale.shape());
                ensure!(differing(&xf, &of)? == 0, "n {n}, {dtype:?}: f32 copy differs");
                let d = differing(&scale, &os)?;
                ensure!(d == 0, "n {n}, T {t}, {dtype:?}, eps {eps}: {d} of {t} scales differ from the Candle ops");
            }
        }
    }
    Ok(())
}

/// The raw mixes of one token row `x` `[n]` as `kernels/mhc_mixes.cu` sums them: CTA split `s` of
/// `splits` takes `k` in `[s·chunk, (s+1)·chunk)`, thread `i` an FMA chain over `k ≡ i (mod 256)`,
/// an xor butterfly over the 32 lanes, the 8 warps in order, the splits in order; then
/// `dot · 1/sqrt(Σx²/n + norm_eps)`.
fn kernel_order_mixes(x: &[f32], func: &[f32], width: usize, splits: usize, norm_eps: f32) -> Vec<f32> {
    let n = x.len();
    let chunk = n.div_ceil(splits);
    let sum_of = |value: &dyn Fn(usize) -> f32| -> f32 {
        let mut total = 0.0f32;
        for s in 0..splits {
            let (k0, k1) = ((s * chunk).min(n), ((s + 1) * chunk).min(n));
            let mut warps = [0.0f32; 8];
            for (w, warp) in warps.iter_mut().enumerate() {
                let mut lanes = [0.0f32; 32];
                for (l, lane) in lanes.iter_mut().enumerate() {
                    let mut k = k0 + w * 32 + l;
                    while k < k1 {
                        *lane = x[k].mul_add(value(k), *lane);
                        k += 256;
                    }
                }
                *warp = xor_butterfly(lanes);
            }
            let cta = warps[1..].iter().fold(warps[0], |a, b| a + b);
            total = if s == 0 { cta } else { total + cta };
        }
        total
    };
    let ss = sum_of(&|k| x[k]);
    let rs = 1.0 / ((ss / n as f32) + norm_eps).sqrt();
    (0..width).map(|w| sum_of(&|k| func[w * n + k]) * rs).collect()
}

#[test]
fn mhc_mixes_kernel_equals_its_order_and_the_reference() -> Result<()> {
    let dev = gpu();
    let cpu = Device::Cpu;
    let mut rng = Rng(0x313c);
    let (iters, eps, norm_eps) = (20usize, 1e-6f64, 1e-6f64);
    // (T, hc, d): the embedded model's hc·d = 768 at decode and prefill sizes, a T = 1 tile, V4.1-Flash's
    // 16384 (a cluster of 8 CTAs), 4096 (2), hc 1..3, a row shorter than a warp.
    for (t, hc, d) in [(1usize, 4usize, 192usize), (5, 4, 192), (64, 4, 192), (3, 4, 4096), (2, 4, 1024), (2, 1, 7), (7, 2, 33), (4, 3, 100)] {
        let (n, width) = (hc * d, (2 + hc) * hc);
        let splits = n.div_ceil(2048).clamp(1, 8);
        for dtype in [DType::BF16, DType::F32] {
            let x = Tensor::from_vec(rows(&mut rng, t, n), (t, n), &dev)?.to_dtype(dtype)?;
            let func_v: Vec<f32> = (0..width * n).map(|_| rng.normal() * 0.05).collect();
            let func = Tensor::from_vec(func_v.clone(), (width, n), &dev)?;
            let scale = Tensor::from_vec(vec![0.7f32 + rng.uniform(), 0.5 + rng.uniform(), 1.0 + rng.uniform()], 3, &dev)?;
            let base = Tensor::from_vec((0..width).map(|_| rng.normal() * 0.5).collect::<Vec<f32>>(), width, &dev)?;
            ensure!(mhc_mixes_supported(&x, hc), "T {t}, hc {hc}, n {n}: not supported");
            poison(&dev, 4 * t * (2 * hc + hc * hc))?;
            let (pre, post_c, comb) = mhc_mixes_device(&x, &func, &scale, &base, hc, iters, eps, norm_eps, None)?;
            ensure!(pre.dims() == [t, hc] && post_c.dims() == [t, hc] && comb.dims() == [t, hc, hc], "shapes");

            // 1. Bit for bit: the kernel's summation order on the host, then the split kernel.
            let xh = x.to_device(&cpu)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let mixes: Vec<f32> = xh.iter().flat_map(|row| kernel_order_mixes(row, &func_v, width, splits, norm_eps as f32)).collect();
            let mixes = Tensor::from_vec(mixes, (t, width), &dev)?;
            let (p2, q2, c2) = split_sinkhorn_device(&mixes, &scale, &base, hc, iters, eps)?;
            for (name, a, b) in [("pre", &pre, &p2), ("post", &post_c, &q2), ("comb", &comb, &c2)] {
                let nd = differing(a, b)?;
                ensure!(nd == 0, "T {t}, hc {hc}, d {d}, {dtype:?}: {nd} {name} values differ from the kernel order + split");
            }

            // 2. Close to the CPU reference (its own product order).
            let xf = x.to_device(&cpu)?.to_dtype(DType::F32)?;
            let rsqrt = (xf.sqr()?.mean_keepdim(D::Minus1)? + norm_eps)?.sqrt()?.recip()?;
            let raw = xf.matmul(&func.to_device(&cpu)?.t()?)?.broadcast_mul(&rsqrt)?;
            let r = split_sinkhorn(&raw, &scale.to_device(&cpu)?, &base.to_device(&cpu)?, hc, iters, eps)?;
            for (name, a, b) in [("pre", &pre, &r.pre), ("post", &post_c, &r.post), ("comb", &comb, &r.comb)] {
                let diff = max_abs(&(a.to_device(&cpu)? - b)?)?;
                ensure!(diff <= 2e-4, "T {t}, hc {hc}, d {d}, {dtype:?}: {name} off the CPU reference by {diff}");
            }

            // 3. A token alone gives the bits it gets in the batch (tile of 1 vs 4).
            if t > 2 {
                let (p1, q1, c1) = mhc_mixes_device(&x.narrow(0, 2, 1)?, &func, &scale, &base, hc, iters, eps, norm_eps, None)?;
                for (name, a, b) in [("pre", &p1, &pre), ("post", &q1, &post_c), ("comb", &c1, &comb)] {
                    let nd = differing(a, &b.narrow(0, 2, 1)?)?;
                    ensure!(nd == 0, "T {t}, hc {hc}, d {d}: token 2 alone differs in {nd} {name} values");
                }
            }
        }
    }
    // Forced splits agree with the kernel order for that split count.
    let (t, hc, d) = (3usize, 4usize, 192usize);
    let (n, width) = (hc * d, (2 + hc) * hc);
    let x = Tensor::from_vec(rows(&mut rng, t, n), (t, n), &dev)?.to_dtype(DType::BF16)?;
    let func_v: Vec<f32> = (0..width * n).map(|_| rng.normal() * 0.05).collect();
    let func = Tensor::from_vec(func_v.clone(), (width, n), &dev)?;
    let scale = Tensor::from_vec(vec![1.0f32, 1.0, 1.0], 3, &dev)?;
    let base = Tensor::from_vec((0..width).map(|_| rng.normal()).collect::<Vec<f32>>(), width, &dev)?;
    let xh = x.to_device(&cpu)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    for splits in [2usize, 3, 8] {
        let (_, _, comb) = mhc_mixes_device(&x, &func, &scale, &base, hc, iters, eps, norm_eps, Some(splits))?;
        let mixes: Vec<f32> = xh.iter().flat_map(|row| kernel_order_mixes(row, &func_v, width, splits, norm_eps as f32)).collect();
        let (_, _, c2) = split_sinkhorn_device(&Tensor::from_vec(mixes, (t, width), &dev)?, &scale, &base, hc, iters, eps)?;
        let nd = differing(&comb, &c2)?;
        ensure!(nd == 0, "splits {splits}: {nd} comb values differ from the kernel order");
    }
    // Errors, not panics.
    ensure!(mhc_mixes_device(&x, &func, &scale, &base, 5, iters, eps, norm_eps, None).is_err(), "hc 5 accepted");
    ensure!(mhc_mixes_device(&x, &func.narrow(0, 0, 20)?, &scale, &base, hc, iters, eps, norm_eps, None).is_err(), "short fn accepted");
    ensure!(mhc_mixes_device(&x, &func, &scale, &base, hc, 0, eps, norm_eps, None).is_err(), "0 iterations accepted");
    ensure!(mhc_mixes_device(&x, &func, &scale, &base, hc, iters, eps, norm_eps, Some(9)).is_err(), "9 splits accepted");
    ensure!(!mhc_mixes_supported(&x.to_device(&cpu)?, hc), "a CPU tensor is supported");
    let (p0, _, c0) = mhc_mixes_device(&x.narrow(0, 0, 0)?, &func, &scale, &base, hc, iters, eps, norm_eps, None)?;
    ensure!(p0.dims() == [0, hc] && c0.dims() == [0, hc, hc], "empty shapes {:?} {:?}", p0.shape(), c0.shape());
    Ok(())
}

#[test]
fn scale_round_kernel_equals_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x5c41);
    for (t, h) in [(1usize, 4usize), (3, 64), (257, 9), (1, 1)] {
        for dtype in [DType::BF16, DType::F32] {
            for mul in [0.0078125f64 * 0.125, 1.0 / (128f64 * 64f64).sqrt(), 3.3] {
                let v = Tensor::from_vec(rows(&mut rng, t, h), (t, h), &dev)?.to_dtype(dtype)?;
                poison(&dev, t * h)?;
                let kernel = scale_round_device(&v, mul)?;
                let ops = with_plain_candle(|| (v.to_dtype(DType::F32)? * mul)?.to_dtype(DType::BF16)?.to_dtype(DType::F32))?;
                ensure!(kernel.dims() == [t, h] && kernel.dtype() == DType::F32, "{:?} {:?}", kernel.shape(), kernel.dtype());
                let n = differing(&kernel, &ops)?;
                ensure!(n == 0, "[{t}, {h}] {dtype:?} × {mul}: {n} values differ from the Candle ops");
            }
        }
    }
    ensure!(scale_round_device(&Tensor::ones(3, DType::U32, &dev)?, 1.0).is_err(), "u32 accepted");
    Ok(())
}

#[test]
fn collapse_and_post_kernels_equal_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let cpu = Device::Cpu;
    let mut rng = Rng(0xc011);
    for (t, hc, d) in [(1usize, 4usize, 192usize), (5, 4, 192), (64, 4, 333), (3, 1, 7), (2, 7, 65), (9, 32, 100), (1, 4, 1)] {
        for dtype in [DType::BF16, DType::F32] {
            let x = Tensor::from_vec(rows(&mut rng, t * hc, d), (t, hc, d), &dev)?.to_dtype(dtype)?;
            let pre = Tensor::from_vec((0..t * hc).map(|_| rng.normal()).collect::<Vec<f32>>(), (t, hc), &dev)?;
            poison(&dev, t * d)?;
            let kernel = collapse(&x, &pre)?;
            let ops = with_plain_candle(|| collapse(&x, &pre))?;
            ensure!(kernel.dims() == [t, d] && kernel.dtype() == dtype, "{:?} {:?}", kernel.shape(), kernel.dtype());
            let n = differing(&kernel, &ops)?;
            ensure!(n == 0, "T {t}, hc {hc}, d {d}, {dtype:?}: {n} of {} values differ from the Candle ops", t * d);
            let host = collapse(&x.to_device(&cpu)?, &pre.to_device(&cpu)?)?;
            let (diff, scale) = (max_abs(&(kernel.to_device(&cpu)?.to_dtype(DType::F32)? - host.to_dtype(DType::F32)?)?)?, max_abs(&host.to_dtype(DType::F32)?)?);
            let tol = if dtype == DType::BF16 { 8e-3 } else { 1e-5 };
            ensure!(diff <= tol * scale, "T {t}, hc {hc}: differs from the CPU reference by {diff} (scale {scale})");
        }
    }
    // The post with its comb product: bit for bit the CPU reference at every width of two or
    // more columns (one FMA chain over the copies; for a single column the CPU's gemm takes
    // another summation order: within 1e-6 relative there), and the plain Candle ops on the GPU
    // at the released widths (where cuBLAS sums K in that order; at small widths it sums in pairs).
    // Every shape is checked before the test fails, so one run reports them all.
    let mut post_failures = Vec::new();
    for (t, hc, d) in [(1usize, 4usize, 192usize), (6, 4, 50), (2, 3, 1), (3, 4, 2), (1, 4, 5120), (64, 4, 5120), (256, 4, 5120), (1024, 4, 4096), (7, 8, 640)] {
        for (xdt, ydt) in [(DType::BF16, DType::BF16), (DType::F32, DType::BF16), (DType::BF16, DType::F32), (DType::F32, DType::F32)] {
            let x = Tensor::from_vec(rows(&mut rng, t * hc, d), (t, hc, d), &dev)?.to_dtype(xdt)?;
            let y = Tensor::from_vec(rows(&mut rng, t, d), (t, d), &dev)?.to_dtype(ydt)?;
            let p = Tensor::from_vec((0..t * hc).map(|_| rng.normal()).collect::<Vec<f32>>(), (t, hc), &dev)?;
            let comb = Tensor::from_vec((0..t * hc * hc).map(|_| rng.uniform()).collect::<Vec<f32>>(), (t, hc, hc), &dev)?;
            poison(&dev, t * hc * d)?;
            let kernel = post(&y, &x, &p, &comb)?;
            ensure!(kernel.dims() == [t, hc, d] && kernel.dtype() == xdt, "post {:?} {:?}", kernel.shape(), kernel.dtype());
            let host = post(&y.to_device(&cpu)?, &x.to_device(&cpu)?, &p.to_device(&cpu)?, &comb.to_device(&cpu)?)?;
            let n = differing(&kernel.to_device(&cpu)?, &host)?;
            if d == 1 {
                let rel = max_rel(&kernel, &host)?;
                if rel > 1e-6 && !(xdt == DType::BF16 && rel <= 8e-3) {
                    post_failures.push(format!("T {t}, hc {hc}, d 1, x {xdt:?}, y {ydt:?}: relative {rel} from the CPU reference"));
                }
            } else if n != 0 {
                post_failures.push(format!("T {t}, hc {hc}, d {d}, x {xdt:?}, y {ydt:?}: {n} values differ from the CPU reference"));
            }
            if d >= 4096 {
                let ops = with_plain_candle(|| post(&y, &x, &p, &comb))?;
                let n = differing(&kernel, &ops)?;
                if n != 0 {
                    post_failures.push(format!("T {t}, hc {hc}, d {d}, x {xdt:?}, y {ydt:?}: {n} values differ from the Candle ops"));
                }
            }
        }
    }
    ensure!(post_failures.is_empty(), "post:\n{}", post_failures.join("\n"));
    // Negative control: another pre changes the output; errors on hc > 32 and a wrong pre.
    let x = Tensor::from_vec(rows(&mut rng, 8, 16), (2, 4, 16), &dev)?.to_dtype(DType::BF16)?;
    let pre = Tensor::from_vec((0..8).map(|_| rng.normal()).collect::<Vec<f32>>(), (2, 4), &dev)?;
    ensure!(differing(&collapse_device(&x, &pre)?, &collapse_device(&x, &(pre.clone() * 2.0)?)?)? > 0, "pre is ignored");
    ensure!(collapse_device(&x, &pre.narrow(1, 0, 3)?).is_err(), "wrong pre shape accepted");
    let wide = Tensor::zeros((1, 33, 8), DType::BF16, &dev)?;
    ensure!(collapse_device(&wide, &Tensor::zeros((1, 33), DType::F32, &dev)?).is_err(), "hc 33 accepted");
    // The post's comb is used, and a comb of the wrong shape is an error.
    let y = Tensor::from_vec(rows(&mut rng, 2, 16), (2, 16), &dev)?.to_dtype(DType::BF16)?;
    let comb = Tensor::from_vec((0..32).map(|_| rng.uniform()).collect::<Vec<f32>>(), (2, 4, 4), &dev)?;
    let post_of = |c: &Tensor| mhc_post_device(&x, c, &y, &pre, DType::BF16);
    ensure!(differing(&post_of(&comb)?, &post_of(&comb.transpose(1, 2)?)?)? > 0, "comb is ignored or its axes swapped");
    ensure!(post_of(&comb.narrow(2, 0, 3)?).is_err(), "wrong comb shape accepted");
    Ok(())
}

/// The SwiGLU op sequence of `model::Expert` in plain Candle ops (the kernel's definition).
/// The fused collapse + norm (and post + collapse + norm) kernels of `kernels/mhc_norm.cu`, bit
/// for bit the separate kernels they replace (each itself bit for bit the Candle ops: the tests
/// above), over widths around candle's reduction boundaries and its shared-memory limit, both
/// dtypes, hc 1..32; outputs over NaN-poisoned memory; the errors.
#[test]
fn mhc_norm_kernels_equal_the_separate_kernels() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x90e1);
    let mut failures = Vec::new();
    let shapes = [(1usize, 4usize, 192usize), (5, 4, 31), (3, 4, 32), (2, 4, 33), (64, 4, 333), (3, 1, 7), (2, 7, 1030), (9, 32, 100), (1, 4, 1), (2, 4, 4096), (1, 4, 5120), (1, 4, 8192)];
    for (t, hc, d) in shapes {
        for (xdt, ydt) in [(DType::BF16, DType::BF16), (DType::F32, DType::BF16), (DType::BF16, DType::F32), (DType::F32, DType::F32)] {
            let x = Tensor::from_vec(rows(&mut rng, t * hc, d), (t, hc, d), &dev)?.to_dtype(xdt)?;
            let y = Tensor::from_vec(rows(&mut rng, t, d), (t, d), &dev)?.to_dtype(ydt)?;
            let pw = Tensor::from_vec((0..t * hc).map(|_| rng.normal()).collect::<Vec<f32>>(), (t, hc), &dev)?;
            let pre = Tensor::from_vec((0..t * hc).map(|_| rng.normal()).collect::<Vec<f32>>(), (t, hc), &dev)?;
            let comb = Tensor::from_vec((0..t * hc * hc).map(|_| rng.uniform()).collect::<Vec<f32>>(), (t, hc, hc), &dev)?;
            let eps = [1e-20, 1e-6][d % 2];
            let norm = RmsNorm::from_weight(Tensor::from_vec((0..d).map(|_| rng.normal()).collect::<Vec<f32>>(), d, &dev)?, eps)?;
            let case = format!("T {t}, hc {hc}, d {d}, x {xdt:?}, y {ydt:?}");
            // collapse + norm
            poison(&dev, t * d)?;
            let fused = collapse_norm_device(&x, &pre, norm.weight(), eps)?;
            let separate = rms_norm_device(&collapse_device(&x, &pre)?, norm.weight(), eps)?;
            ensure!(fused.dims() == [t, d] && fused.dtype() == xdt, "{case}: collapse_norm {:?} {:?}", fused.shape(), fused.dtype());
            let n = differing(&fused, &separate)?;
            if n != 0 {
                failures.push(format!("{case}: collapse_norm: {n} of {} values differ", t * d));
            }
            // post + collapse + norm
            poison(&dev, t * hc * d + t * d)?;
            let (x1, h) = mhc_post_norm_device(&x, &comb, &y, &pw, &pre, norm.weight(), eps)?;
            let x1_sep = mhc_post_device(&x, &comb, &y, &pw, xdt)?;
            let h_sep = rms_norm_device(&collapse_device(&x1_sep, &pre)?, norm.weight(), eps)?;
            ensure!(x1.dims() == [t, hc, d] && x1.dtype() == xdt && h.dims() == [t, d] && h.dtype() == xdt, "{case}: post_norm shapes");
            let (n1, n2) = (differing(&x1, &x1_sep)?, differing(&h, &h_sep)?);
            if n1 + n2 != 0 {
                failures.push(format!("{case}: post_norm: {n1} stream and {n2} normed values differ"));
            }
            for (what, v) in [("collapse_norm", &fused), ("post_norm stream", &x1), ("post_norm normed", &h)] {
                if bits(v)?.iter().any(|&b| f32::from_bits(b).is_nan()) {
                    failures.push(format!("{case}: NaN in the {what} output"));
                }
            }
            // The model-level helpers take the fused path and agree with the composed ops.
            if t == 2 && xdt == DType::BF16 && ydt == DType::BF16 {
                let (mx1, mh) = post_collapse_norm(&y, &x, &pw, &comb, &pre, &norm)?;
                let composed = with_plain_candle(|| -> candle_core::Result<_> {
                    let x1 = post(&y, &x, &pw, &comb)?;
                    let h = norm.forward(&collapse(&x1, &pre)?)?;
                    Ok((x1, h))
                })?;
                let close = max_rel(&mh, &composed.1)?;
                if differing(&mx1, &x1_sep)? + differing(&mh, &h_sep)? != 0 || (d >= 4096 && close > 0.0) {
                    failures.push(format!("{case}: post_collapse_norm differs from the kernels (relative {close} from the Candle ops)"));
                }
                if differing(&collapse_norm(&x, &pre, &norm)?, &separate)? != 0 {
                    failures.push(format!("{case}: collapse_norm differs from the kernels"));
                }
            }
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    // Negative controls: pre and the norm weight are used; the errors.
    let x = Tensor::from_vec(rows(&mut rng, 8, 16), (2, 4, 16), &dev)?.to_dtype(DType::BF16)?;
    let pre = Tensor::from_vec((0..8).map(|_| rng.normal()).collect::<Vec<f32>>(), (2, 4), &dev)?;
    let w = Tensor::from_vec((0..16).map(|_| rng.normal()).collect::<Vec<f32>>(), 16, &dev)?;
    let a = collapse_norm_device(&x, &pre, &w, 1e-6)?;
    let pre2 = Tensor::from_vec((0..8).map(|_| rng.normal()).collect::<Vec<f32>>(), (2, 4), &dev)?;
    ensure!(differing(&a, &collapse_norm_device(&x, &pre2, &w, 1e-6)?)? > 0, "pre is ignored");
    ensure!(differing(&a, &collapse_norm_device(&x, &pre, &(w.clone() * 2.0)?, 1e-6)?)? > 0, "the weight is ignored");
    ensure!(collapse_norm_device(&x, &pre.narrow(1, 0, 3)?, &w, 1e-6).is_err(), "wrong pre shape accepted");
    ensure!(collapse_norm_device(&x, &pre, &w.narrow(0, 0, 8)?, 1e-6).is_err(), "wrong weight shape accepted");
    let wide = Tensor::zeros((1, 4, MHC_NORM_MAX_D + 1), DType::BF16, &dev)?;
    ensure!(!mhc_norm_supported(&wide, None), "d past the shared-memory limit reported as supported");
    let wd = Tensor::ones(MHC_NORM_MAX_D + 1, DType::F32, &dev)?;
    ensure!(collapse_norm_device(&wide, &Tensor::ones((1, 4), DType::F32, &dev)?, &wd, 1e-6).is_err(), "d past the limit accepted");
    // ... while the model-level helper falls back to the separate kernels there.
    let wide = Tensor::from_vec(rows(&mut rng, 4, MHC_NORM_MAX_D + 1), (1, 4, MHC_NORM_MAX_D + 1), &dev)?.to_dtype(DType::BF16)?;
    let p1 = Tensor::ones((1, 4), DType::F32, &dev)?;
    let nw = RmsNorm::from_weight(wd, 1e-6)?;
    ensure!(differing(&collapse_norm(&wide, &p1, &nw)?, &nw.forward(&collapse(&wide, &p1)?)?)? == 0, "the fallback differs");
    let y = Tensor::from_vec(rows(&mut rng, 2, 16), (2, 16), &dev)?.to_dtype(DType::BF16)?;
    let comb = Tensor::from_vec((0..32).map(|_| rng.uniform()).collect::<Vec<f32>>(), (2, 4, 4), &dev)?;
    let pn = |c: &Tensor| mhc_post_norm_device(&x, c, &y, &pre, &pre, &w, 1e-6);
    ensure!(differing(&pn(&comb)?.0, &pn(&comb.transpose(1, 2)?.contiguous()?)?.0)? > 0, "comb is ignored or its axes swapped");
    ensure!(pn(&comb.narrow(2, 0, 3)?).is_err(), "wrong comb shape accepted");
    Ok(())
}

fn swiglu_ops(gate: &Tensor, up: &Tensor, w: Option<&Tensor>, limit: Option<f64>) -> candle_core::Result<Tensor> {
    with_plain_candle(|| {
        let (mut g, mut u) = (gate.to_dtype(DType::F32)?, up.to_dtype(DType::F32)?);
        if let Some(l) = limit {
            g = g.minimum(l)?;
            u = u.clamp(-l, l)?;
        }
        let mut a = (g.silu()? * u)?;
        if let Some(w) = w {
            a = a.broadcast_mul(w)?;
        }
        a.to_dtype(gate.dtype())
    })
}

#[test]
fn swiglu_kernel_equals_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x5919);
    for (rows, inter) in [(1usize, 96usize), (2, 96), (7, 1), (33, 300), (1, 2048)] {
        for dtype in [DType::BF16, DType::F32] {
            // Magnitudes up to ~2^5 so the clamp at L = 10 (and at L = 0.5) is active.
            let mut vals = |n: usize| -> Vec<f32> { (0..n).map(|i| rng.normal() * 2f32.powi((i % 9) as i32 - 3)).collect() };
            let gate = Tensor::from_vec(vals(rows * inter), (rows, inter), &dev)?.to_dtype(dtype)?;
            let up = Tensor::from_vec(vals(rows * inter), (rows, inter), &dev)?.to_dtype(dtype)?;
            let w = Tensor::from_vec(vals(rows), (rows, 1), &dev)?;
            for (weight, limit) in [(Some(&w), Some(10.0)), (None, Some(0.5)), (Some(&w), None), (None, None)] {
                poison(&dev, rows * inter)?;
                let kernel = swiglu_device(&gate, &up, weight, limit)?;
                let ops = swiglu_ops(&gate, &up, weight, limit)?;
                ensure!(kernel.dims() == [rows, inter] && kernel.dtype() == dtype, "{:?} {:?}", kernel.shape(), kernel.dtype());
                let d = differing(&kernel, &ops)?;
                ensure!(d == 0, "[{rows}, {inter}] {dtype:?}, weight {}, limit {limit:?}: {d} values differ from the Candle ops", weight.is_some());
            }
            // Negative controls: the clamp and the weight change the result.
            let clamped = swiglu_device(&gate, &up, None, Some(0.5))?;
            ensure!(differing(&clamped, &swiglu_device(&gate, &up, None, None)?)? > 0, "the clamp is ignored");
            ensure!(differing(&swiglu_device(&gate, &up, Some(&w), None)?, &swiglu_device(&gate, &up, None, None)?)? > 0, "the weight is ignored");
        }
    }
    let g = Tensor::zeros((2, 8), DType::BF16, &dev)?;
    ensure!(swiglu_device(&g, &g.narrow(1, 0, 4)?, None, None).is_err(), "mismatched up accepted");
    ensure!(swiglu_device(&g, &g, Some(&Tensor::ones((3, 1), DType::F32, &dev)?), None).is_err(), "wrong weight shape accepted");
    ensure!(swiglu_device(&g, &g, None, Some(0.0)).is_err(), "limit 0 accepted");
    Ok(())
}

/// A whole routed expert (FP8 activation quant, w1/w3, the SwiGLU kernel, w2) on the GPU equals
/// the same expert in plain Candle ops bit for bit.
#[test]
fn expert_with_kernels_equals_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0xe7e7);
    let vb = RandomWeights::new(21).var_builder(DType::BF16, &dev);
    for (limit, rows) in [(10.0, 1usize), (10.0, 5), (0.0, 3)] {
        let expert = Expert::new(192, 96, limit, Numerics::REFERENCE, vb.pp("expert"))?;
        let x = Tensor::from_vec((0..rows * 192).map(|_| rng.normal() * 4.0).collect::<Vec<f32>>(), (rows, 192), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::from_vec((0..rows).map(|_| rng.uniform()).collect::<Vec<f32>>(), (rows, 1), &dev)?;
        let kernel = expert.forward(&x, Some(&w))?;
        let ops = with_plain_candle(|| expert.forward(&x, Some(&w)))?;
        let d = differing(&kernel, &ops)?;
        ensure!(d == 0, "limit {limit}, {rows} rows: {d} values differ from the Candle ops");
        ensure!(bits(&kernel)?.iter().any(|&b| f32::from_bits(b) != 0.0), "all zeros");
    }
    Ok(())
}

#[test]
fn engram_mix_kernel_equals_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0xe9a);
    for (t, hc, d) in [(1usize, 4usize, 192usize), (3, 4, 192), (2, 2, 20), (5, 3, 333), (1, 4, 1030)] {
        for dtype in [DType::BF16, DType::F32] {
            for eps in [1e-20, 1e-6] {
                let x = Tensor::from_vec(rows(&mut rng, t * hc, d), (t, hc, d), &dev)?.to_dtype(dtype)?;
                // Key rows of mixed signs and magnitudes so both branches of the signed sqrt and
                // the |dot| floor are taken.
                let kv = Tensor::from_vec(rows(&mut rng, t, (hc + 1) * d), (t, (hc + 1) * d), &dev)?;
                let qk = Tensor::from_vec((0..hc * d).map(|_| rng.normal()).collect::<Vec<f32>>(), (hc, d), &dev)?;
                poison(&dev, t * hc * d)?;
                let kernel = engram_mix(&x, &kv, &qk, eps)?;
                let ops = with_plain_candle(|| engram_mix(&x, &kv, &qk, eps))?;
                ensure!(kernel.dims() == [t, hc, d] && kernel.dtype() == dtype, "{:?} {:?}", kernel.shape(), kernel.dtype());
                let n = differing(&kernel, &ops)?;
                ensure!(n == 0, "T {t}, hc {hc}, d {d}, {dtype:?}, eps {eps}: {n} of {} values differ from the Candle ops", t * hc * d);
            }
        }
    }
    // Negative control: the value row matters; shape errors.
    let x = Tensor::from_vec(rows(&mut rng, 4, 32), (1, 4, 32), &dev)?.to_dtype(DType::BF16)?;
    let kv = Tensor::from_vec(rows(&mut rng, 1, 160), (1, 160), &dev)?;
    let qk = Tensor::ones((4, 32), DType::F32, &dev)?;
    let kv2 = Tensor::cat(&[kv.narrow(1, 0, 128)?, (kv.narrow(1, 128, 32)? * 3.0)?], 1)?;
    ensure!(differing(&engram_mix(&x, &kv, &qk, 1e-6)?, &engram_mix(&x, &kv2, &qk, 1e-6)?)? > 0, "the value row is ignored");
    ensure!(engram_mix(&x, &kv.narrow(1, 0, 128)?, &qk, 1e-6).is_err(), "short kv accepted");
    Ok(())
}

#[test]
fn accumulate_kernel_equals_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0xacc);
    for (n, vdt, odt) in [(192usize, DType::BF16, DType::F32), (192, DType::BF16, DType::BF16), (1000, DType::F32, DType::BF16), (7, DType::F32, DType::F32)] {
        let v = Tensor::from_vec(rows(&mut rng, 1, n), (1, n), &dev)?.to_dtype(vdt)?;
        let acc = Tensor::from_vec(rows(&mut rng, 1, n), (1, n), &dev)?;
        poison(&dev, n)?;
        let first = accumulate_device(None, &v, odt)?;
        let next = accumulate_device(Some(&acc), &v, odt)?;
        let (first_ops, next_ops) = with_plain_candle(|| -> candle_core::Result<(Tensor, Tensor)> {
            let vf = v.to_dtype(DType::F32)?;
            Ok(((Tensor::zeros((1, n), DType::F32, &dev)? + &vf)?.to_dtype(odt)?, (&acc + &vf)?.to_dtype(odt)?))
        })?;
        ensure!(first.dtype() == odt && first.dims() == [1, n], "{:?} {:?}", first.dtype(), first.shape());
        ensure!(differing(&first, &first_ops)? == 0, "n {n}: 0 + v differs from the Candle ops");
        ensure!(differing(&next, &next_ops)? == 0, "n {n}: acc + v differs from the Candle ops");
    }
    // −0 + 0 is +0 (the sum starts from zeros), and the shapes are checked.
    let negz = Tensor::from_vec(vec![-0.0f32; 4], (1, 4), &dev)?;
    ensure!(bits(&accumulate_device(None, &negz, DType::F32)?)?.iter().all(|&b| b == 0), "-0 was not summed from +0");
    ensure!(accumulate_device(Some(&Tensor::zeros((1, 3), DType::F32, &dev)?), &negz, DType::F32).is_err(), "wrong acc shape accepted");
    Ok(())
}

/// The compressor's pooling: scores of every magnitude (equal, far apart: one weight underflows
/// to 0, within a few ulps), groups closing and opening in one batch; the pooled rows and both
/// carries bit for bit the Candle ops on the same GPU, close to the CPU's.
#[test]
fn compress_pool_kernel_equals_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0xc0b1);
    for (b, d) in [(1usize, 512usize), (3, 31), (64, 512), (257, 1000), (2, 1)] {
        let t = |v: Vec<f32>| Tensor::from_vec(v, (b, d), &dev);
        let (carry_kv, kv) = (t(rows(&mut rng, b, d))?, t(rows(&mut rng, b, d))?);
        let s0: Vec<f32> = (0..b * d).map(|_| rng.normal() * 4.0).collect();
        // Per element: the same score, one 100 above / below (exp underflows), or a nearby one.
        let s1: Vec<f32> = s0
            .iter()
            .map(|&x| match rng.below(5) {
                0 => x,
                1 => x + 100.0,
                2 => x - 100.0,
                3 => f32::from_bits(x.to_bits() + 3),
                _ => rng.normal() * 4.0,
            })
            .collect();
        let (carry_score, score) = (t(s0)?, t(s1)?);
        // Random flags, with the first row closing and the second opening (both kinds in every batch of two or more).
        let flags: Vec<u8> = (0..b).map(|i| if i < 2 { (i == 0) as u8 } else { rng.below(2) as u8 }).collect();
        let closing = Tensor::from_vec(flags, (b, 1), &dev)?;
        poison(&dev, 3 * b * d)?;
        let got = compress_pool_device(&carry_kv, &carry_score, &kv, &score, &closing)?;
        let want = compress_pool_ref(&carry_kv, &carry_score, &kv, &score, &closing, DType::BF16)?;
        ensure!(got.0.dtype() == DType::BF16 && got.0.dims() == [b, d], "{:?} {:?}", got.0.dtype(), got.0.shape());
        for (what, g, w) in [("pooled", &got.0, &want.0), ("carried kv", &got.1, &want.1), ("carried score", &got.2, &want.2)] {
            ensure!(differing(g, w)? == 0, "[{b}, {d}]: the {what} differs from the Candle ops");
        }
        let cpu = Device::Cpu;
        let on_cpu = |x: &Tensor| x.to_device(&cpu);
        let host = compress_pool_ref(&on_cpu(&carry_kv)?, &on_cpu(&carry_score)?, &on_cpu(&kv)?, &on_cpu(&score)?, &on_cpu(&closing)?, DType::BF16)?;
        let err = max_abs(&(got.0.to_device(&cpu)?.to_dtype(DType::F32)? - host.0.to_dtype(DType::F32)?)?)?;
        ensure!(err <= 1e-2 * max_abs(&host.0.to_dtype(DType::F32)?)?, "[{b}, {d}]: pooled far from the CPU's: max |Δ| {err}");
        ensure!(differing(&got.1, &host.1)? == 0 && differing(&got.2, &host.2)? == 0, "[{b}, {d}]: the carries differ from the CPU's");
        let opened = closing.to_vec2::<u8>()?.iter().filter(|r| r[0] == 0).count();
        ensure!(b < 2 || (opened > 0 && opened < b), "[{b}, {d}]: the batch does not mix closing and opening groups");
    }
    let x = Tensor::zeros((2, 4), DType::F32, &dev)?;
    let closing = Tensor::zeros((2, 1), DType::U8, &dev)?;
    ensure!(compress_pool_device(&x, &x, &x.to_dtype(DType::BF16)?, &x, &closing).is_err(), "a bf16 kv accepted");
    ensure!(compress_pool_device(&x, &x, &x, &x, &Tensor::zeros((3, 1), DType::U8, &dev)?).is_err(), "3 flags for 2 rows accepted");
    Ok(())
}

/// The top-k's pool rows: entries at page boundaries (63, 64, 127), no entry (−1) anywhere,
/// interleaved pages, rows of a single page and rows with none; bit for bit the Candle ops on
/// the same GPU and the CPU's.
#[test]
fn page_rows_kernel_equals_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x9a6e);
    const P: usize = 64;
    for (b, k, max_pages) in [(1usize, 1usize, 1usize), (3, 17, 4), (64, 512, 8), (5, 2048, 40)] {
        // Each sequence holds some pages (distinct, shuffled over a pool of b·max_pages).
        let mut free: Vec<i64> = (0..(b * max_pages) as i64).collect();
        let mut table = vec![-1i64; b * max_pages];
        let mut held = vec![0usize; b];
        for s in 0..b {
            held[s] = if s == 1 { 0 } else { 1 + rng.below(max_pages) };
            for p in 0..held[s] {
                let at = rng.below(free.len());
                table[s * max_pages + p] = free.swap_remove(at);
            }
        }
        let topk: Vec<i64> = (0..b * k)
            .map(|e| {
                let n = held[e / k] * P;
                match (n, rng.below(6)) {
                    (0, _) | (_, 0) => -1,
                    (_, 1) => (P - 1).min(n - 1) as i64,
                    (_, 2) => P.min(n - 1) as i64,
                    _ => rng.below(n) as i64,
                }
            })
            .collect();
        let topk = Tensor::from_vec(topk, (b, k), &dev)?;
        let table = Tensor::from_vec(table, (b, max_pages), &dev)?;
        drop(Tensor::full(-7i64, b * k, &dev)?);
        let got = page_rows_device(&topk, &table, P)?;
        let want = page_rows_ref(&topk, &table)?;
        let host = page_rows_ref(&topk.to_device(&Device::Cpu)?, &table.to_device(&Device::Cpu)?)?;
        ensure!(got.dims() == [b, k] && got.dtype() == DType::I64, "{:?} {:?}", got.dtype(), got.shape());
        let (g, w, h) = (got.to_vec2::<i64>()?, want.to_vec2::<i64>()?, host.to_vec2::<i64>()?);
        ensure!(g == w && g == h, "[{b}, {k}] over {max_pages} pages: the pool rows differ from the Candle ops");
        ensure!(b * k < 16 || (g.iter().flatten().any(|&r| r < 0) && g.iter().flatten().any(|&r| r >= 0)), "[{b}, {k}]: no mix of entries and none");
    }
    ensure!(page_rows_device(&Tensor::zeros((2, 3), DType::I64, &dev)?, &Tensor::zeros((3, 4), DType::I64, &dev)?, P).is_err(), "a table of another batch accepted");
    Ok(())
}
