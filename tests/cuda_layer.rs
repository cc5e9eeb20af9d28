//! GPU tests of the attention layer on CUDA (issue 6): the FP8 activation / QAT fake-quant
//! kernel bit for bit against the host reference, the whole attention stack of the tiny golden
//! set teacher forced on the GPU against the reference's goldens (full prefill, chunked prefill,
//! prefill + decode; top-k sets identical to the CPU run), and a head_dim-512 variant with random
//! weights (the fused sparse-attention kernel's head dim) on the GPU against the CPU, and both
//! with the caches in the packed formats A / B / E bit for bit equal to the bf16 caches.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_layer`.

use std::path::PathBuf;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::attention::{Attention, CacheStorage, SequenceCache};
use deepseek_v41::config::Config;
use deepseek_v41::golden::runner::{compare_produced, run_attention_teacher_forced, Regime, RunOptions};
use deepseek_v41::golden::{compare, Call, GoldenSet, Report, Tolerance};
use deepseek_v41::model::split_sinkhorn;
use deepseek_v41::nn::RandomWeights;
use deepseek_v41::quant::{fake_quant, fp8_activation_quant, QatFormat};
use deepseek_v41::Numerics;

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

#[path = "support/layer_runs.rs"]
#[allow(dead_code)]
mod layer_runs;
use layer_runs::{layer_inputs, run_layers_with};

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_layer.rs needs a CUDA device (none found): these tests must run on a GPU")
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

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// Random rows with block-wise magnitudes spanning the formats' ranges, plus zeros, negative
/// zeros, values below the amax floors and saturating values.
fn activations(rng: &mut Rng, rows: usize, k: usize) -> Vec<f32> {
    (0..rows * k)
        .map(|i| {
            let block_scale = 2f32.powi((i / 16 % 40) as i32 - 30);
            match rng.below(50) {
                0 => 0.0,
                1 => -0.0,
                2 => 1e-30,
                3 => 1e4 * block_scale,
                _ => rng.normal() * block_scale,
            }
        })
        .collect()
}

#[test]
fn fake_quant_kernel_is_bit_exact() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x51);
    for (rows, k) in [(1usize, 32usize), (7, 5120), (33, 1280), (300, 96)] {
        let host = Tensor::from_vec(activations(&mut rng, rows, k), (rows, k), &Device::Cpu)?;
        for dtype in [DType::BF16, DType::F32] {
            let x = host.to_dtype(dtype)?;
            let xd = x.to_device(&dev)?;
            for fmt in [QatFormat::Fp8Ue8m0B32, QatFormat::Fp4E4m3B16, QatFormat::Fp4Ue8m0B32] {
                let want = fake_quant(&x, fmt)?;
                let got = fake_quant(&xd, fmt)?;
                ensure!(got.device().is_cuda() && got.dtype() == dtype, "{fmt}: result on {:?} {:?}", got.device(), got.dtype());
                let (g, w) = (bits(&got)?, bits(&want)?);
                let bad = g.iter().zip(&w).position(|(a, b)| a != b);
                ensure!(bad.is_none(), "{fmt} {dtype:?} [{rows}, {k}]: element {bad:?} differs");
            }
            // The activation quant is Q1; a strided (transposed-back) input works too.
            let xt = xd.t()?.contiguous()?.t()?;
            let (g, w) = (bits(&fp8_activation_quant(&xt)?)?, bits(&fp8_activation_quant(&x)?)?);
            ensure!(g == w, "fp8_activation_quant {dtype:?} [{rows}, {k}] differs");
            // Negative control: quantized values differ from the input.
            ensure!(g != bits(&x)?, "fake quant left the input unchanged");
        }
    }
    ensure!(fake_quant(&Tensor::zeros((2, 48), DType::BF16, &dev)?, QatFormat::Fp8Ue8m0B32).is_err());
    Ok(())
}

