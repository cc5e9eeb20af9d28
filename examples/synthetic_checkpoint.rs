//! Writes a synthetic model folder in the release checkpoint format, for measuring loading
//! (see `examples/load_report.rs` and `docs/perf.md` "Loading").
//!
//! ```text
//! cargo run --release --example synthetic_checkpoint -- /tmp/v41-synthetic
//! cargo run --release --example synthetic_checkpoint -- /tmp/v41-synthetic --hidden 1024 --layers 8 --experts 16
//! cargo run --release --example synthetic_checkpoint -- /tmp/v41-flash --flash-shapes --layers 1 --experts 8
//! cargo run --release --example synthetic_checkpoint -- /tmp/v41-flash --flash-shapes --layer-ids 0,1,2,3,20,21,24
//! ```
//!
//! Two kinds of model:
//! * default: the template model's `config.json` scaled up (hidden size, layer count, routed
//!   experts, expert width; added layers repeat the last compress ratio) and its `tokenizer.json`;
//! * `--flash-shapes`: the released DeepSeek-V4.1-Flash `config.json` (spec §1.1, every width as
//!   released) cut to its first `--layers` layers (default 4: window-only layers 0 and 1, layer 1
//!   with Engram, layer 2 the ratio-2 kv and index source, layer 3 reusing its top-k) or to the
//!   released layers `--layer-ids` (renumbered, roles kept: `examples/support/flash_config.rs`),
//!   with `--experts` routed experts (default all 384) and Engram tables of about
//!   `--engram-rows` rows (default 2^20; the released tables have ~384M rows, ~101 GB each;
//!   `--engram-rows 0` writes them at that size), plus the release tokenizer.
//!
//! Every tensor is stored the way the template stores the tensor of the same role (FP8 with 32×32
//! block scales, MXFP4 experts, FP8 Engram rows, BF16, F32; spec §2.4); the names and logical
//! shapes follow from the config (`tests/support/release_shapes.rs`). Contents are deterministic
//! draws with the magnitudes of trained weights (`examples/support/synthetic_values.rs`). The
//! checkpoint is written as shards of at most `--shard-gb` GB plus `model.safetensors.index.json`
//! (spec §12.1), streamed chunk by chunk (`examples/support/sharded_writer.rs`): the host never
//! holds a tensor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use deepseek_v41::config::Config;
use deepseek_v41::loader::{ReleaseCheckpoint, StoredDtype, WeightFormat};

#[path = "../tests/support/release_shapes.rs"]
mod release_shapes;
use release_shapes::expected_shapes;

#[path = "support/synthetic_values.rs"]
mod synthetic_values;
use synthetic_values::Content;

#[path = "support/sharded_writer.rs"]
mod sharded_writer;
use sharded_writer::{plan_shards, remove_old_checkpoint, write_checkpoint, Planned};

#[path = "support/flash_config.rs"]
mod flash_config;

#[path = "support/repo_files.rs"]
mod repo_files;
use repo_files::repo_file;

/// The default template (from the repository root).
const TEMPLATE: &str = "models/v41-shakespeare-tiny";

#[derive(Parser)]
#[command(about = "Write a synthetic release-format model folder (untrained weights)")]
struct Args {
    /// Output folder (created; a checkpoint already there is replaced).
    out: PathBuf,
    /// The released V4.1-Flash config cut to some of its layers instead of the scaled template.
    #[arg(long)]
    flash_shapes: bool,
    /// `num_hidden_layers` (default 8, at least the template's; with --flash-shapes: the first N
    /// released layers, default 4).
    #[arg(long)]
    layers: Option<usize>,
    /// With --flash-shapes: the released layer ids to keep (comma separated, ascending).
    #[arg(long, value_delimiter = ',', conflicts_with = "layers", requires = "flash_shapes")]
    layer_ids: Option<Vec<usize>>,
    /// `n_routed_experts` (default 16; with --flash-shapes 384).
    #[arg(long)]
    experts: Option<usize>,
    /// With --flash-shapes: about this many rows per Engram table (0: the released ~384M).
    #[arg(long, default_value_t = 1 << 20, requires = "flash_shapes")]
    engram_rows: usize,
    /// `hidden_size` of the scaled template (default 1024).
    #[arg(long, conflicts_with = "flash_shapes")]
    hidden: Option<usize>,
    /// `moe_intermediate_size` of the scaled template (a multiple of 32; default 512).
    #[arg(long, conflicts_with = "flash_shapes")]
    moe_intermediate: Option<usize>,
    /// The model folder whose config and tokenizer are scaled, and whose storage formats are used
    /// (default: the embedded model, models/v41-shakespeare-tiny).
    #[arg(long)]
    template: Option<PathBuf>,
    /// Largest shard in GB (10^9 bytes); a bigger tensor gets a shard of its own.
    #[arg(long, default_value_t = 5.0)]
    shard_gb: f64,
    /// Print the tensors' total size and the shard plan, write nothing.
    #[arg(long)]
    plan_only: bool,
}

