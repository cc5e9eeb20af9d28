//! FP8 weights kept in their release format on CUDA (`loader::QuantizedWeights::Native`,
//! `nn::LinearWeight::Fp8`, multiplied by `cuda::fp8_linear`), on the v41-tiny fixture model:
//! * which linears hold FP8 weights (every quantized linear whose checkpoint tensor is FP8 with
//!   32×32 block scales, nothing else) and what they hold on the device (the stored bytes: codes
//!   plus scales, half the bf16 bytes); the routed experts hold MXFP4 weights
//!   (`nn::LinearWeight::Mxfp4`, checked in detail by `tests/cuda_mxfp4.rs`);
//! * the logits of the native and dequantized policies on the GPU against each other and against
//!   the CPU reference (margin-aware, the end-to-end tolerance of the golden README, check 5),
//!   for one prefill over the weight-streaming kernel (M <= 64), one over dequantize + cuBLAS
//!   (M > 64) and prefill + decode; and inside `cuda::with_plain_candle` (where the FP8 linear
//!   is the device dequantization + the same cuBLAS GEMM) bit for bit equal;
//! * the embedded model loaded strictly (`Pretrained::load_dir_with`) under the native policy.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_native_weights`.

use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::Trace;
use deepseek_v41::golden::{compare, Case, GoldenSet, Tolerance};
use deepseek_v41::loader::{var_builder_with, QuantizedWeights, ReleaseCheckpoint};
use deepseek_v41::model::{Model, ModelCache, Pretrained, TokenMap};
use deepseek_v41::nn::{LinearKind, LinearWeight};
use deepseek_v41::Numerics;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_native_weights.rs needs a CUDA device (none found): these tests must run on a GPU")
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

/// The tiny set's `prefill_full` case (config, tokens) and its Engram token map.
fn tiny_case() -> Result<(Case, Option<TokenMap>)> {
    let set = GoldenSet::open(repo_path("tests/fixtures/v41-tiny"))?;
    let case = set.load_case(&set.root.join("prefill_full"), &Device::Cpu)?;
    let map = set.token_map(&case)?;
    Ok((case, map))
}

/// The tiny model on `dev` under `q`, every checkpoint tensor used; and its checkpoint.
fn load(case: &Case, map: &Option<TokenMap>, dev: &Device, q: QuantizedWeights) -> Result<(Model, ReleaseCheckpoint)> {
    let ckpt = ReleaseCheckpoint::open(&[&case.weights])?;
    let model = Model::new(&case.config, Numerics::REFERENCE, map.clone(), var_builder_with(ckpt.clone(), DType::BF16, dev, q))?;
    ckpt.check_all_used(&[])?;
    Ok((model, ckpt))
}

