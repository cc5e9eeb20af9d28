//! GPU tests of the MXFP4 routed-expert weights kept packed on the device (`quant::Mxfp4Weight`,
//! `kernels/mxfp4.cu`, `cuda::mxfp4_dequantize_device`, `nn::LinearWeight::Mxfp4`):
//! * the device dequantization bit for bit against the host (`Mxfp4Weight::dequantize` =
//!   `loader::dequant_mxfp4`, then the cast), f32 and bf16: every byte value under every scale
//!   byte (0 = 2^-127, 253 / 254 with overflows to ±inf, 255 = NaN with the host's NaN bits),
//!   random codes over edge shapes (K = 32, N = 1, ...) and a V4.1-Flash expert's shape, the
//!   vector and the byte-load paths (a code view off 16-byte alignment), outputs allocated over
//!   NaN-poisoned memory;
//! * an MXFP4 `Linear` against the dense `Linear` over the host-dequantized weight: bit for bit
//!   (the same cuBLAS matmul over the same bf16 weight), for several m, ranks and act quant on
//!   and off;
//! * the v41-tiny fixture's routed experts and MoE layers loaded under `QuantizedWeights::Native`
//!   (MXFP4 linears) and `Dequantized` (dense bf16): bit-identical outputs, with the fused kernels
//!   and inside `cuda::with_plain_candle`;
//! * which linears of the tiny model hold MXFP4 weights (every routed expert projection, nothing
//!   else) and what they hold (the stored bytes: a quarter of the bf16 bytes plus the scales);
//! * the errors.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_mxfp4`.

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use deepseek_v41::config::Config;
use deepseek_v41::cuda::{mxfp4_dequantize_device, with_plain_candle};
use deepseek_v41::golden::{Case, GoldenSet};
use deepseek_v41::loader::{var_builder_with, QuantizedWeights, ReleaseCheckpoint};
use deepseek_v41::model::{Expert, Model, Moe, TokenMap};
use deepseek_v41::nn::{Linear, LinearKind, LinearWeight};
use deepseek_v41::quant::Mxfp4Weight;
use deepseek_v41::Numerics;

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_mxfp4.rs needs a CUDA device (none found): these tests must run on a GPU")
}

