//! Release-checkpoint loader: golden dequantization, the tiny golden checkpoint through the
//! `VarBuilder`, round trips of written checkpoints (single file and sharded), and error cases.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use deepseek_v41::loader::{
    dequant_fp8_block32, dequant_fp8_rows, dequant_mxfp4, var_builder, ReleaseCheckpoint, WeightFormat,
};
use deepseek_v41::quant::formats::{e2m1_to_f32, e4m3_to_f32};
use safetensors::Dtype;

#[path = "support/release_writer.rs"]
mod release_writer;
use release_writer::{bf16_bytes, bytes, f32_bytes, raw, scales, write_sharded, write_st, Raw, TempDir};
#[path = "support/release_shapes.rs"]
mod release_shapes;
use release_shapes::expected_shapes;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny");

fn tiny_model() -> PathBuf {
    Path::new(FIXTURES).join("model.safetensors")
}

fn golden() -> Result<HashMap<String, Tensor>> {
    Ok(candle_core::safetensors::load(
        Path::new(FIXTURES).join("modules/golden.safetensors"),
        &Device::Cpu,
    )?)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?
        .iter()
        .map(|x| x.to_bits())
        .collect())
}

fn u8s(t: &Tensor) -> Result<Vec<u8>> {
    Ok(t.flatten_all()?.to_vec1::<u8>()?)
}

fn f32_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

// ---------------------------------------------------------------------------------------------
// Golden dequantization (modules/golden.safetensors `dq.*`), bit for bit.

#[test]
fn golden_dequant_functions() -> Result<()> {
    let g = golden()?;
    for prefix in ["dq.fp8.crafted", "dq.fp8.layers.0.attn.wq_a"] {
        let (w, s, out) = (
            &g[&format!("{prefix}.weight_e4m3")],
            &g[&format!("{prefix}.scale_e8m0")],
            &g[&format!("{prefix}.out")],
        );
        let (o, i) = w.dims2()?;
        let got = dequant_fp8_block32(&u8s(w)?, &u8s(s)?, o, i)?;
        assert_eq!(f32_bits(&got), bits(out)?, "{prefix}");
    }
    for prefix in ["dq.mxfp4.crafted", "dq.mxfp4.layers.0.ffn.experts.0.w1"] {
        let (w, s, out) = (
            &g[&format!("{prefix}.weight_packed")],
            &g[&format!("{prefix}.scale_e8m0")],
            &g[&format!("{prefix}.out")],
        );
        let (o, i) = out.dims2()?;
        let got = dequant_mxfp4(&u8s(w)?, &u8s(s)?, o, i)?;
        assert_eq!(f32_bits(&got), bits(out)?, "{prefix}");
    }
    // Negative control: the opposite nibble order (high nibble = even index) must not
    // reproduce the golden weight.
    let (w, s, out) = (
        &g["dq.mxfp4.layers.0.ffn.experts.0.w1.weight_packed"],
        &g["dq.mxfp4.layers.0.ffn.experts.0.w1.scale_e8m0"],
        &g["dq.mxfp4.layers.0.ffn.experts.0.w1.out"],
    );
    let (o, i) = out.dims2()?;
    let swapped: Vec<u8> = u8s(w)?.iter().map(|b| b.rotate_left(4)).collect();
    let wrong = dequant_mxfp4(&swapped, &u8s(s)?, o, i)?;
    assert_ne!(f32_bits(&wrong), bits(out)?);
    Ok(())
}

