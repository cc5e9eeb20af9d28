//! Writes a synthetic model folder in the release checkpoint format, for measuring loading
//! (see `examples/load_memory.rs` and `docs/perf.md`).
//!
//! ```text
//! cargo run --release --example synthetic_checkpoint -- /tmp/v41-synthetic
//! cargo run --release --example synthetic_checkpoint -- /tmp/v41-synthetic --hidden 1024 --layers 8 --experts 16
//! ```
//!
//! The folder gets the template model's `config.json` scaled up (hidden size, layer count,
//! routed experts, expert width; added layers repeat the last compress ratio), its
//! `tokenizer.json`, and a `model.safetensors` with deterministic, untrained weights. Every
//! tensor is stored the way the template stores the tensor of the same role (FP8 with 32×32
//! block scales, MXFP4 experts, FP8 Engram rows, BF16, F32); the names and logical shapes follow
//! from the config (`tests/support/release_shapes.rs`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use deepseek_v41::config::Config;
use deepseek_v41::loader::{ReleaseCheckpoint, StoredDtype, WeightFormat};
use safetensors::Dtype;

#[path = "../tests/support/release_writer.rs"]
mod release_writer;
use release_writer::{bf16_bytes, bytes, f32_bytes, raw, write_st, Raw};

#[path = "../tests/support/release_shapes.rs"]
mod release_shapes;
use release_shapes::expected_shapes;

const TEMPLATE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/v41-shakespeare-tiny");

#[derive(Parser)]
#[command(about = "Write a synthetic release-format model folder (untrained weights)")]
struct Args {
    /// Output folder (created; an existing checkpoint there is overwritten).
    out: PathBuf,
    /// `hidden_size`.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// `num_hidden_layers` (at least the template's).
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// `n_routed_experts`.
    #[arg(long, default_value_t = 16)]
    experts: usize,
    /// `moe_intermediate_size` (a multiple of 32).
    #[arg(long, default_value_t = 512)]
    moe_intermediate: usize,
    /// The model folder whose config, tokenizer and storage formats are used.
    #[arg(long, default_value = TEMPLATE)]
    template: PathBuf,
}

/// A name with every layer / expert index replaced by `N`: the tensor's role.
fn role(name: &str) -> String {
    name.split('.')
        .map(|p| if p.bytes().all(|b| b.is_ascii_digit()) { "N" } else { p })
        .collect::<Vec<_>>()
        .join(".")
}

fn st_dtype(d: StoredDtype) -> Result<Dtype> {
    Ok(match d {
        StoredDtype::BF16 => Dtype::BF16,
        StoredDtype::F32 => Dtype::F32,
        StoredDtype::I8 => Dtype::I8,
        StoredDtype::U8 => Dtype::U8,
        StoredDtype::F8E4M3 => Dtype::F8_E4M3,
        d => bail!("the template stores a tensor as {d}, which this writer does not produce"),
    })
}

/// e8m0 scales 2^-13 ..= 2^-8: typical magnitudes of trained weights for e4m3 / e2m1 codes.
fn small_scales(n: usize, seed: u32) -> Vec<u8> {
    bytes(n, seed, false).iter().map(|b| 114 + b % 6).collect()
}

/// The stored tensors (weight and, when quantized, its `.scale`) of one logical tensor.
fn tensors(name: &str, shape: &[usize], format: WeightFormat, dtype: StoredDtype, seed: u32) -> Result<Vec<Raw>> {
    let n: usize = shape.iter().product();
    let scale = name.strip_suffix(".weight").map(|p| format!("{p}.scale"));
    let two_d = || match shape {
        &[a, b] => Ok((a, b)),
        _ => bail!("{name}: quantized tensors are 2-D, got {shape:?}"),
    };
    Ok(match format {
        WeightFormat::Plain => {
            let values: Vec<f32> = if name.ends_with("norm.weight") {
                vec![1.0; n]
            } else {
                bytes(n, seed, false).iter().map(|&b| (b as f32 - 127.5) / 127.5 * 0.02).collect()
            };
            let data = match dtype {
                StoredDtype::F32 => f32_bytes(&values),
                _ => bf16_bytes(&values),
            };
            vec![raw(name, st_dtype(dtype)?, shape, data)]
        }
        WeightFormat::Fp8Block32 | WeightFormat::Fp8Rows => {
            let (out, inp) = two_d()?;
            let srows = if format == WeightFormat::Fp8Rows { out } else { out.div_ceil(32) };
            let scols = inp.div_ceil(32);
            let scale = scale.context("FP8 weights are named *.weight")?;
            vec![
                raw(name, Dtype::F8_E4M3, shape, bytes(n, seed, true)),
                raw(&scale, Dtype::F8_E8M0, &[srows, scols], small_scales(srows * scols, seed + 1)),
            ]
        }
        WeightFormat::Mxfp4 => {
            let (out, inp) = two_d()?;
            let scale = scale.context("MXFP4 weights are named *.weight")?;
            let sc = inp.div_ceil(32);
            vec![
                raw(name, st_dtype(dtype)?, &[out, inp / 2], bytes(n / 2, seed, false)),
                raw(&scale, Dtype::F8_E8M0, &[out, sc], small_scales(out * sc, seed + 1)),
            ]
        }
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(args.template.join("config.json"))?)?;
    let t = cfg["text_config"].as_object_mut().context("config.json has no text_config")?;
    let mut ratios: Vec<serde_json::Value> = t["compress_ratios"].as_array().context("compress_ratios")?.clone();
    if args.layers < ratios.len() {
        bail!("--layers {} is below the template's {} layers", args.layers, ratios.len());
    }
    let last = ratios.last().cloned().context("empty compress_ratios")?;
    ratios.resize(args.layers, last);
    t.insert("compress_ratios".into(), ratios.into());
    t.insert("hidden_size".into(), args.hidden.into());
    t.insert("num_hidden_layers".into(), args.layers.into());
    t.insert("n_routed_experts".into(), args.experts.into());
    t.insert("moe_intermediate_size".into(), args.moe_intermediate.into());

    std::fs::create_dir_all(&args.out)?;
    let config_path = args.out.join("config.json");
    std::fs::write(&config_path, serde_json::to_string_pretty(&cfg)?)?;
    std::fs::copy(args.template.join("tokenizer.json"), args.out.join("tokenizer.json"))?;
    Config::from_file(&config_path).context("the scaled config does not validate")?;

    // How the template stores each role.
    let template = ReleaseCheckpoint::open_dir(&args.template)?;
    let mut formats = BTreeMap::new();
    for name in template.names() {
        let info = template.info(&name)?;
        formats.insert(role(&name), (info.format, info.stored.dtype));
    }

    let mut out = Vec::new();
    let mut params = 0usize;
    for (seed, (name, shape)) in expected_shapes(&cfg).into_iter().enumerate() {
        let &(format, dtype) = formats
            .get(&role(&name))
            .with_context(|| format!("the template has no tensor in the role of {name}"))?;
        params += shape.iter().product::<usize>();
        out.extend(tensors(&name, &shape, format, dtype, seed as u32)?);
    }
    let path = args.out.join("model.safetensors");
    write_st(&path, &out)?;
    println!(
        "wrote {} ({} stored tensors, {params} parameters, {:.1} MiB)",
        path.display(),
        out.len(),
        std::fs::metadata(&path)?.len() as f64 / (1 << 20) as f64
    );
    Ok(())
}