/// Frees `n` f32 of NaN on `dev` so the next allocations of the stream-ordered pool are likely to
/// reuse poisoned memory (an element the kernel forgets to write then shows up as NaN).
fn poison(dev: &Device, n: usize) -> Result<()> {
    drop(Tensor::full(f32::NAN, n.max(1), dev)?);
    Ok(())
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// The same weight on `dev`.
fn to_dev(w: &Mxfp4Weight, dev: &Device) -> Result<Mxfp4Weight> {
    Ok(Mxfp4Weight::new(w.codes().to_device(dev)?, w.scales().to_device(dev)?)?)
}

/// A random weight `[n, k]` on the CPU: codes over every byte, scale bytes 118..=135 (2^-9 ..
/// 2^8) with a few extremes (0, 1, 253, 254, 255) when `extremes`.
fn weight(rng: &mut Rng, n: usize, k: usize, extremes: bool) -> Result<Mxfp4Weight> {
    let codes: Vec<u8> = (0..n * k / 2).map(|_| rng.below(256) as u8).collect();
    let scales: Vec<u8> = (0..n * k / 32)
        .map(|_| if extremes && rng.below(8) == 0 { [0u8, 1, 253, 254, 255][rng.below(5)] } else { 118 + rng.below(18) as u8 })
        .collect();
    Ok(Mxfp4Weight::from_bytes(codes, scales, n, k, &Device::Cpu)?)
}

/// `w` (host) dequantized on the device against the host, f32 and bf16, exact bits (NaN too: the
/// kernel writes the host's NaN).
fn check_dequantize(what: &str, w: &Mxfp4Weight, wg: &Mxfp4Weight, dev: &Device) -> Result<()> {
    let (n, k) = w.dims();
    for dtype in [DType::F32, DType::BF16] {
        poison(dev, n * k)?;
        let g = mxfp4_dequantize_device(wg, dtype)?;
        ensure!(g.dtype() == dtype && g.dims() == [n, k] && g.device().is_cuda(), "{what}: {:?} {:?}", g.dtype(), g.shape());
        // `dequantize` on a CUDA weight is the kernel too.
        let g2 = wg.dequantize(dtype)?;
        let (g, g2, h) = (bits(&g)?, bits(&g2)?, bits(&w.dequantize(dtype)?)?);
        ensure!(g == g2, "{what} {dtype:?}: Mxfp4Weight::dequantize on CUDA is not the kernel");
        let bad: Vec<usize> = (0..g.len()).filter(|&i| g[i] != h[i]).collect();
        if let Some(&i) = bad.first() {
            let (a, b) = (f32::from_bits(g[i]), f32::from_bits(h[i]));
            anyhow::bail!("{what} [{n}, {k}] {dtype:?}: {} elements differ from the host, first {i}: {a:e} ({:#x}) vs {b:e} ({:#x})", bad.len(), g[i], h[i])
        }
    }
    Ok(())
}

/// Every byte value (all 16 codes in both nibbles) under every scale byte 0..=255.
#[test]
fn dequantize_every_byte_under_every_scale() -> Result<()> {
    let dev = gpu();
    let (n, k) = (256usize, 512usize);
    let codes: Vec<u8> = (0..n).flat_map(|_| 0..=255u8).collect();
    let scales: Vec<u8> = (0..n).flat_map(|s| std::iter::repeat_n(s as u8, k / 32)).collect();
    let w = Mxfp4Weight::from_bytes(codes, scales, n, k, &Device::Cpu)?;
    let wg = to_dev(&w, &dev)?;
    check_dequantize("every byte x every scale", &w, &wg, &dev)?;
    // The test can fail: the extremes are there (+-inf, NaN, the subnormal 2^-128) and "-0" is +0.
    let g = wg.dequantize(DType::F32)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
    ensure!(g[0][2] == 2f32.powi(-128) && g[254][14] == f32::INFINITY && g[254][30] == f32::NEG_INFINITY && g[255].iter().all(|v| v.is_nan()));
    ensure!((0..255).all(|r| g[r][2 * 0x88].to_bits() == 0 && g[r][2 * 0x88 + 1].to_bits() == 0), "code 8 must dequantize to +0");
    Ok(())
}

/// Random codes over edge shapes (K = 32, N = 1, N = 1 with a long row, odd N) and a V4.1-Flash
/// expert projection (`w1` / `w3` `[2304, 5120]`, `w2` `[5120, 2304]`), with extreme scales;
/// and code views whose first byte is not 16-byte aligned (the byte-load path) or is a whole row
/// further (the vector path with an offset).
#[test]
fn dequantize_random_shapes_and_views() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x0f4_0001);
    for &(n, k) in &[(1, 32), (2, 32), (1, 64), (1, 7168), (3, 96), (33, 160), (257, 1024), (2304, 5120), (5120, 2304)] {
        let w = weight(&mut rng, n, k, true)?;
        check_dequantize(&format!("[{n}, {k}]"), &w, &to_dev(&w, &dev)?, &dev)?;
    }
    for &(n, k, offset) in &[(5, 64, 1usize), (7, 96, 3), (9, 32, 16), (4, 128, 64)] {
        let w = weight(&mut rng, n, k, true)?;
        let mut flat = vec![0xa5u8; offset];
        flat.extend(w.codes().flatten_all()?.to_vec1::<u8>()?);
        let codes = Tensor::from_vec(flat, n * k / 2 + offset, &dev)?.narrow(0, offset, n * k / 2)?.reshape((n, k / 2))?;
        let wg = Mxfp4Weight::new(codes, w.scales().to_device(&dev)?)?;
        check_dequantize(&format!("[{n}, {k}] codes at byte offset {offset}"), &w, &wg, &dev)?;
    }
    Ok(())
}