#[test]
fn golden_checkpoint_weights_bit_exact() -> Result<()> {
    let g = golden()?;
    let ckpt = ReleaseCheckpoint::open(&[tiny_model()])?;
    // The golden bytes are the checkpoint's bytes.
    assert_eq!(
        ckpt.raw_bytes("layers.0.attn.wq_a.weight")?,
        &u8s(&g["dq.fp8.layers.0.attn.wq_a.weight_e4m3"])?[..]
    );
    assert_eq!(
        ckpt.raw_bytes("layers.0.attn.wq_a.scale")?,
        &u8s(&g["dq.fp8.layers.0.attn.wq_a.scale_e8m0"])?[..]
    );

    let wq_a = ckpt.get("layers.0.attn.wq_a.weight", DType::F32, &Device::Cpu)?;
    assert_eq!(wq_a.dims(), &[64, 256]);
    assert_eq!(bits(&wq_a)?, bits(&g["dq.fp8.layers.0.attn.wq_a.out"])?);
    let w1 = ckpt.get("layers.0.ffn.experts.0.w1.weight", DType::F32, &Device::Cpu)?;
    assert_eq!(w1.dims(), &[64, 256]);
    assert_eq!(bits(&w1)?, bits(&g["dq.mxfp4.layers.0.ffn.experts.0.w1.out"])?);

    // Through the VarBuilder, in bf16: FP8/FP4 values are exact in bf16.
    let vb = var_builder(ckpt.clone(), DType::BF16, &Device::Cpu);
    let wq_a16 = vb.pp("layers.0.attn.wq_a").get((64, 256), "weight")?;
    assert_eq!(wq_a16.dtype(), DType::BF16);
    assert_eq!(bits(&wq_a16)?, bits(&g["dq.fp8.layers.0.attn.wq_a.out"])?);
    let w1_16 = vb.pp("layers.0.ffn.experts.0.w1").get((64, 256), "weight")?;
    assert_eq!(bits(&w1_16)?, bits(&g["dq.mxfp4.layers.0.ffn.experts.0.w1.out"])?);

    // Negative control: the same bytes read as 1x32 row blocks (wrong layout) differ.
    let wrong = dequant_fp8_rows(
        &u8s(&g["dq.fp8.layers.0.attn.wq_a.weight_e4m3"])?[..256 * 2],
        &u8s(&g["dq.fp8.layers.0.attn.wq_a.scale_e8m0"])?,
        2,
        256,
    )?;
    assert_ne!(
        f32_bits(&wrong)[256..],
        bits(&g["dq.fp8.layers.0.attn.wq_a.out"])?[256..512]
    );
    Ok(())
}