fn to_host(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_device(&Device::Cpu)?)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(to_host(t)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// Logits `[T, vocab]` (host, f32) of `tokens` run in `calls`, and the per-row discrete
/// decisions (index top-k sets and routed expert sets of every layer).
fn run(model: &Model, case: &Case, tokens: &[u32], dev: &Device, calls: &[usize]) -> Result<(Tensor, Vec<Vec<Vec<i64>>>)> {
    let cfg = &case.config;
    let mut cache = ModelCache::new(cfg, DType::BF16, dev)?;
    cache.set_trace(Some(Trace::new()));
    let mut out = Vec::new();
    let mut start = 0;
    for &n in calls {
        out.push(model.forward(&tokens[start..start + n], &mut cache)?);
        start += n;
    }
    ensure!(start == tokens.len(), "calls {calls:?} do not cover {} tokens", tokens.len());
    let trace = cache.attention.trace().context("tracing was switched on")?;
    let mut decisions = Vec::new();
    for l in 0..cfg.num_hidden_layers {
        for leaf in ["topk", "moe_ids"] {
            if let Some(t) = trace.concat(&format!("L{l}.{leaf}"))? {
                let rows = to_host(&t)?.to_dtype(DType::I64)?.to_vec2::<i64>()?;
                decisions.push(rows.into_iter().map(|mut r| { r.retain(|&x| x >= 0); r.sort_unstable(); r }).collect());
            }
        }
    }
    Ok((to_host(&Tensor::cat(&out, 0)?)?, decisions))
}

/// `got` against `want` margin-aware (as `tests/cuda_any_config.rs`): rows before the first
/// differing discrete decision at the end-to-end logits tolerance; row 0 may not flip.
fn check_logits(what: &str, got: &(Tensor, Vec<Vec<Vec<i64>>>), want: &(Tensor, Vec<Vec<Vec<i64>>>)) -> Result<()> {
    let rows = want.0.dim(0)?;
    ensure!(got.0.dims() == want.0.dims() && got.1.len() == want.1.len(), "{what}: shapes differ");
    let first_flip = (0..rows).find(|&r| got.1.iter().zip(&want.1).any(|(g, w)| g[r] != w[r])).unwrap_or(rows);
    println!("{what}: every decision equal up to row {first_flip} of {rows}");
    ensure!(first_flip >= 1, "{what}: a decision differs already at row 0");
    let o = compare(what, &got.0.narrow(0, 0, first_flip)?, &want.0.narrow(0, 0, first_flip)?, Tolerance::RelFro { rel_fro: 3e-2, max_abs: None })?;
    ensure!(o.pass, "{what}: {o}");
    ensure!(got.0.flatten_all()?.to_vec1::<f32>()?.iter().all(|v| v.is_finite()), "{what}: non-finite logits");
    Ok(())
}

#[test]
fn quantized_linears_over_fp8_weights_hold_the_stored_bytes() -> Result<()> {
    let dev = gpu();
    let (case, map) = tiny_case()?;
    let (native, ckpt) = load(&case, &map, &dev, QuantizedWeights::Native)?;
    let (dequantized, _) = load(&case, &map, &dev, QuantizedWeights::Dequantized)?;
    let (linears, dense_linears) = (native.linears(), dequantized.linears());
    ensure!(linears.len() == dense_linears.len());
    let (mut n_fp8, mut fp8_bytes, mut scale_bytes, mut bf16_bytes) = (0, 0, 0, 0);
    let (mut n_mxfp4, mut mxfp4_saved) = (0, 0);
    for ((name, l), (dname, dl)) in linears.iter().zip(&dense_linears) {
        ensure!(name == dname, "{name} vs {dname}");
        let weight = format!("{name}.weight");
        let expected = l.kind() == LinearKind::Quantized && ckpt.is_fp8_block32(&weight);
        let expected_mxfp4 = l.kind() == LinearKind::Quantized && ckpt.is_mxfp4(&weight);
        let dense = dl.weight().dense().with_context(|| format!("{name}: dense under the dequantized policy"))?;
        ensure!(dense.device().is_cuda() && l.device().is_cuda(), "{name}: not on the GPU");
        match l.weight() {
            LinearWeight::Fp8(w) => {
                ensure!(expected, "{name}: FP8 but its kind is {:?} / its tensor is not FP8 32x32", l.kind());
                n_fp8 += 1;
                let info = ckpt.info(&weight)?;
                let scale = info.scale.as_ref().context("FP8 weights have a scale")?;
                // On the device: the stored bytes, nothing else.
                ensure!(w.codes().dtype() == DType::U8 && w.scales().dtype() == DType::U8 && w.device().is_cuda());
                ensure!(w.bytes() == info.stored.byte_range.len() + scale.byte_range.len() && l.weight().bytes() == w.bytes(), "{name}");
                ensure!(to_host(w.codes())?.flatten_all()?.to_vec1::<u8>()? == ckpt.raw_bytes(&weight)?, "{name}: codes");
                ensure!(to_host(w.scales())?.flatten_all()?.to_vec1::<u8>()? == ckpt.raw_bytes(&scale.name)?, "{name}: scales");
                // The device dequantization is the dequantized policy's weight, bit for bit.
                ensure!(dense.dtype() == DType::BF16 && bits(&w.dequantize(DType::BF16)?)? == bits(dense)?, "{name}: dequantization");
                fp8_bytes += w.bytes();
                scale_bytes += scale.byte_range.len();
                bf16_bytes += dl.weight().bytes();
            }
            LinearWeight::Mxfp4(w) => {
                ensure!(expected_mxfp4, "{name}: MXFP4 but its kind is {:?} / its tensor is not MXFP4", l.kind());
                ensure!(bits(&w.dequantize(DType::BF16)?)? == bits(dense)?, "{name}: MXFP4 dequantization");
                n_mxfp4 += 1;
                mxfp4_saved += dl.weight().bytes() - w.bytes();
            }
            LinearWeight::Dense(w) => {
                ensure!(!expected && !expected_mxfp4, "{name}: dense, but it is a quantized linear over an FP8 32x32 or MXFP4 weight");
                ensure!(bits(w)? == bits(dense)?, "{name}: dense weights differ between the policies");
            }
        }
    }
    // wq_a, wq_b, wkv, wo_b of 9 layers, 4 indexer wq_b, 2 Engram wkv, 3 shared-expert
    // projections of 9 layers.
    ensure!(n_fp8 == 9 * 4 + 4 + 2 + 9 * 3, "{n_fp8} FP8 linears");
    println!("{n_fp8} FP8 linears: {fp8_bytes} bytes (codes + {scale_bytes} scale bytes) instead of {bf16_bytes} bf16 bytes");
    ensure!(2 * (fp8_bytes - scale_bytes) == bf16_bytes, "codes must be half the bf16 bytes");
    // The routed experts: 3 projections of 8 experts in 9 layers.
    ensure!(n_mxfp4 == 9 * 8 * 3, "{n_mxfp4} MXFP4 linears");
    // The whole model holds that much less.
    let total = |m: &Model| m.linears().iter().map(|(_, l)| l.weight().bytes()).sum::<usize>();
    ensure!(total(&dequantized) - total(&native) == bf16_bytes - fp8_bytes + mxfp4_saved);
    Ok(())
}

#[test]
fn native_logits_match_the_dequantized_and_the_cpu() -> Result<()> {
    let dev = gpu();
    let (case, map) = tiny_case()?;
    let (native, _) = load(&case, &map, &dev, QuantizedWeights::Native)?;
    let (dequantized, _) = load(&case, &map, &dev, QuantizedWeights::Dequantized)?;
    let (cpu, _) = load(&case, &map, &Device::Cpu, QuantizedWeights::Native)?;
    // 96 tokens (the case's 40, repeated): prefills of M > 64 take dequantize + cuBLAS, the
    // decode steps and the 40-token prefill the weight-streaming kernel.
    let tokens: Vec<u32> = case.inputs.input_ids.iter().cycle().take(96).copied().collect();
    for calls in [vec![40, 56], vec![96], vec![90, 1, 1, 1, 1, 1, 1]] {
        let want = run(&cpu, &case, &tokens, &Device::Cpu, &calls)?;
        let got = run(&native, &case, &tokens, &dev, &calls)?;
        let base = run(&dequantized, &case, &tokens, &dev, &calls)?;
        check_logits(&format!("calls {calls:?}: native vs CPU"), &got, &want)?;
        check_logits(&format!("calls {calls:?}: dequantized vs CPU"), &base, &want)?;
        check_logits(&format!("calls {calls:?}: native vs dequantized"), &got, &base)?;
        // Plain Candle: the FP8 linear is the device dequantization + the dense path's GEMM (the
        // MXFP4 linears are that everywhere).
        let plain = |m: &Model| deepseek_v41::cuda::with_plain_candle(|| run(m, &case, &tokens, &dev, &calls));
        let (p_native, p_dense) = (plain(&native)?, plain(&dequantized)?);
        ensure!(bits(&p_native.0)? == bits(&p_dense.0)?, "calls {calls:?}: plain-Candle logits of the two policies differ");
        check_logits(&format!("calls {calls:?}: plain native vs CPU"), &p_native, &want)?;
    }
    Ok(())
}

#[test]
fn the_embedded_model_loads_strictly_with_native_weights() -> Result<()> {
    let dev = gpu();
    let dir = repo_path("models/v41-shakespeare-tiny");
    // Strict: every text tensor used (the FP8 ones through their stored parts), none missing.
    let p = Pretrained::load_dir_with(&dir, Numerics::REFERENCE, DType::BF16, &dev, QuantizedWeights::Native)?;
    ensure!(p.quantized_weights == QuantizedWeights::Native);
    let n_fp8 = p.model.linears().iter().filter(|(_, l)| l.weight().fp8().is_some()).count();
    // wq_a, wq_b, wkv, wo_b and the shared expert's 3 of 6 layers, 3 indexer wq_b, 2 Engram wkv.
    ensure!(n_fp8 == 6 * 7 + 3 + 2, "{n_fp8} FP8 linears");
    // The routed experts' 3 projections, 8 experts in 6 layers.
    let n_mxfp4 = p.model.linears().iter().filter(|(_, l)| l.weight().mxfp4().is_some()).count();
    ensure!(n_mxfp4 == 6 * 8 * 3, "{n_mxfp4} MXFP4 linears");
    let d = Pretrained::load_dir_with(&dir, Numerics::REFERENCE, DType::BF16, &dev, QuantizedWeights::Dequantized)?;
    ensure!(d.model.linears().iter().all(|(_, l)| l.weight().dense().is_some()));
    // One prefill of the prompt: the two policies' logits agree.
    let ids = p.tokenizer.encode("ROMEO:", true)?;
    let logits = |m: &Pretrained| -> Result<Tensor> { to_host(&m.model.forward(&ids, &mut m.new_cache()?)?) };
    let o = compare("logits", &logits(&p)?, &logits(&d)?, Tolerance::RelFro { rel_fro: 3e-2, max_abs: None })?;
    ensure!(o.pass, "{o}");
    Ok(())
}