/// Runs the tiny set's `prefill_full` attention stack teacher forced with `calls` on `dev`.
fn tiny_run(calls: &[Call], dev: &Device) -> Result<(deepseek_v41::golden::Case, deepseek_v41::golden::runner::Produced)> {
    tiny_run_with(calls, dev, CacheStorage::Bf16)
}

/// [`tiny_run`] with the caches in `storage`.
fn tiny_run_with(
    calls: &[Call],
    dev: &Device,
    storage: CacheStorage,
) -> Result<(deepseek_v41::golden::Case, deepseek_v41::golden::runner::Produced)> {
    let set = GoldenSet::open(fixtures())?;
    let case = set.load_case(&set.root.join("prefill_full"), &Device::Cpu)?;
    let produced = run_attention_teacher_forced(&case, calls, dev, RunOptions { storage, ..Default::default() })?;
    Ok((case, produced))
}

/// The three chunkings of the tiny set's 40 tokens: one prefill, two chunks, prefill + decode.
fn tiny_calls() -> [Vec<Call>; 3] {
    let mut decode = vec![Call { start_pos: 0, length: 23 }];
    decode.extend((23..40).map(|p| Call { start_pos: p, length: 1 }));
    let chunked = vec![Call { start_pos: 0, length: 23 }, Call { start_pos: 23, length: 17 }];
    [vec![Call { start_pos: 0, length: 40 }], chunked, decode]
}

#[test]
fn tiny_golden_attention_on_the_gpu_full_chunked_decode() -> Result<()> {
    let dev = gpu();
    for calls in tiny_calls() {
        let (case, gpu_out) = tiny_run(&calls, &dev)?;
        ensure!(gpu_out["L0.attn_out"].device().is_cuda(), "the layer did not run on the GPU");
        let mut report = Report::default();
        let names = compare_produced(&case, &gpu_out, Regime::TeacherForced, &mut report)?;
        ensure!(names.len() >= 30, "only {} goldens compared", names.len());
        ensure!(report.failed() == 0, "calls {calls:?}: {} of {} goldens failed on the GPU", report.failed(), report.outcomes.len());
        // Top-k and candidate sets identical to the CPU run.
        let (_, cpu_out) = tiny_run(&calls, &Device::Cpu)?;
        let mut n = 0;
        for (name, t) in &cpu_out {
            if name.ends_with(".topk") || name.ends_with(".cand_blocks") {
                let o = compare(name, &gpu_out[name], t, Tolerance::IdSets)?;
                ensure!(o.pass, "calls {calls:?}: {o}");
                n += 1;
            }
        }
        ensure!(n >= 4, "only {n} top-k tensors compared");
    }
    Ok(())
}

/// The tiny config with V4.1's head_dim 512 (the fused attention kernel's head dim).
fn config_512() -> Result<Config> {
    let mut cfg = Config::from_file(fixtures().join("config.json"))?;
    cfg.head_dim = 512;
    Ok(cfg)
}

fn run_layers(cfg: &Config, dev: &Device, xs: &[Tensor], calls: &[usize]) -> Result<Vec<Tensor>> {
    run_layers_with(cfg, dev, xs, calls, CacheStorage::Bf16, 5)
}