#[test]
fn golden_engram_rows() -> Result<()> {
    let g = golden()?;
    let ckpt = ReleaseCheckpoint::open(&[tiny_model()])?;
    let name = "layers.1.engram.embed.weight";
    assert_eq!(ckpt.info(name)?.format, WeightFormat::Fp8Rows);
    let ids: Vec<usize> = g["dq.engram.L1.ids"]
        .to_vec1::<i32>()?
        .iter()
        .map(|&i| i as usize)
        .collect();
    let rows = ckpt.get_raw_rows(name, &ids, DType::BF16, &Device::Cpu)?;
    assert_eq!(rows.dims(), &[4, 32]);
    assert_eq!(bits(&rows)?, bits(&g["dq.engram.L1.rows"])?);
    // Tensor-id form keeps the id shape.
    let id_t = Tensor::new(
        &[[ids[0] as u32, ids[1] as u32], [ids[2] as u32, ids[3] as u32]],
        &Device::Cpu,
    )?;
    let rows2 = ckpt.lookup_rows(name, &id_t, DType::BF16)?;
    assert_eq!(rows2.dims(), &[2, 2, 32]);
    assert_eq!(bits(&rows2)?, bits(&g["dq.engram.L1.rows"])?);
    // Same as slicing the whole dequantized table.
    let table = ckpt.get(name, DType::BF16, &Device::Cpu)?;
    let idx = Tensor::new(ids.iter().map(|&i| i as u32).collect::<Vec<_>>(), &Device::Cpu)?;
    assert_eq!(bits(&table.index_select(&idx, 0)?)?, bits(&rows)?);
    // Out-of-range and negative ids are errors naming the table.
    let e = ckpt
        .get_raw_rows(name, &[420], DType::BF16, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("row 420") && e.contains("420 rows") && e.contains(name),
        "{e}"
    );
    let neg = Tensor::new(&[-1i64], &Device::Cpu)?;
    let e = ckpt.lookup_rows(name, &neg, DType::BF16).unwrap_err().to_string();
    assert!(e.contains("row -1") && e.contains(name), "{e}");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Every tensor of the tiny checkpoint through the VarBuilder, with the shapes the spec implies.

#[test]
fn tiny_checkpoint_every_tensor_via_var_builder() -> Result<()> {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(FIXTURES).join("config.json"))?)?;
    let expected = expected_shapes(&cfg);
    let ckpt = ReleaseCheckpoint::open_dir(FIXTURES)?;
    let names = ckpt.names();
    assert_eq!(
        names,
        expected.keys().cloned().collect::<Vec<_>>(),
        "logical names = spec's text tensors"
    );
    // Every stored `.scale` is a companion, hidden from the logical names.
    let companions: Vec<String> = ckpt.stored_names().into_iter().filter(|n| !names.contains(n)).collect();
    assert!(!companions.is_empty() && companions.iter().all(|n| n.ends_with(".scale") && ckpt.is_companion(n)));

    let vb = var_builder(ckpt.clone(), DType::BF16, &Device::Cpu);
    assert!(ckpt.check_all_used(&[]).is_err(), "nothing requested yet");
    for (name, shape) in &expected {
        if name.ends_with("bias_vl") {
            continue; // unused for text; ignored by the strictness check
        }
        let t = vb.get(shape.as_slice(), name)?;
        assert_eq!(t.dims(), shape.as_slice(), "{name}");
        assert_eq!(t.dtype(), DType::BF16);
        let f = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(f.iter().all(|x| x.is_finite()), "{name} has non-finite values");
        let expect_format = match name {
            n if n.contains(".experts.") && !n.contains("shared") => WeightFormat::Mxfp4,
            n if n.ends_with("engram.embed.weight") => WeightFormat::Fp8Rows,
            n if ckpt.info(n)?.stored.dtype.name() == "F8_E4M3" => WeightFormat::Fp8Block32,
            _ => WeightFormat::Plain,
        };
        assert_eq!(ckpt.info(name)?.format, expect_format, "{name}");
    }
    ckpt.check_all_used(&[])?;
    assert!(ckpt
        .names()
        .iter()
        .filter(|n| !n.ends_with("bias_vl"))
        .all(|n| ckpt.used_names().contains(n)));
    // F32 tensors keep their values when read as f32.
    let sink = vb.get_with_hints_dtype(4, "layers.0.attn.attn_sink", Default::default(), DType::F32)?;
    assert_eq!(sink.dtype(), DType::F32);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Writing checkpoints in the release format.

fn pow2(b: u8) -> f32 {
    2f32.powi(b as i32 - 127)
}

/// A small release-format checkpoint with every storage kind, dims not multiples of 32, and
/// the tensors an implementation must ignore (`mtp.`).
fn synthetic() -> Vec<Raw> {
    let emb: Vec<f32> = (0..24).map(|i| i as f32 * 0.25 - 3.0).collect();
    vec![
        raw("embed.weight", Dtype::BF16, &[4, 6], bf16_bytes(&emb)),
        raw(
            "layers.0.attn.wq_a.weight",
            Dtype::F8_E4M3,
            &[40, 48],
            bytes(40 * 48, 1, true),
        ),
        raw("layers.0.attn.wq_a.scale", Dtype::F8_E8M0, &[2, 2], scales(4, 2)),
        raw(
            "layers.0.ffn.experts.0.w1.weight",
            Dtype::I8,
            &[3, 24],
            bytes(3 * 24, 3, false),
        ),
        raw("layers.0.ffn.experts.0.w1.scale", Dtype::F8_E8M0, &[3, 2], scales(6, 4)),
        raw(
            "layers.0.engram.embed.weight",
            Dtype::F8_E4M3,
            &[5, 64],
            bytes(5 * 64, 5, true),
        ),
        raw("layers.0.engram.embed.scale", Dtype::F8_E8M0, &[5, 2], scales(10, 6)),
        raw(
            "layers.0.hc_attn_fn",
            Dtype::F32,
            &[3, 4],
            f32_bytes(&[1.5, -2.0, 3.25, 0.0, 1e-30, 7.0, 8.0, 9.0, -1.0, 2.0, 3.0, 4.0]),
        ),
        raw("mtp.0.norm.weight", Dtype::BF16, &[2], bf16_bytes(&[1.0, 2.0])),
    ]
}

