//! Strict loading of a whole model folder (`Pretrained::load_dir`) on damaged copies of the
//! embedded Shakespeare model: a tensor removed, renamed, mis-shaped, a truncated file or shard, a
//! missing shard; the intact sharded copy gives the single file's logits; MTP and vision tensors
//! are skipped while an unknown text tensor is reported.
//!
//! Every variant is the real `model.safetensors` read with the `safetensors` crate, modified and
//! written back into a unique temporary folder next to copies of `config.json` and
//! `tokenizer.json`. Each error message is printed and checked for the tensor / file it names.

use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use deepseek_v41::loader::ReleaseCheckpoint;
use deepseek_v41::model::Pretrained;
use deepseek_v41::Numerics;
use safetensors::Dtype;

#[path = "support/release_writer.rs"]
mod release_writer;
use release_writer::{bf16_bytes, bytes, f32_bytes, raw, read_st, scales, write_sharded, write_st, Raw, TempDir};

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/v41-shakespeare-tiny")
}

/// The embedded model's tensors, as stored.
fn original() -> Result<Vec<Raw>> {
    read_st(&model_dir().join("model.safetensors"))
}

/// A temporary model folder with the embedded model's config and tokenizer, no checkpoint.
fn folder(tag: &str) -> Result<TempDir> {
    let dir = TempDir::new(&format!("pretrained-{tag}"))?;
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(model_dir().join(f), dir.0.join(f))?;
    }
    Ok(dir)
}

/// A temporary model folder whose `model.safetensors` holds `tensors`.
fn folder_with(tag: &str, tensors: &[Raw]) -> Result<TempDir> {
    let dir = folder(tag)?;
    write_st(&dir.0.join("model.safetensors"), tensors)?;
    Ok(dir)
}

fn load(dir: &Path) -> candle_core::Result<Pretrained> {
    Pretrained::load_dir(dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)
}

/// The error of loading `dir` (printed); panics if it loads.
fn load_err(case: &str, dir: &Path) -> String {
    match load(dir) {
        Ok(_) => panic!("{case}: the damaged folder loaded"),
        Err(e) => {
            let e = e.to_string();
            println!("{case}: {e}");
            e
        }
    }
}

fn without(t: &[Raw], names: &[&str]) -> Vec<Raw> {
    let v: Vec<Raw> = t.iter().filter(|r| !names.contains(&r.name.as_str())).cloned().collect();
    assert_eq!(v.len(), t.len() - names.len(), "all of {names:?} exist");
    v
}

fn find<'a>(t: &'a mut [Raw], name: &str) -> &'a mut Raw {
    t.iter_mut().find(|r| r.name == name).unwrap_or_else(|| panic!("{name} exists"))
}

/// Logits of a short prompt, as f32 bits.
fn logits(p: &Pretrained) -> Result<Vec<u32>> {
    let ids = p.tokenizer.encode("ROMEO:\nBut soft, what light", true)?;
    let mut cache = p.new_cache()?;
    let t: Tensor = p.model.forward(&ids, &mut cache)?;
    Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
}

#[test]
fn intact_copy_loads() -> Result<()> {
    // Positive control for every case below: the unmodified tensors, rewritten, load.
    let dir = folder_with("intact", &original()?)?;
    let p = load(&dir.0)?;
    assert_eq!(logits(&p)?, logits(&load(&model_dir())?)?);
    Ok(())
}

#[test]
fn removed_tensor_is_named() -> Result<()> {
    let t = original()?;
    // (a) A quantized weight removed with its scale: the logical tensor is missing.
    let name = "layers.2.attn.wq_b.weight";
    let dir = folder_with("removed", &without(&t, &[name, "layers.2.attn.wq_b.scale"]))?;
    let e = load_err("removed", &dir.0);
    assert!(e.contains(&format!("tensor `{name}` not found in the checkpoint")), "{e}");
    assert!(e.contains("1 missing or malformed"), "{e}");
    assert!(!e.contains("unexpected"), "nothing unexpected: {e}");

    // Only the scale removed: the weight is named with its lost companion.
    let dir = folder_with("scale-removed", &without(&t, &["layers.2.attn.wq_b.scale"]))?;
    let e = load_err("scale removed", &dir.0);
    assert!(e.contains(name) && e.contains("without its scale companion `layers.2.attn.wq_b.scale`"), "{e}");
    assert!(!e.contains("unexpected"), "a malformed tensor is not also unexpected: {e}");

    // Only the weight removed: it is missing and its orphan scale is unexpected.
    let dir = folder_with("weight-removed", &without(&t, &[name]))?;
    let e = load_err("weight removed", &dir.0);
    assert!(e.contains(&format!("tensor `{name}` not found")), "{e}");
    assert!(e.contains("unexpected") && e.contains("layers.2.attn.wq_b.scale"), "{e}");
    Ok(())
}

#[test]
fn renamed_tensor_is_missing_and_unexpected() -> Result<()> {
    // (b) `norm.weight` stored under a Hugging Face style name: one error names both.
    let mut t = original()?;
    find(&mut t, "norm.weight").name = "model.norm.weight".to_string();
    let dir = folder_with("renamed", &t)?;
    let e = load_err("renamed", &dir.0);
    assert!(e.contains("tensor `norm.weight` not found in the checkpoint"), "{e}");
    assert!(e.contains("1 unexpected") && e.contains("model.norm.weight"), "{e}");
    Ok(())
}