/// A name with every layer / expert index replaced by `N`: the tensor's role.
fn role(name: &str) -> String {
    name.split('.')
        .map(|p| if p.bytes().all(|b| b.is_ascii_digit()) { "N" } else { p })
        .collect::<Vec<_>>()
        .join(".")
}

/// The safetensors dtype string and element size of a stored dtype the writer produces.
fn st_dtype(d: StoredDtype) -> Result<(&'static str, usize)> {
    Ok(match d {
        StoredDtype::BF16 => ("BF16", 2),
        StoredDtype::F32 => ("F32", 4),
        StoredDtype::I8 => ("I8", 1),
        StoredDtype::U8 => ("U8", 1),
        StoredDtype::F8E4M3 => ("F8_E4M3", 1),
        d => bail!("the template stores a tensor as {d}, which this writer does not produce"),
    })
}

/// The stored tensors (weight and, when quantized, its `.scale`) of one logical tensor.
fn tensors(name: &str, shape: &[usize], format: WeightFormat, dtype: StoredDtype) -> Result<Vec<Planned>> {
    let planned = |name: &str, (dtype, elem_bytes): (&'static str, usize), shape: &[usize], content| Planned {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        elem_bytes,
        content,
    };
    let e8m0 = ("F8_E8M0", 1);
    let scale = name.strip_suffix(".weight").map(|p| format!("{p}.scale"));
    let two_d = || match shape {
        &[a, b] => Ok((a, b)),
        _ => bail!("{name}: quantized tensors are 2-D, got {shape:?}"),
    };
    Ok(match format {
        WeightFormat::Plain => {
            let (st, size) = st_dtype(dtype)?;
            let content = match (name.ends_with("norm.weight"), dtype) {
                (true, StoredDtype::F32) => Content::F32Ones,
                (true, _) => Content::Bf16Ones,
                (false, StoredDtype::F32) => Content::F32Normal,
                (false, _) => Content::Bf16Normal,
            };
            vec![planned(name, (st, size), shape, content)]
        }
        WeightFormat::Fp8Block32 | WeightFormat::Fp8Rows => {
            let (out, inp) = two_d()?;
            let srows = if format == WeightFormat::Fp8Rows { out } else { out.div_ceil(32) };
            let scale = scale.context("FP8 weights are named *.weight")?;
            vec![
                planned(name, ("F8_E4M3", 1), shape, Content::Fp8Codes),
                planned(&scale, e8m0, &[srows, inp.div_ceil(32)], Content::Fp8Scales),
            ]
        }
        WeightFormat::Mxfp4 => {
            let (out, inp) = two_d()?;
            let scale = scale.context("MXFP4 weights are named *.weight")?;
            vec![
                planned(name, st_dtype(dtype)?, &[out, inp / 2], Content::Mxfp4Codes),
                planned(&scale, e8m0, &[out, inp.div_ceil(32)], Content::Mxfp4Scales),
            ]
        }
    })
}

/// The template config scaled as the arguments say (see the module docs).
fn scaled_template(args: &Args, template: &Path) -> Result<serde_json::Value> {
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(template.join("config.json"))?)?;
    let t = cfg["text_config"].as_object_mut().context("config.json has no text_config")?;
    let mut ratios: Vec<serde_json::Value> = t["compress_ratios"].as_array().context("compress_ratios")?.clone();
    let layers = args.layers.unwrap_or(8);
    if layers < ratios.len() {
        bail!("--layers {layers} is below the template's {} layers", ratios.len());
    }
    let last = ratios.last().cloned().context("empty compress_ratios")?;
    ratios.resize(layers, last);
    t.insert("compress_ratios".into(), ratios.into());
    t.insert("hidden_size".into(), args.hidden.unwrap_or(1024).into());
    t.insert("num_hidden_layers".into(), layers.into());
    t.insert("n_routed_experts".into(), args.experts.unwrap_or(16).into());
    t.insert("moe_intermediate_size".into(), args.moe_intermediate.unwrap_or(512).into());
    Ok(cfg)
}