/// Independent element-wise dequantization of the synthetic weights.
fn expected_synthetic(name: &str, t: &[Raw]) -> Vec<f32> {
    let get = |n: &str| t.iter().find(|r| r.name == n).unwrap().data.clone();
    match name {
        "layers.0.attn.wq_a.weight" => {
            let (w, s) = (get(name), get("layers.0.attn.wq_a.scale"));
            (0..40 * 48)
                .map(|k| e4m3_to_f32(w[k]) * pow2(s[(k / 48 / 32) * 2 + (k % 48) / 32]) + 0.0)
                .collect()
        }
        "layers.0.ffn.experts.0.w1.weight" => {
            let (w, s) = (get(name), get("layers.0.ffn.experts.0.w1.scale"));
            (0..3 * 48)
                .map(|k| {
                    let (r, c) = (k / 48, k % 48);
                    let byte = w[r * 24 + c / 2];
                    let code = if c % 2 == 0 { byte & 0xf } else { byte >> 4 };
                    e2m1_to_f32(code) * pow2(s[r * 2 + c / 32]) + 0.0
                })
                .collect()
        }
        "layers.0.engram.embed.weight" => {
            let (w, s) = (get(name), get("layers.0.engram.embed.scale"));
            (0..5 * 64)
                .map(|k| e4m3_to_f32(w[k]) * pow2(s[(k / 64) * 2 + (k % 64) / 32]))
                .collect()
        }
        "embed.weight" => (0..24).map(|i| i as f32 * 0.25 - 3.0).collect(),
        "layers.0.hc_attn_fn" => vec![1.5, -2.0, 3.25, 0.0, 1e-30, 7.0, 8.0, 9.0, -1.0, 2.0, 3.0, 4.0],
        "mtp.0.norm.weight" => vec![1.0, 2.0],
        _ => unreachable!("{name}"),
    }
}

const SYNTH_SHAPES: [(&str, [usize; 2]); 5] = [
    ("embed.weight", [4, 6]),
    ("layers.0.attn.wq_a.weight", [40, 48]),
    ("layers.0.ffn.experts.0.w1.weight", [3, 48]),
    ("layers.0.engram.embed.weight", [5, 64]),
    ("layers.0.hc_attn_fn", [3, 4]),
];

fn check_synthetic(ckpt: &ReleaseCheckpoint, t: &[Raw]) -> Result<()> {
    let vb = var_builder(ckpt.clone(), DType::F32, &Device::Cpu);
    for (name, shape) in SYNTH_SHAPES {
        let got = vb.get(shape.to_vec(), name)?;
        assert_eq!(bits(&got)?, f32_bits(&expected_synthetic(name, t)), "{name}");
    }
    // Row lookups agree with the whole tensor, for every format.
    for (name, shape) in SYNTH_SHAPES {
        let ids = [shape[0] - 1, 0, shape[0] - 1];
        let rows = ckpt.get_raw_rows(name, &ids, DType::F32, &Device::Cpu)?;
        let full = expected_synthetic(name, t);
        let w = shape[1];
        let want: Vec<f32> = ids.iter().flat_map(|&r| full[r * w..(r + 1) * w].to_vec()).collect();
        assert_eq!(bits(&rows)?, f32_bits(&want), "rows of {name}");
    }
    // The `mtp.` tensor is ignored, the rest was used.
    ckpt.check_all_used(&[])?;
    assert_eq!(ckpt.unused_names(&[]), Vec::<String>::new());
    Ok(())
}