/// `Linear::from_mxfp4` on the GPU is the dense `Linear` over the host-dequantized bf16 weight,
/// bit for bit (`forward`, `forward_prepared`, ranks 2 and 3, act quant on and off, several m);
/// and near the CPU reference (`quant::mxfp4_linear_ref`, another summation order).
#[test]
fn mxfp4_linear_is_the_dense_linear_bit_for_bit() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x0f4_0002);
    let (n, k) = (192, 512);
    let w = weight(&mut rng, n, k, false)?;
    let wg = to_dev(&w, &dev)?;
    let dense_w = w.dequantize(DType::BF16)?.to_device(&dev)?;
    for aq in [true, false] {
        let numerics = Numerics { activation_quant: aq, ..Numerics::PLAIN };
        let fp4 = Linear::from_mxfp4(wg.clone(), numerics);
        let dense = Linear::from_weight(dense_w.clone(), LinearKind::Quantized, numerics);
        ensure!(fp4.weight().mxfp4().is_some() && fp4.weight().bytes() == n * k / 2 + n * k / 32);
        for m in [1usize, 7, 64, 65, 300] {
            let xs: Vec<f32> = (0..m * k).map(|_| rng.normal() * 2f32.powi(rng.below(9) as i32 - 4)).collect();
            let x = Tensor::from_vec(xs, (m, k), &dev)?.to_dtype(DType::BF16)?;
            let want = dense.forward(&x)?;
            let got = fp4.forward(&x)?;
            ensure!(got.dtype() == DType::BF16 && got.dims() == [m, n], "{:?} {:?}", got.dtype(), got.shape());
            ensure!(bits(&got)? == bits(&want)?, "m = {m} aq = {aq}: forward differs from the dense linear");
            ensure!(bits(&fp4.forward_prepared(&fp4.prepare_input(&x)?)?)? == bits(&want)?, "m = {m} aq = {aq}: forward_prepared");
            let x3 = x.reshape((1, m, k))?;
            ensure!(bits(&fp4.forward(&x3)?)? == bits(&dense.forward(&x3)?)?, "m = {m} aq = {aq}: rank 3");
            // Near the CPU reference (f32 accumulation in another order, bf16 output).
            let r = deepseek_v41::quant::mxfp4_linear_ref(&x.to_device(&Device::Cpu)?, &w, aq)?.to_dtype(DType::F32)?;
            let g = got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
            let rel = ((g - &r)?.sqr()?.sum_all()?.to_scalar::<f32>()? / r.sqr()?.sum_all()?.to_scalar::<f32>()?).sqrt();
            ensure!(rel < 1e-2, "m = {m} aq = {aq}: relative Frobenius distance {rel} to the CPU reference");
        }
    }
    Ok(())
}

/// A folder of the repository (from the repository root when the packed binary runs elsewhere).
fn repo_path(rel: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel);
    if built.exists() {
        built
    } else {
        PathBuf::from(rel)
    }
}

/// The tiny set's `prefill_full` case (config, weights) and its Engram token map.
fn tiny_case() -> Result<(Case, Option<TokenMap>)> {
    let set = GoldenSet::open(repo_path("tests/fixtures/v41-tiny"))?;
    let case = set.load_case(&set.root.join("prefill_full"), &Device::Cpu)?;
    let map = set.token_map(&case)?;
    Ok((case, map))
}

/// Random bf16 activations `[t, d]` on `dev` (ffn-normed scale).
fn acts(rng: &mut Rng, t: usize, d: usize, dev: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..t * d).map(|_| rng.normal()).collect();
    Ok(Tensor::from_vec(v, (t, d), dev)?.to_dtype(DType::BF16)?)
}