/// Writes the config (and tokenizer) into `args.out` (unless `--plan-only`); returns the
/// `config.json` document.
fn write_config(args: &Args, template: &Path) -> Result<serde_json::Value> {
    if !args.flash_shapes {
        let cfg = scaled_template(args, template)?;
        Config::from_json(&cfg.to_string()).context("the scaled config does not validate")?;
        if !args.plan_only {
            std::fs::write(args.out.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
            let _ = std::fs::remove_file(args.out.join("tokenizer.json.gz"));
            std::fs::copy(template.join("tokenizer.json"), args.out.join("tokenizer.json"))?;
        }
        return Ok(cfg);
    }
    let picks = match &args.layer_ids {
        Some(ids) => ids.clone(),
        None => (0..args.layers.unwrap_or(4)).collect(),
    };
    let rows = (args.engram_rows > 0).then_some(args.engram_rows);
    let fc = flash_config::flash_config(&picks, args.experts, rows)?;
    if !args.plan_only {
        flash_config::write_config(&fc, &args.out)?;
    }
    println!("config: released V4.1-Flash widths, {} layers, {} routed experts", picks.len(), fc.config.n_routed_experts);
    for line in flash_config::describe(&fc) {
        println!("  {line}");
    }
    match &fc.config.engram {
        Some(e) => println!(
            "  Engram tables: {:?} rows (engram_vocab_size {}; the released tables have 384006168 / 384016682)",
            fc.engram_rows, e.vocab_size
        ),
        None => println!("  no Engram layer among the picked layers (the released ones are 1 and 14)"),
    }
    Ok(fc.json)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.shard_gb.is_nan() || args.shard_gb <= 0.0 {
        bail!("--shard-gb {} must be positive", args.shard_gb);
    }
    let template = args.template.clone().unwrap_or_else(|| repo_file(TEMPLATE));
    if !args.plan_only {
        std::fs::create_dir_all(&args.out)?;
        remove_old_checkpoint(&args.out)?;
    }
    let cfg = write_config(&args, &template)?;

    // How the template stores each role.
    let template = ReleaseCheckpoint::open_dir(&template)?;
    let mut formats = BTreeMap::new();
    for name in template.names() {
        let info = template.info(&name)?;
        formats.insert(role(&name), (info.format, info.stored.dtype));
    }

    let mut planned = Vec::new();
    let mut params = 0usize;
    for (name, shape) in expected_shapes(&cfg) {
        let &(format, dtype) = formats
            .get(&role(&name))
            .with_context(|| format!("the template has no tensor in the role of {name}"))?;
        params += shape.iter().product::<usize>();
        planned.extend(tensors(&name, &shape, format, dtype)?);
    }
    let total: u64 = planned.iter().map(Planned::bytes).sum();
    let max_shard = (args.shard_gb * 1e9) as u64;
    if args.plan_only {
        let shards = plan_shards(planned.clone(), max_shard);
        let largest = shards.iter().map(|s| s.iter().map(Planned::bytes).sum::<u64>()).max().unwrap_or(0);
        println!(
            "plan: {} stored tensors, {params} parameters, {:.3} GB in {} shards (largest {:.3} GB)",
            planned.len(),
            total as f64 / 1e9,
            shards.len(),
            largest as f64 / 1e9
        );
        return Ok(());
    }
    println!("writing {} stored tensors, {params} parameters, {:.2} GB into {}", planned.len(), total as f64 / 1e9, args.out.display());
    let w = write_checkpoint(&args.out, planned, max_shard)?;
    println!(
        "wrote {} shards, {} tensors, {:.2} GB in {:.1} s ({:.2} s per GB, {:.2} GB/s)",
        w.shards.len(),
        w.tensors,
        w.bytes as f64 / 1e9,
        w.secs,
        w.secs / (w.bytes as f64 / 1e9),
        w.bytes as f64 / 1e9 / w.secs
    );
    Ok(())
}