#[test]
fn round_trip_single_file() -> Result<()> {
    let dir = TempDir::new("single")?;
    let t = synthetic();
    write_st(&dir.0.join("model.safetensors"), &t)?;
    let ckpt = ReleaseCheckpoint::open_dir(&dir.0)?;
    assert_eq!(ckpt.names().len(), 6);
    assert_eq!(ckpt.stored_names().len(), 9);
    let info = ckpt.info("layers.0.ffn.experts.0.w1.weight")?;
    assert_eq!(
        (info.format, info.shape.clone(), info.stored.shape.clone()),
        (WeightFormat::Mxfp4, vec![3, 48], vec![3, 24])
    );
    assert_eq!(
        info.scale.as_ref().map(|s| s.name.as_str()),
        Some("layers.0.ffn.experts.0.w1.scale")
    );
    check_synthetic(&ckpt, &t)?;
    // `get` released the mapped pages it read (MADV_DONTNEED): they read back unchanged.
    for r in &t {
        assert_eq!(ckpt.raw_bytes(&r.name)?, r.data.as_slice(), "{}", r.name);
    }
    check_synthetic(&ckpt, &t)?;
    // `open` takes folders too.
    let ckpt2 = ReleaseCheckpoint::open(&[&dir.0])?;
    assert_eq!(ckpt2.names(), ckpt.names());
    Ok(())
}

/// Engram-style row tables, and the dense-size guard that keeps `get` off a 100 GB table.
#[test]
fn row_table_and_dense_limit() -> Result<()> {
    let dir = TempDir::new("rows")?;
    let t = synthetic();
    write_st(&dir.0.join("model.safetensors"), &t)?;
    let ckpt = ReleaseCheckpoint::open_dir(&dir.0)?;
    let name = "layers.0.engram.embed.weight";
    ckpt.set_dense_limit(1000); // the table is 5 x 64 x 4 = 1280 bytes as f32
    let e = err_of(ckpt.get(name, DType::F32, &Device::Cpu));
    assert!(
        e.contains(name) && e.contains("1280 bytes") && e.contains("dense limit of 1000") && e.contains("row_table"),
        "{e}"
    );
    let vb = var_builder(ckpt.clone(), DType::F32, &Device::Cpu);
    assert!(vb.get((5, 64), name).is_err());

    let table = ckpt.row_table(name)?;
    assert_eq!(
        (table.num_rows(), table.width(), table.format()),
        (5, 64, WeightFormat::Fp8Rows)
    );
    let ids = Tensor::new(&[[4u32], [1], [4]], &Device::Cpu)?;
    let rows = table.lookup(&ids, DType::F32)?;
    assert_eq!(rows.dims(), &[3, 1, 64]);
    let full = expected_synthetic(name, &t);
    let want: Vec<f32> = [4usize, 1, 4]
        .iter()
        .flat_map(|&r| full[r * 64..(r + 1) * 64].to_vec())
        .collect();
    assert_eq!(bits(&rows)?, f32_bits(&want));
    assert!(ckpt.used_names().contains(&name.to_string()));
    let e = err_of(ckpt.row_table("mtp.0.norm.weight"));
    assert!(e.contains("mtp.0.norm.weight") && e.contains("2-D"), "{e}");
    ckpt.set_dense_limit(deepseek_v41::loader::DEFAULT_DENSE_LIMIT);
    assert_eq!(ckpt.get(name, DType::F32, &Device::Cpu)?.dims(), &[5, 64]);
    Ok(())
}