/// The fused path and the plain-Candle path (`cuda::with_plain_candle`: the reference layer's
/// Candle ops on the device, the benchmarks' baseline) both match the CPU reference on the GPU.
#[test]
fn head_dim_512_layers_on_the_gpu_match_the_cpu() -> Result<()> {
    let dev = gpu();
    let cfg = config_512()?;
    let mut rng = Rng(0x512);
    let n = 3 * cfg.sliding_window + 9;
    let xs = (0..cfg.num_hidden_layers)
        .map(|_| {
            let v: Vec<f32> = (0..n * cfg.hidden_size).map(|_| rng.normal()).collect();
            Tensor::from_vec(v, (n, cfg.hidden_size), &Device::Cpu)?.to_dtype(DType::BF16)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mut decode = vec![cfg.sliding_window + 2];
    decode.resize(n - decode[0] + 1, 1);
    let full = vec![n];
    let chunked = vec![7, 2 * cfg.sliding_window, n - 7 - 2 * cfg.sliding_window];
    let want = run_layers(&cfg, &Device::Cpu, &xs, &full)?;
    for plain in [false, true] {
        for calls in [full.clone(), chunked.clone(), decode.clone()] {
            let got = if plain {
                deepseek_v41::cuda::with_plain_candle(|| run_layers(&cfg, &dev, &xs, &calls))?
            } else {
                run_layers(&cfg, &dev, &xs, &calls)?
            };
            for l in 0..cfg.num_hidden_layers {
                ensure!(got[l].device().is_cuda());
                // bf16 activations; top-k near-ties may resolve differently (different matmul order).
                let o = compare(&format!("L{l}"), &got[l], &want[l], Tolerance::RelFro { rel_fro: 3e-2, max_abs: None })?;
                ensure!(o.pass, "plain {plain}, calls {:?}: {o}", calls.len());
            }
            // Negative control: another layer's output does not pass.
            let o = compare("L1 vs L2", &got[1], &want[2], Tolerance::RelFro { rel_fro: 3e-2, max_abs: None })?;
            ensure!(!o.pass, "negative control passed: {o}");
        }
    }
    Ok(())
}

/// The number of elements whose bits differ (shapes must agree).
fn differing(a: &Tensor, b: &Tensor) -> Result<usize> {
    ensure!(a.dims() == b.dims(), "shapes {:?} vs {:?}", a.shape(), b.shape());
    Ok(bits(a)?.iter().zip(&bits(b)?).filter(|(x, y)| x != y).count())
}

/// Packed caches (format A window rings, B compressed entries, E index keys) on the GPU give
/// bit for bit the bf16 caches' results: the tiny golden set teacher forced (every golden
/// passes; outputs, window rows, top-k, candidate blocks and cache contents identical) and the
/// head_dim-512 layers (the sparse attention kernel over packed rows, the indexer over packed
/// keys; 141 tokens, so the paged stores of the ratio-1 sources grow over three pages) in full
/// prefill, chunks and prefill + decode. Packed storage with the fake quant off is refused.
#[test]
fn packed_caches_on_the_gpu_equal_bf16_caches() -> Result<()> {
    let dev = gpu();
    for calls in tiny_calls() {
        let (case, bf16) = tiny_run_with(&calls, &dev, CacheStorage::Bf16)?;
        let (_, packed) = tiny_run_with(&calls, &dev, CacheStorage::Packed)?;
        ensure!(packed["L0.attn_out"].device().is_cuda(), "the layer did not run on the GPU");
        let mut report = Report::default();
        compare_produced(&case, &packed, Regime::TeacherForced, &mut report)?;
        ensure!(report.failed() == 0, "calls {}: {} of {} goldens failed with packed caches", calls.len(), report.failed(), report.outcomes.len());
        ensure!(bf16.len() == packed.len() && bf16.len() >= 30, "{} vs {} tensors", bf16.len(), packed.len());
        for (name, t) in &bf16 {
            let d = differing(&packed[name], t)?;
            ensure!(d == 0, "calls {}: {name}: {d} values differ between packed and bf16 caches", calls.len());
        }
    }
    let cfg = config_512()?;
    let n = 141;
    let xs = layer_inputs(&cfg, &mut Rng(0x9ac), n)?;
    let mut decode = vec![n - 8];
    decode.resize(9, 1);
    for calls in [vec![n], vec![7, 2 * cfg.sliding_window + 1, 70, n - 78 - 2 * cfg.sliding_window], decode] {
        let bf16 = run_layers_with(&cfg, &dev, &xs, &calls, CacheStorage::Bf16, 5)?;
        let packed = run_layers_with(&cfg, &dev, &xs, &calls, CacheStorage::Packed, 5)?;
        for l in 0..cfg.num_hidden_layers {
            ensure!(packed[l].device().is_cuda());
            let d = differing(&packed[l], &bf16[l])?;
            ensure!(d == 0, "head_dim 512, calls {calls:?}: layer {l}: {d} values differ between packed and bf16 caches");
        }
        // Negative control: layers differ from each other.
        ensure!(differing(&packed[1], &bf16[2])? > 0, "negative control: layers 1 and 2 agree");
    }
    let plain = Numerics { cache_fake_quant: false, ..Numerics::REFERENCE };
    let vb = RandomWeights::new(5).var_builder(DType::BF16, &dev);
    let l0 = Attention::new(&cfg, 0, plain, vb.pp("layers").pp(0).pp("attn"))?;
    let mut cache = SequenceCache::with_storage(&cfg, CacheStorage::Packed, DType::BF16, &dev)?;
    let err = l0.forward(&xs[0].narrow(0, 0, 2)?.to_device(&dev)?, 0, &mut cache).unwrap_err().to_string();
    ensure!(err.contains("cache_fake_quant"), "{err}");
    Ok(())
}

/// The mHC split kernel (`cuda::split_sinkhorn_device`, what `split_sinkhorn` runs on a GPU)
/// equals the Candle op sequence it replaces on the GPU bit for bit — random mixes of both signs
/// with logits up to ~±30, hc 1..=8 including the model's 4, 1 and 20 iterations, token counts
/// not multiple of the 128-thread block — and the CPU reference to f32 noise (expf differs in the
/// last bits).
#[test]
fn mhc_split_kernel_equals_the_candle_ops() -> Result<()> {
    let dev = gpu();
    let cpu = Device::Cpu;
    let mut rng = Rng(0x5c);
    for (hc, iters, t) in [(4, 20, 37), (4, 1, 3), (1, 5, 2), (3, 7, 300), (8, 20, 129), (4, 20, 1)] {
        let w = (2 + hc) * hc;
        let mut vec = |n: usize, s: f32| (0..n).map(|_| s * rng.normal()).collect::<Vec<f32>>();
        let mixes = Tensor::from_vec(vec(t * w, 3.0), (t, w), &dev)?;
        let scale = Tensor::from_vec(vec(3, 1.5), 3, &dev)?;
        let base = Tensor::from_vec(vec(w, 1.0), w, &dev)?;
        let kernel = split_sinkhorn(&mixes, &scale, &base, hc, iters, 1e-6)?;
        let ops = deepseek_v41::cuda::with_plain_candle(|| split_sinkhorn(&mixes, &scale, &base, hc, iters, 1e-6))?;
        let host = split_sinkhorn(&mixes.to_device(&cpu)?, &scale.to_device(&cpu)?, &base.to_device(&cpu)?, hc, iters, 1e-6)?;
        for (name, k, o, h) in [
            ("pre", &kernel.pre, &ops.pre, &host.pre),
            ("post", &kernel.post, &ops.post, &host.post),
            ("comb", &kernel.comb, &ops.comb, &host.comb),
        ] {
            ensure!(k.device().is_cuda() && k.dims() == o.dims(), "hc {hc}: {name} {:?} vs {:?}", k.shape(), o.shape());
            let (kb, ob) = (bits(k)?, bits(o)?);
            let differ = kb.iter().zip(&ob).filter(|(a, b)| a != b).count();
            ensure!(differ == 0, "hc {hc}, iters {iters}, T {t}: {name}: {differ} of {} values differ from the Candle ops", kb.len());
            let d = (k.to_device(&cpu)? - h)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            ensure!(d < 1e-5, "hc {hc}, iters {iters}: {name} differs from the CPU reference by {d}");
        }
        // Negative control: one more iteration changes comb's bits.
        let more = split_sinkhorn(&mixes, &scale, &base, hc, iters + 1, 1e-6)?;
        ensure!(hc == 1 || bits(&more.comb)? != bits(&kernel.comb)?, "hc {hc}: the iteration count is ignored");
    }
    Ok(())
}