/// The fixture's routed experts and MoE layers under the two policies on the GPU: every expert
/// projection is MXFP4 under `Native` and dense bf16 under `Dequantized`, and the outputs are
/// bit-identical (fused kernels and plain Candle; routing weights on and off; T = 1, 3, 40, 130).
/// The MoE layers drop their shared expert (FP8: the weight-streaming kernel sums in another
/// order than the dense path) except inside `with_plain_candle`, where the FP8 linear is the
/// dense path too.
#[test]
fn tiny_experts_and_moe_native_equal_dequantized() -> Result<()> {
    let dev = gpu();
    let (case, _) = tiny_case()?;
    let cfg: &Config = &case.config;
    let ckpt = ReleaseCheckpoint::open(&[&case.weights])?;
    let vb = |q| var_builder_with(ckpt.clone(), DType::BF16, &dev, q);
    let (native, dequantized) = (vb(QuantizedWeights::Native), vb(QuantizedWeights::Dequantized));
    let mut rng = Rng(0x0f4_0003);
    let (d, inter) = (cfg.hidden_size, cfg.moe_intermediate_size);
    for (l, e) in [(0usize, 0usize), (4, 3), (8, 7)] {
        let prefix = format!("layers.{l}.ffn.experts.{e}");
        let load = |vb: &candle_nn::VarBuilder| Expert::new(d, inter, cfg.swiglu_limit, Numerics::REFERENCE, vb.pp(&prefix));
        let (xn, xd) = (load(&native)?, load(&dequantized)?);
        for ((name, a), (_, b)) in xn.linears().iter().zip(xd.linears().iter()) {
            ensure!(a.weight().mxfp4().is_some(), "{prefix}.{name}: not MXFP4 under the native policy");
            ensure!(b.weight().dense().is_some_and(|w| w.dtype() == DType::BF16), "{prefix}.{name}: not dense bf16 under dequantized");
        }
        for t in [1usize, 3, 40, 130] {
            let x = acts(&mut rng, t, d, &dev)?;
            let rw = Tensor::from_vec((0..t).map(|_| rng.uniform()).collect::<Vec<f32>>(), (t, 1), &dev)?;
            for weight in [None, Some(&rw)] {
                let fused = (xn.forward(&x, weight)?, xd.forward(&x, weight)?);
                ensure!(bits(&fused.0)? == bits(&fused.1)?, "{prefix} T = {t} weight {}: outputs differ", weight.is_some());
                ensure!(fused.0.flatten_all()?.abs()?.max(0)?.to_dtype(DType::F32)?.to_scalar::<f32>()? > 0.0, "{prefix}: all-zero output");
                let plain = with_plain_candle(|| -> Result<_> { Ok((xn.forward(&x, weight)?, xd.forward(&x, weight)?)) })?;
                ensure!(bits(&plain.0)? == bits(&plain.1)?, "{prefix} T = {t} weight {} (plain Candle): outputs differ", weight.is_some());
            }
        }
    }
    let routed_only = Config { n_shared_experts: 0, ..cfg.clone() }.resolve()?;
    for l in [0usize, 5, 8] {
        let prefix = format!("layers.{l}.ffn");
        for (c, plain) in [(&routed_only, false), (&routed_only, true), (cfg, true)] {
            let (mn, md) = (Moe::new(c, Numerics::REFERENCE, native.pp(&prefix))?, Moe::new(c, Numerics::REFERENCE, dequantized.pp(&prefix))?);
            let n_mxfp4 = mn.linears().iter().filter(|(_, l)| l.weight().mxfp4().is_some()).count();
            ensure!(n_mxfp4 == 3 * cfg.n_routed_experts, "{prefix}: {n_mxfp4} MXFP4 linears");
            for t in [1usize, 3, 40, 130] {
                let x = acts(&mut rng, t, d, &dev)?;
                let run = || -> Result<_> { Ok((mn.forward(&x)?, md.forward(&x)?)) };
                let (a, b) = if plain { with_plain_candle(run)? } else { run()? };
                let what = format!("{prefix} T = {t} shared {} plain {plain}", c.n_shared_experts);
                ensure!(bits(&a.ids)? == bits(&b.ids)?, "{what}: routing differs");
                ensure!(bits(&a.out)? == bits(&b.out)?, "{what}: outputs differ");
            }
        }
    }
    Ok(())
}