#[test]
fn round_trip_sharded() -> Result<()> {
    let dir = TempDir::new("sharded")?;
    let t = synthetic();
    let shards = write_sharded(&dir.0, &t)?;
    let ckpt = ReleaseCheckpoint::open_dir(&dir.0)?;
    assert_eq!(ckpt.files().len(), 2);
    check_synthetic(&ckpt, &t)?;
    // The same shards opened as a list of files.
    let ckpt2 = ReleaseCheckpoint::open(&[dir.0.join(&shards[0]), dir.0.join(&shards[1])])?;
    check_synthetic(&ckpt2, &t)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Errors: each names the problem.

fn err_of<T>(r: std::result::Result<T, impl std::fmt::Display>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn error_truncated_file() -> Result<()> {
    let dir = TempDir::new("trunc")?;
    let path = dir.0.join("model.safetensors");
    write_st(&path, &synthetic())?;
    let full = std::fs::read(&path)?;
    std::fs::write(&path, &full[..full.len() - 10])?;
    let e = err_of(ReleaseCheckpoint::open(&[&path]));
    assert!(
        e.contains("truncated") && e.contains("model.safetensors") && e.contains("tensor `"),
        "{e}"
    );
    assert!(
        e.contains(&format!(
            "which has only {} bytes",
            full.len() - 10 - 8 - u64::from_le_bytes(full[..8].try_into()?) as usize
        )),
        "{e}"
    );
    // Cut inside the header.
    std::fs::write(&path, &full[..40])?;
    let e = err_of(ReleaseCheckpoint::open(&[&path]));
    assert!(e.contains("truncated") && e.contains("header declares"), "{e}");
    std::fs::write(&path, &full[..5])?;
    let e = err_of(ReleaseCheckpoint::open(&[&path]));
    assert!(e.contains("truncated") && e.contains("5 bytes"), "{e}");
    Ok(())
}

#[test]
fn error_corrupt_header_and_length_mismatch() -> Result<()> {
    let dir = TempDir::new("corrupt")?;
    let path = dir.0.join("model.safetensors");
    write_st(&path, &synthetic())?;
    let mut b = std::fs::read(&path)?;
    b[8] = b'#';
    std::fs::write(&path, &b)?;
    let e = err_of(ReleaseCheckpoint::open(&[&path]));
    assert!(e.contains("corrupt header") && e.contains("JSON"), "{e}");

    // A header whose offsets disagree with shape x dtype.
    let header = br#"{"a.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}}"#;
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header);
    f.extend_from_slice(&[0u8; 8]);
    std::fs::write(&path, &f)?;
    let e = err_of(ReleaseCheckpoint::open(&[&path]));
    assert!(
        e.contains("header/data length mismatch")
            && e.contains("a.weight")
            && e.contains("needs 12 bytes")
            && e.contains("span 8"),
        "{e}"
    );

    // An unknown dtype.
    let header = br#"{"a.weight":{"dtype":"Q7","shape":[2],"data_offsets":[0,2]}}"#;
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header);
    f.extend_from_slice(&[0u8; 2]);
    std::fs::write(&path, &f)?;
    let e = err_of(ReleaseCheckpoint::open(&[&path]));
    assert!(e.contains("a.weight") && e.contains("Q7"), "{e}");
    Ok(())
}

