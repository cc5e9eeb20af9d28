//! FP8 and MXFP4 weights kept in their release format (`loader::native`, `nn::LinearWeight`) on
//! the CPU, over the vendored tiny checkpoint (`tests/fixtures/v41-tiny`): the virtual tensor
//! names exist only under `QuantizedWeights::Native` and only for weights stored in their format
//! (`#e4m3` / `#e8m0` for FP8 32×32 block weights, `#e2m1` / `#e8m0` for the MXFP4 routed
//! experts); they hand out the stored bytes; usage tracking and strictness see the weights
//! loaded; the model's linears are named as their checkpoint tensors and stay dense (f32, the
//! reference) on the CPU under either policy. The CUDA side is `tests/cuda_native_weights.rs`
//! and `tests/cuda_mxfp4.rs`.

use std::path::PathBuf;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use deepseek_v41::golden::GoldenSet;
use deepseek_v41::loader::{var_builder_with, QuantizedWeights, ReleaseCheckpoint, StoredPart, WeightFormat};
use deepseek_v41::model::{Model, ModelCache};
use deepseek_v41::nn::{LinearKind, RandomWeights};
use deepseek_v41::quant::{Fp8Weight, Mxfp4Weight};
use deepseek_v41::Numerics;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny"))
}

fn checkpoint() -> Result<ReleaseCheckpoint> {
    Ok(ReleaseCheckpoint::open(&[fixtures().join("model.safetensors")])?)
}

fn vb(ckpt: &ReleaseCheckpoint, q: QuantizedWeights) -> VarBuilder<'static> {
    var_builder_with(ckpt.clone(), DType::BF16, &Device::Cpu, q)
}

/// The weights of the checkpoint stored as `format`, sorted.
fn weights_of(ckpt: &ReleaseCheckpoint, format: WeightFormat) -> Result<Vec<String>> {
    let mut v = Vec::new();
    for name in ckpt.names() {
        if ckpt.info(&name)?.format == format {
            v.push(name);
        }
    }
    Ok(v)
}

/// The FP8 (32×32 block) weights of the checkpoint, sorted.
fn fp8_weights(ckpt: &ReleaseCheckpoint) -> Result<Vec<String>> {
    weights_of(ckpt, WeightFormat::Fp8Block32)
}