#[test]
fn wrong_shapes_are_named_with_both_shapes() -> Result<()> {
    // (c) A BF16 embedding with fewer rows, and an MXFP4 expert with a narrower input (its scale
    // resized to match, so only the logical shape is wrong): both in one error.
    let mut t = original()?;
    let embed = find(&mut t, "embed.weight");
    embed.shape = vec![4000, 192];
    embed.data.truncate(4000 * 192 * 2);
    let w1 = "layers.3.ffn.experts.5.w1";
    let w = find(&mut t, &format!("{w1}.weight"));
    assert_eq!(w.shape, [96, 96], "packed [out, in/2]");
    w.shape = vec![96, 80];
    w.data.truncate(96 * 80);
    let s = find(&mut t, &format!("{w1}.scale"));
    s.shape = vec![96, 5];
    s.data.truncate(96 * 5);
    let dir = folder_with("shape", &t)?;
    let e = load_err("wrong shape", &dir.0);
    assert!(e.contains("2 missing or malformed"), "{e}");
    assert!(
        e.contains("tensor `embed.weight` has shape [4000, 192] in the checkpoint, expected [4096, 192]"),
        "{e}"
    );
    assert!(
        e.contains(&format!("tensor `{w1}.weight` has shape [96, 160] in the checkpoint, expected [96, 192]")),
        "{e}"
    );
    assert!(!e.contains("unexpected"), "mis-shaped tensors are not also unexpected: {e}");
    Ok(())
}

#[test]
fn truncated_file_names_the_file_and_a_tensor() -> Result<()> {
    // (d) The single file cut at 60 %.
    let dir = folder_with("truncated", &original()?)?;
    let path = dir.0.join("model.safetensors");
    let full = std::fs::read(&path)?;
    std::fs::write(&path, &full[..full.len() * 3 / 5])?;
    let e = load_err("truncated", &dir.0);
    assert!(e.contains(&path.display().to_string()) && e.contains("is truncated"), "{e}");
    assert!(e.contains("tensor `") && e.contains("data ends at byte"), "{e}");
    Ok(())
}

/// A folder holding the embedded model as two shards plus `model.safetensors.index.json`.
fn sharded(tag: &str) -> Result<(TempDir, [String; 2])> {
    let dir = folder(tag)?;
    let shards = write_sharded(&dir.0, &original()?)?;
    Ok((dir, shards))
}

#[test]
fn missing_or_truncated_shard_is_named() -> Result<()> {
    // (e) The second shard deleted.
    let (dir, shards) = sharded("shard-missing")?;
    std::fs::remove_file(dir.0.join(&shards[1]))?;
    let e = load_err("missing shard", &dir.0);
    assert!(e.contains(&shards[1]) && e.contains("is missing"), "{e}");
    assert!(e.contains("model.safetensors.index.json") && e.contains("tensor `"), "{e}");

    // The first shard truncated by one byte.
    let (dir, shards) = sharded("shard-truncated")?;
    let path = dir.0.join(&shards[0]);
    let full = std::fs::read(&path)?;
    std::fs::write(&path, &full[..full.len() - 1])?;
    let e = load_err("truncated shard", &dir.0);
    assert!(e.contains(&shards[0]) && e.contains("is truncated") && e.contains("tensor `"), "{e}");
    Ok(())
}

#[test]
fn sharded_copy_gives_the_single_file_logits() -> Result<()> {
    // (f) Weights and their scales are split across shards on purpose (see `write_sharded`).
    let (dir, shards) = sharded("shard-ok")?;
    let files = ReleaseCheckpoint::open_dir(&dir.0)?.files();
    assert_eq!(files.len(), 2);
    assert!(files.iter().zip(&shards).all(|(f, s)| f.ends_with(s)));
    let single = load(&model_dir())?;
    let split = load(&dir.0)?;
    let (a, b) = (logits(&single)?, logits(&split)?);
    assert!(!a.is_empty());
    assert_eq!(a, b, "sharded and single-file logits differ");
    Ok(())
}

#[test]
fn mtp_and_vision_are_skipped_unknown_text_tensors_are_not() -> Result<()> {
    // (g) An MTP head (an FP8 weight with its scale, an f32 mHC tensor) and vision tensors are
    // recognised and left unloaded; the model is unchanged.
    let mut t = original()?;
    t.extend([
        raw("mtp.0.main_proj.weight", Dtype::F8_E4M3, &[192, 384], bytes(192 * 384, 1, true)),
        raw("mtp.0.main_proj.scale", Dtype::F8_E8M0, &[6, 12], scales(72, 2)),
        raw("mtp.0.hc_head_fn", Dtype::F32, &[4, 768], f32_bytes(&vec![0.5; 4 * 768])),
        raw("vision.patch_embed.proj.weight", Dtype::BF16, &[8, 12], bf16_bytes(&[0.25; 96])),
        raw("aligner.fc1.weight", Dtype::BF16, &[4, 4], bf16_bytes(&[1.0; 16])),
    ]);
    let dir = folder_with("extra", &t)?;
    let p = load(&dir.0)?;
    assert_eq!(logits(&p)?, logits(&load(&model_dir())?)?);

    // An unknown tensor among the text model's is reported as unexpected.
    t.push(raw("layers.0.attn.bogus", Dtype::BF16, &[4], bf16_bytes(&[1.0; 4])));
    let dir = folder_with("bogus", &t)?;
    let e = load_err("bogus", &dir.0);
    assert!(e.contains("1 unexpected") && e.contains("layers.0.attn.bogus"), "{e}");
    assert!(!e.contains("mtp.") && !e.contains("vision.") && !e.contains("aligner."), "{e}");
    assert!(!e.contains("missing or malformed"), "nothing missing: {e}");
    Ok(())
}