#[test]
fn error_wrong_dtypes_for_quantized_pairs() -> Result<()> {
    let dir = TempDir::new("dtype")?;
    let path = dir.0.join("model.safetensors");
    let fp8 = |n: &str| raw(n, Dtype::F8_E4M3, &[32, 32], bytes(1024, 7, true));
    write_st(
        &path,
        &[
            fp8("a.weight"), // no scale
            fp8("b.weight"),
            raw("b.scale", Dtype::F32, &[1, 1], f32_bytes(&[1.0])), // scale not e8m0
            fp8("c.weight"),
            raw("c.scale", Dtype::F8_E8M0, &[4, 4], scales(16, 1)), // 128x128-style? no: wrong shape
            raw("d.weight", Dtype::I8, &[2, 16], bytes(32, 2, false)), // MXFP4 without scale
            raw("e.weight", Dtype::BF16, &[2, 2], bf16_bytes(&[1.0; 4])),
            raw("e.scale", Dtype::F8_E8M0, &[1, 1], vec![127]), // scale on a bf16 weight
            raw("f.weight", Dtype::U8, &[2, 16], bytes(32, 3, false)),
            raw("f.scale", Dtype::U8, &[2, 1], vec![127, 128]), // U8 view of the scale: accepted
        ],
    )?;
    let ckpt = ReleaseCheckpoint::open(&[&path])?;
    let dev = Device::Cpu;
    let e = err_of(ckpt.get("a.weight", DType::F32, &dev));
    assert!(
        e.contains("a.weight") && e.contains("without its scale companion `a.scale`"),
        "{e}"
    );
    let e = err_of(ckpt.get("b.weight", DType::F32, &dev));
    assert!(
        e.contains("b.weight") && e.contains("dtype F32") && e.contains("F8_E8M0"),
        "{e}"
    );
    let e = err_of(ckpt.get("c.weight", DType::F32, &dev));
    assert!(
        e.contains("c.weight") && e.contains("[4, 4]") && e.contains("[1, 1]"),
        "{e}"
    );
    let e = err_of(ckpt.get("d.weight", DType::F32, &dev));
    assert!(e.contains("d.weight") && e.contains("I8") && e.contains("scale"), "{e}");
    let e = err_of(ckpt.get("e.weight", DType::F32, &dev));
    assert!(
        e.contains("e.weight") && e.contains("BF16") && e.contains("not a quantized format"),
        "{e}"
    );
    let f = ckpt.get("f.weight", DType::F32, &dev)?;
    assert_eq!(f.dims(), &[2, 32]);
    // Companions are not variables.
    let e = err_of(ckpt.get("f.scale", DType::F32, &dev));
    assert!(
        e.contains("f.scale") && e.contains("scale companion of `f.weight`"),
        "{e}"
    );
    let vb = var_builder(ckpt.clone(), DType::F32, &dev);
    assert!(!vb.contains_tensor("f.scale") && vb.contains_tensor("f.weight"));
    Ok(())
}

#[test]
fn error_missing_tensor_wrong_shape_and_collect_mode() -> Result<()> {
    let dir = TempDir::new("missing")?;
    write_st(&dir.0.join("model.safetensors"), &synthetic())?;
    let ckpt = ReleaseCheckpoint::open_dir(&dir.0)?;
    let vb = var_builder(ckpt.clone(), DType::BF16, &Device::Cpu);
    let e = err_of(vb.pp("layers.0.attn").get((40, 48), "wq_b.weight"));
    assert!(
        e.contains("layers.0.attn.wq_b.weight") && e.contains("not found"),
        "{e}"
    );
    // MXFP4 weights are checked against their logical shape, not the packed one.
    let e = err_of(vb.get((3, 24), "layers.0.ffn.experts.0.w1.weight"));
    assert!(
        e.contains("layers.0.ffn.experts.0.w1.weight") && e.contains("[3, 48]") && e.contains("expected [3, 24]"),
        "{e}"
    );
    assert!(vb.get((3, 48), "layers.0.ffn.experts.0.w1.weight").is_ok());

    // Strictness: everything else is reported unused (not the companions, not `mtp.`).
    let e = err_of(ckpt.check_all_used(&[]));
    for n in [
        "embed.weight",
        "layers.0.attn.wq_a.weight",
        "layers.0.engram.embed.weight",
        "layers.0.hc_attn_fn",
    ] {
        assert!(e.contains(n), "{e}");
    }
    assert!(
        !e.contains(".scale") && !e.contains("mtp.") && !e.contains("experts.0.w1"),
        "{e}"
    );
    assert!(e.starts_with("4 checkpoint tensor(s) were never used"), "{e}");
    assert_eq!(ckpt.unused_names(&["layers."]), vec!["embed.weight".to_string()]);

    // Collect mode: every missing / mis-shaped tensor at once, loading goes on.
    ckpt.set_collect_missing(true);
    let z = vb.get((2, 3), "nope.a")?;
    assert_eq!(z.dims(), &[2, 3]);
    vb.get(5, "nope.b")?;
    vb.get((4, 7), "embed.weight")?;
    vb.get((4, 6), "embed.weight")?;
    let e = err_of(ckpt.check_missing());
    assert!(e.starts_with("3 problem(s)"), "{e}");
    // A `.scale` companion asked for as a variable is collected too.
    vb.get((2, 2), "layers.0.attn.wq_a.scale")?;
    assert_eq!(ckpt.load_problems().len(), 4);
    assert!(
        e.contains("`nope.a`") && e.contains("`nope.b`") && e.contains("expected [4, 7]"),
        "{e}"
    );
    ckpt.reset_usage();
    ckpt.check_missing()?;
    Ok(())
}