/// Which linears of the tiny model hold MXFP4 weights under the native policy on the GPU (every
/// routed expert projection, 9 layers x 8 experts x 3, nothing else) and what they hold: the
/// stored bytes (codes and scales as in the checkpoint), dequantizing bit for bit to the
/// dequantized policy's bf16 weight, a quarter of its bytes plus the scales.
#[test]
fn tiny_model_mxfp4_linears_hold_the_stored_bytes() -> Result<()> {
    let dev = gpu();
    let (case, map) = tiny_case()?;
    let load = |q| -> Result<(Model, ReleaseCheckpoint)> {
        let ckpt = ReleaseCheckpoint::open(&[&case.weights])?;
        let model = Model::new(&case.config, Numerics::REFERENCE, map.clone(), var_builder_with(ckpt.clone(), DType::BF16, &dev, q))?;
        ckpt.check_all_used(&[])?;
        Ok((model, ckpt))
    };
    let (native, ckpt) = load(QuantizedWeights::Native)?;
    let (dequantized, _) = load(QuantizedWeights::Dequantized)?;
    let (linears, dense_linears) = (native.linears(), dequantized.linears());
    ensure!(linears.len() == dense_linears.len());
    let (mut n_mxfp4, mut bytes, mut scale_bytes, mut bf16_bytes) = (0, 0, 0, 0);
    for ((name, l), (dname, dl)) in linears.iter().zip(&dense_linears) {
        ensure!(name == dname, "{name} vs {dname}");
        let weight = format!("{name}.weight");
        let expected = l.kind() == LinearKind::Quantized && ckpt.is_mxfp4(&weight);
        let dense = dl.weight().dense().with_context(|| format!("{name}: dense under the dequantized policy"))?;
        match l.weight() {
            LinearWeight::Mxfp4(w) => {
                ensure!(expected, "{name}: MXFP4 but its kind is {:?} / its tensor is not MXFP4", l.kind());
                ensure!(name.contains(".ffn.experts."), "{name}: MXFP4 outside the routed experts");
                n_mxfp4 += 1;
                let info = ckpt.info(&weight)?;
                let scale = info.scale.as_ref().context("MXFP4 weights have a scale")?;
                ensure!(w.codes().dtype() == DType::U8 && w.scales().dtype() == DType::U8 && w.device().is_cuda());
                ensure!(w.dims() == (info.shape[0], info.shape[1]) && w.codes().dims() == info.stored.shape.as_slice(), "{name}");
                ensure!(w.bytes() == info.stored.byte_range.len() + scale.byte_range.len() && l.weight().bytes() == w.bytes(), "{name}");
                ensure!(w.codes().to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u8>()? == ckpt.raw_bytes(&weight)?, "{name}: codes");
                ensure!(w.scales().to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u8>()? == ckpt.raw_bytes(&scale.name)?, "{name}: scales");
                ensure!(dense.dtype() == DType::BF16 && bits(&w.dequantize(DType::BF16)?)? == bits(dense)?, "{name}: dequantization");
                bytes += w.bytes();
                scale_bytes += scale.byte_range.len();
                bf16_bytes += dl.weight().bytes();
            }
            _ => ensure!(!expected, "{name}: not MXFP4, but it is a quantized linear over an MXFP4 weight"),
        }
    }
    let c = &case.config;
    ensure!(n_mxfp4 == c.num_hidden_layers * c.n_routed_experts * 3, "{n_mxfp4} MXFP4 linears");
    println!("{n_mxfp4} MXFP4 linears: {bytes} bytes (codes + {scale_bytes} scale bytes) instead of {bf16_bytes} bf16 bytes");
    // bf16: 2 bytes per weight; codes: 1/2 byte; scales: 1/32 byte.
    ensure!(4 * (bytes - scale_bytes) == bf16_bytes && 64 * scale_bytes == bf16_bytes, "codes must be a quarter of the bf16 bytes, the scales 1/64");
    Ok(())
}

#[test]
fn errors() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x0f4_0004);
    let w = weight(&mut rng, 8, 64, false)?;
    let wg = to_dev(&w, &dev)?;
    let e = mxfp4_dequantize_device(&wg, DType::F16).unwrap_err().to_string();
    ensure!(e.contains("F16"), "{e}");
    let e = mxfp4_dequantize_device(&w, DType::BF16).unwrap_err().to_string();
    ensure!(e.contains("CUDA"), "{e}");
    let e = Linear::from_mxfp4(wg.clone(), Numerics::PLAIN).forward(&acts(&mut rng, 2, 96, &dev)?).unwrap_err().to_string();
    ensure!(e.contains("[2, 96]") && e.contains("[8, 64]"), "{e}");
    // Codes and scales on two devices.
    let e = Mxfp4Weight::new(w.codes().to_device(&dev)?, w.scales().clone()).unwrap_err().to_string();
    ensure!(e.contains("share a device"), "{e}");
    Ok(())
}