/// The MXFP4 weights of the checkpoint (the routed experts), sorted.
fn mxfp4_weights(ckpt: &ReleaseCheckpoint) -> Result<Vec<String>> {
    weights_of(ckpt, WeightFormat::Mxfp4)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

fn u8s(t: &Tensor) -> Result<Vec<u8>> {
    Ok(t.flatten_all()?.to_vec1::<u8>()?)
}

#[test]
fn virtual_names_exist_only_for_quantized_weights_in_their_format_under_the_native_policy() -> Result<()> {
    let ckpt = checkpoint()?;
    let (fp8, mxfp4) = (fp8_weights(&ckpt)?, mxfp4_weights(&ckpt)?);
    // The fixture's FP8 weights: wq_a, wq_b, wkv, wo_a, wo_b of 9 layers, 4 indexer wq_b, 2 Engram
    // wkv, 3 shared-expert projections of 9 layers (the Engram tables are FP8 rows). MXFP4: the
    // 3 projections of 8 routed experts in 9 layers.
    ensure!(fp8.len() == 9 * 5 + 4 + 2 + 9 * 3, "{} FP8 weights: {fp8:?}", fp8.len());
    ensure!(mxfp4.len() == 9 * 8 * 3, "{} MXFP4 weights: {mxfp4:?}", mxfp4.len());
    ensure!(mxfp4.iter().all(|n| n.contains(".ffn.experts.")), "MXFP4 outside the routed experts: {mxfp4:?}");
    let (native, dequantized) = (vb(&ckpt, QuantizedWeights::Native), vb(&ckpt, QuantizedWeights::Dequantized));
    let random = RandomWeights::new(1).var_builder(DType::BF16, &Device::Cpu);
    for name in ckpt.names() {
        let (is_fp8, is_mxfp4) = (fp8.contains(&name), mxfp4.contains(&name));
        for part in StoredPart::ALL {
            let v = part.name(&name);
            let expected = match part {
                StoredPart::Codes => is_fp8,
                StoredPart::Fp4Codes => is_mxfp4,
                StoredPart::Scales => is_fp8 || is_mxfp4,
            };
            ensure!(native.contains_tensor(&v) == expected, "native: {v}");
            ensure!(ckpt.has_stored_part(&name, part) == expected, "checkpoint: {v}");
            ensure!(!dequantized.contains_tensor(&v), "dequantized: {v}");
            ensure!(!random.contains_tensor(&v), "random weights: {v}");
        }
        ensure!(ckpt.is_mxfp4(&name) == is_mxfp4 && ckpt.is_fp8_block32(&name) == is_fp8, "{name}");
        // The real names are unchanged.
        ensure!(native.contains_tensor(&name) && dequantized.contains_tensor(&name), "{name}");
    }
    for w in ["layers.0.ffn.experts.0.w1.weight", "layers.0.engram.embed.weight", "head.weight", "missing.weight"] {
        ensure!(!native.contains_tensor(&StoredPart::Codes.name(w)), "{w}");
    }
    for w in ["layers.0.attn.wq_a.weight", "layers.0.ffn.shared_experts.w1.weight", "layers.0.engram.embed.weight", "head.weight", "missing.weight"] {
        ensure!(!native.contains_tensor(&StoredPart::Fp4Codes.name(w)), "{w}");
    }
    ensure!(native.contains_tensor(&StoredPart::Fp4Codes.name("layers.8.ffn.experts.7.w2.weight")));
    ensure!(random.contains_tensor("anything.weight"));
    Ok(())
}

#[test]
fn stored_parts_are_the_stored_bytes() -> Result<()> {
    let ckpt = checkpoint()?;
    let native = vb(&ckpt, QuantizedWeights::Native);
    for name in fp8_weights(&ckpt)? {
        let info = ckpt.info(&name)?;
        let scale = info.scale.as_ref().expect("FP8 weights have a scale");
        let codes = native.get_with_hints_dtype(info.stored.shape.as_slice(), &StoredPart::Codes.name(&name), Default::default(), DType::U8)?;
        let scales = native.get_with_hints_dtype(scale.shape.as_slice(), &StoredPart::Scales.name(&name), Default::default(), DType::U8)?;
        ensure!(codes.dtype() == DType::U8 && codes.dims() == info.stored.shape.as_slice(), "{name}: codes {:?}", codes.shape());
        ensure!(u8s(&codes)? == ckpt.raw_bytes(&name)?, "{name}: codes differ from the stored bytes");
        ensure!(u8s(&scales)? == ckpt.raw_bytes(&scale.name)?, "{name}: scales differ from the stored bytes");
        // Together they are the weight the dense path dequantizes, bit for bit.
        let w = Fp8Weight::new(codes, scales)?.dequantize(DType::F32)?;
        let dense = ckpt.get(&name, DType::F32, &Device::Cpu)?;
        ensure!(bits(&w)? == bits(&dense)?, "{name}: dequantized parts differ from the dense weight");
    }
    Ok(())
}

#[test]
fn mxfp4_stored_parts_are_the_stored_bytes() -> Result<()> {
    let ckpt = checkpoint()?;
    let native = vb(&ckpt, QuantizedWeights::Native);
    let mxfp4 = mxfp4_weights(&ckpt)?;
    let mut nibbles = [false; 16];
    for name in &mxfp4 {
        let info = ckpt.info(name)?;
        let scale = info.scale.as_ref().expect("MXFP4 weights have a scale");
        let (out, inp) = (info.shape[0], info.shape[1]);
        // The stored shapes: [out, in/2] packed codes, [out, in/32] scales.
        ensure!(info.stored.shape == [out, inp / 2] && scale.shape == [out, inp / 32], "{name}: {:?} / {:?}", info.stored.shape, scale.shape);
        let codes = native.get_with_hints_dtype((out, inp / 2), &StoredPart::Fp4Codes.name(name), Default::default(), DType::U8)?;
        let scales = native.get_with_hints_dtype((out, inp / 32), &StoredPart::Scales.name(name), Default::default(), DType::U8)?;
        ensure!(codes.dtype() == DType::U8 && scales.dtype() == DType::U8, "{name}");
        let code_bytes = u8s(&codes)?;
        ensure!(code_bytes == ckpt.raw_bytes(name)?, "{name}: codes differ from the stored (I8) bytes");
        ensure!(u8s(&scales)? == ckpt.raw_bytes(&scale.name)?, "{name}: scales differ from the stored bytes");
        code_bytes.iter().for_each(|&b| (nibbles[(b & 0x0f) as usize], nibbles[(b >> 4) as usize]) = (true, true));
        // Together they are the weight the dense path dequantizes, bit for bit (f32 and bf16,
        // "-0" as +0 like the loader).
        let w = Mxfp4Weight::new(codes, scales)?;
        ensure!(w.dims() == (out, inp) && w.bytes() == info.stored.byte_range.len() + scale.byte_range.len(), "{name}");
        for dtype in [DType::F32, DType::BF16] {
            let dense = ckpt.get(name, dtype, &Device::Cpu)?;
            ensure!(bits(&w.dequantize(dtype)?)? == bits(&dense)?, "{name}: dequantized parts differ from the dense weight ({dtype:?})");
        }
    }
    // The fixture's codes cover every value but "-0" (code 8, which its writer never emits; the
    // unit tests of quant::mxfp4_weight cover it).
    ensure!(nibbles.iter().filter(|&&b| b).count() >= 15, "codes seen: {nibbles:?}");
    Ok(())
}

#[test]
fn bad_requests_are_errors_naming_the_tensor() -> Result<()> {
    let ckpt = checkpoint()?;
    let native = vb(&ckpt, QuantizedWeights::Native);
    let codes = StoredPart::Codes.name("layers.0.attn.wq_a.weight");
    let (out, inp) = (ckpt.info("layers.0.attn.wq_a.weight")?.shape[0], ckpt.info("layers.0.attn.wq_a.weight")?.shape[1]);
    let e = native.get_with_hints_dtype((out, inp), &codes, Default::default(), DType::F32).unwrap_err().to_string();
    ensure!(e.contains(&codes) && e.contains("u8"), "{e}");
    let e = native.get_with_hints_dtype((out, inp + 1), &codes, Default::default(), DType::U8).unwrap_err().to_string();
    ensure!(e.contains(&codes) && e.contains(&format!("[{out}, {}]", inp + 1)), "{e}");
    let e = vb(&ckpt, QuantizedWeights::Dequantized).get_with_hints_dtype((out, inp), &codes, Default::default(), DType::U8).unwrap_err().to_string();
    ensure!(e.contains(&codes) && e.contains("dequantized"), "{e}");
    // The parts of the other format are errors both ways.
    let expert = "layers.0.ffn.experts.0.w1.weight";
    ensure!(native.get_unchecked_dtype(&StoredPart::Codes.name(expert), DType::U8).is_err());
    let e = ckpt.get_stored_part(expert, StoredPart::Codes, &Device::Cpu).unwrap_err().to_string();
    ensure!(e.contains(expert) && e.contains("Mxfp4") && e.contains("#e4m3"), "{e}");
    let e = native.get_unchecked_dtype(&StoredPart::Fp4Codes.name("layers.0.attn.wq_a.weight"), DType::U8).unwrap_err().to_string();
    ensure!(e.contains("layers.0.attn.wq_a.weight#e2m1"), "{e}");
    let e = ckpt.get_stored_part("layers.0.attn.wq_a.weight", StoredPart::Fp4Codes, &Device::Cpu).unwrap_err().to_string();
    ensure!(e.contains("Fp8Block32") && e.contains("#e2m1"), "{e}");
    // MXFP4 parts: the dtype, the stored shape, the policy.
    let (eo, ei) = (ckpt.info(expert)?.shape[0], ckpt.info(expert)?.shape[1]);
    let fp4 = StoredPart::Fp4Codes.name(expert);
    let e = native.get_with_hints_dtype((eo, ei / 2), &fp4, Default::default(), DType::BF16).unwrap_err().to_string();
    ensure!(e.contains(&fp4) && e.contains("u8"), "{e}");
    let e = native.get_with_hints_dtype((eo, ei), &fp4, Default::default(), DType::U8).unwrap_err().to_string();
    ensure!(e.contains(&fp4) && e.contains(&format!("[{eo}, {ei}]")), "{e}");
    let e = native.get_with_hints_dtype((eo, ei / 32 + 1), &StoredPart::Scales.name(expert), Default::default(), DType::U8).unwrap_err().to_string();
    ensure!(e.contains(&format!("[{eo}, {}]", ei / 32 + 1)), "{e}");
    let e = vb(&ckpt, QuantizedWeights::Dequantized).get_unchecked_dtype(&fp4, DType::U8).unwrap_err().to_string();
    ensure!(e.contains(&fp4) && e.contains("dequantized"), "{e}");
    ensure!(native.get_unchecked_dtype(&fp4, DType::U8)?.dims() == [eo, ei / 2]);
    // Without a shape the stored shape comes back.
    ensure!(native.get_unchecked_dtype(&codes, DType::U8)?.dims() == [out, inp]);
    Ok(())
}

#[test]
fn usage_and_strictness_see_the_weights_loaded() -> Result<()> {
    // Every FP8 weight through its codes only, every MXFP4 weight through its packed codes only,
    // everything else dense: nothing is unused.
    let ckpt = checkpoint()?;
    let native = vb(&ckpt, QuantizedWeights::Native);
    let (fp8, mxfp4) = (fp8_weights(&ckpt)?, mxfp4_weights(&ckpt)?);
    for name in ckpt.names() {
        if fp8.contains(&name) {
            native.get_unchecked_dtype(&StoredPart::Codes.name(&name), DType::U8)?;
        } else if mxfp4.contains(&name) {
            native.get_unchecked_dtype(&StoredPart::Fp4Codes.name(&name), DType::U8)?;
        } else {
            native.get_unchecked_dtype(&name, DType::F32)?;
        }
    }
    ckpt.check_all_used(&[])?;
    let used = ckpt.used_names();
    ensure!(used.iter().all(|n| !n.contains('#') && !n.ends_with(".scale")), "virtual or companion names recorded: {used:?}");
    ensure!(fp8.iter().chain(&mxfp4).all(|n| used.contains(n)));

    // Scales only: the weight counts as used too (FP8 and MXFP4).
    for w in ["layers.2.attn.wo_b.weight", "layers.2.ffn.experts.5.w3.weight"] {
        let ckpt = checkpoint()?;
        vb(&ckpt, QuantizedWeights::Native).get_unchecked_dtype(&StoredPart::Scales.name(w), DType::U8)?;
        ensure!(ckpt.used_names() == [w.to_string()]);
    }
    let w = "layers.2.attn.wo_b.weight";

    // Collect mode: a mis-shaped request is recorded under its virtual name, the weight is
    // marked requested (not reported unused as well), and a zero stand-in comes back.
    let ckpt = checkpoint()?;
    ckpt.set_collect_missing(true);
    let native = vb(&ckpt, QuantizedWeights::Native);
    let codes = StoredPart::Codes.name(w);
    let stand_in = native.get_with_hints_dtype((3, 5), &codes, Default::default(), DType::U8)?;
    ensure!(stand_in.dims() == [3, 5] && u8s(&stand_in)?.iter().all(|&b| b == 0));
    let problems = ckpt.load_problems();
    ensure!(problems.len() == 1 && problems[0].contains(&codes), "{problems:?}");
    ensure!(!ckpt.unused_names(&[]).contains(&w.to_string()));
    Ok(())
}

/// The model under the native policy on the CPU: every linear named as its checkpoint tensor,
/// every weight dense f32, and the logits bit for bit those of the dequantized policy.
#[test]
fn the_model_on_the_cpu_stays_dense_under_either_policy() -> Result<()> {
    let set = GoldenSet::open(fixtures())?;
    let case = set.load_case(&set.root.join("prefill_full"), &Device::Cpu)?;
    let map = set.token_map(&case)?;
    let tokens = &case.inputs.input_ids[..12];
    let mut logits = Vec::new();
    for q in [QuantizedWeights::Native, QuantizedWeights::Dequantized] {
        let ckpt = checkpoint()?;
        let model = Model::new(&case.config, Numerics::REFERENCE, map.clone(), vb(&ckpt, q))?;
        ckpt.check_all_used(&[])?;
        let linears = model.linears();
        let quantized_fp8 = linears.iter().filter(|(n, l)| l.kind() == LinearKind::Quantized && ckpt.is_fp8_block32(&format!("{n}.weight"))).count();
        // Every FP8 weight but the grouped wo_a (`nn::GroupedLinear`, not a linear) belongs to a quantized linear.
        ensure!(quantized_fp8 == fp8_weights(&ckpt)?.len() - 9, "{q}: {quantized_fp8} quantized linears over FP8 weights");
        for (name, l) in &linears {
            ensure!(ckpt.contains(&format!("{name}.weight")), "{q}: linear `{name}` has no checkpoint tensor `{name}.weight`");
            let w = l.weight().dense().ok_or_else(|| anyhow::anyhow!("{q}: `{name}` is not dense on the CPU"))?;
            ensure!(w.dtype() == DType::F32, "{q}: `{name}` is {:?}", w.dtype());
            ensure!(l.weight().bytes() == w.elem_count() * 4);
        }
        let mut cache = ModelCache::new(&case.config, DType::BF16, &Device::Cpu)?;
        logits.push(model.forward(tokens, &mut cache)?.flatten_all()?.to_vec1::<f32>()?);
    }
    ensure!(logits[0] == logits[1], "the policies' CPU logits differ");
    ensure!(logits[0].iter().any(|&v| v != 0.0) && logits[0].iter().all(|v| v.is_finite()));
    Ok(())
}