#[test]
fn error_missing_shard_duplicates_and_bad_index() -> Result<()> {
    let dir = TempDir::new("shard")?;
    let t = synthetic();
    let shards = write_sharded(&dir.0, &t)?;
    std::fs::remove_file(dir.0.join(&shards[1]))?;
    let e = err_of(ReleaseCheckpoint::open_dir(&dir.0));
    assert!(
        e.contains(&shards[1]) && e.contains("missing") && e.contains("model.safetensors.index.json"),
        "{e}"
    );

    // A tensor in two files.
    let d2 = TempDir::new("dup")?;
    write_st(&d2.0.join("a.safetensors"), &t[..2])?;
    write_st(&d2.0.join("b.safetensors"), &t[1..3])?;
    let e = err_of(ReleaseCheckpoint::open(&[
        d2.0.join("a.safetensors"),
        d2.0.join("b.safetensors"),
    ]));
    assert!(
        e.contains(&t[1].name) && e.contains("a.safetensors") && e.contains("b.safetensors"),
        "{e}"
    );

    // An index naming a tensor its shard lacks.
    let d3 = TempDir::new("badindex")?;
    write_st(&d3.0.join("s.safetensors"), &t[..1])?;
    let idx = serde_json::json!({"weight_map": {"embed.weight": "s.safetensors", "ghost.weight": "s.safetensors"}});
    std::fs::write(d3.0.join("model.safetensors.index.json"), idx.to_string())?;
    let e = err_of(ReleaseCheckpoint::open_dir(&d3.0));
    assert!(e.contains("ghost.weight") && e.contains("s.safetensors"), "{e}");
    // An empty folder.
    let d4 = TempDir::new("empty")?;
    let e = err_of(ReleaseCheckpoint::open_dir(&d4.0));
    assert!(e.contains("model.safetensors"), "{e}");
    Ok(())
}

#[test]
fn progress_counts_the_stored_bytes_of_each_tensor_read() -> Result<()> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let ckpt = ReleaseCheckpoint::open(&[tiny_model()])?;
    let read = Arc::new(AtomicU64::new(0));
    let counter = read.clone();
    ckpt.set_progress(move |n| {
        counter.fetch_add(n, Ordering::Relaxed);
    });
    // FP8 weight + its scale, then a plain tensor.
    let fp8 = ckpt.raw_bytes("layers.0.attn.wq_a.weight")?.len() + ckpt.raw_bytes("layers.0.attn.wq_a.scale")?.len();
    ckpt.get("layers.0.attn.wq_a.weight", DType::F32, &Device::Cpu)?;
    assert_eq!(read.load(Ordering::Relaxed), fp8 as u64);
    let norm = ckpt.raw_bytes("layers.0.attn_norm.weight")?.len();
    ckpt.get("layers.0.attn_norm.weight", DType::F32, &Device::Cpu)?;
    assert_eq!(read.load(Ordering::Relaxed), (fp8 + norm) as u64);
    let total: usize = ckpt.stored_names().iter().map(|n| ckpt.raw_bytes(n).map_or(0, <[u8]>::len)).sum();
    assert_eq!(ckpt.stored_bytes(), total as u64);
    Ok(())
}
