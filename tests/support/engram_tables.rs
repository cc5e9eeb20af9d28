//! Checks of the Engram tables kept in host memory (`model::engram_host`, placement
//! `model::engram_placement`), run on any device: `tests/engram_host.rs` (CPU) and
//! `tests/cuda_engram_host.rs` (GPU) call them.
//!
//! * [`check_host_rows`]: `HostRows::rows` bit for bit `RowTable::lookup(.., BF16)` on random
//!   rows of written FP8 tables (every code byte, every scale byte 0..=255), several call sizes
//!   with the staging buffer kept, plus the host-dequantized fallback (width not a multiple of 32).
//! * [`check_released_shape`]: the released table shape (`[384006168, 256]` F8_E4M3 + `[384006168, 8]`
//!   F8_E8M0, from `tests/fixtures/deepseek-v41-flash/config.json`) in a sparse file: `Auto`
//!   picks the host, nothing is materialized, written rows decode to their values and unwritten
//!   ones to zeros, and the Engram module's output equals the host-dequantized lookup's.
//! * [`check_model_host_equals_device`]: the embedded Shakespeare model with its tables on the
//!   host gives the resident tables' logits bit for bit (prefill and decode);
//!   [`check_batch_host_equals_device`]: the same in batched calls (`Model::forward_batch`).
#![allow(dead_code)]

use std::io::{Seek, SeekFrom, Write};
use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::config::Config;
use deepseek_v41::loader::{dequant_fp8_rows, var_builder, ReleaseCheckpoint};
use deepseek_v41::model::{BatchItem, Engram, EngramLocation, EngramOptions, EngramPlacement, EngramTable, HostRows, LogitRows, Pretrained};
use deepseek_v41::Numerics;
use safetensors::Dtype;

use super::release_writer::{bytes, raw, scales, write_st, Raw, TempDir};
use super::rng::Rng;

/// A folder of the repository (from the repository root when the packed binary runs elsewhere).
pub fn repo_path(rel: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel);
    if built.exists() {
        built
    } else {
        PathBuf::from(rel)
    }
}

/// The bf16 bit patterns of `t`.
pub fn bf16_bits(t: &Tensor) -> Result<Vec<u16>> {
    Ok(t.flatten_all()?.to_dtype(DType::BF16)?.to_vec1::<half::bf16>()?.iter().map(|x| x.to_bits()).collect())
}

/// An FP8-rows table `name` `[rows, width]` with 1×32 scales: random code bytes (every value,
/// NaN codes included) and scales that run through every byte 0..=255 in the first rows (row r,
/// block j: `(r · blocks + j) mod 256`), random further down.
pub fn fp8_table(name: &str, rows: usize, width: usize, seed: u64) -> Vec<Raw> {
    let mut rng = Rng(seed);
    let codes: Vec<u8> = (0..rows * width).map(|_| rng.next_u64() as u8).collect();
    let sb = width.div_ceil(32);
    let sc: Vec<u8> = (0..rows * sb).map(|i| if i < 512 { i as u8 } else { rng.next_u64() as u8 }).collect();
    let scale = name.replace(".weight", ".scale");
    vec![raw(name, Dtype::F8_E4M3, &[rows, width], codes), raw(&scale, Dtype::F8_E8M0, &[rows, sb], sc)]
}

/// `HostRows` on `dev` against `RowTable::lookup` (see the module doc). Returns whether the
/// staging buffer was page-locked.
pub fn check_host_rows(dev: &Device) -> Result<bool> {
    let name = "layers.1.engram.embed.weight";
    let mut pinned = false;
    for (width, rows, seed) in [(256usize, 700usize, 1u64), (64, 300, 2), (32, 600, 3), (40, 50, 4)] {
        let dir = TempDir::new("engram-host")?;
        write_st(&dir.0.join("model.safetensors"), &fp8_table(name, rows, width, seed))?;
        let ckpt = ReleaseCheckpoint::open_dir(&dir.0)?;
        let table = ckpt.row_table(name)?;
        let host = HostRows::new(table.clone(), dev)?;
        ensure!(host.decodes_on_device() == width.is_multiple_of(32), "width {width}: device decode {}", host.decodes_on_device());
        let mut rng = Rng(seed + 100);
        let mut held = Vec::new();
        for n in [24usize, 1, 2400, 24, 2400, 7] {
            let mut ids: Vec<u32> = (0..n).map(|_| rng.below(rows) as u32).collect();
            // The first rows hold every scale byte; the last row checks the far end.
            if n >= 600 {
                for (i, id) in ids.iter_mut().take((512 / width.div_ceil(32) + 1).min(rows)).enumerate() {
                    *id = i as u32;
                }
                ids[n - 1] = rows as u32 - 1;
            }
            let got = host.rows(&ids)?;
            ensure!(got.device().same_device(dev) && got.dtype() == DType::BF16 && got.dims() == [n, width], "{:?}", got.shape());
            let want = table.lookup(&Tensor::new(ids.as_slice(), &Device::Cpu)?, DType::BF16)?;
            let (g, w) = (bf16_bits(&got)?, bf16_bits(&want)?);
            if let Some(i) = (0..g.len()).find(|&i| g[i] != w[i]) {
                bail!("width {width}, {n} ids: element {i} (row {}, column {}) is {:#06x}, RowTable::lookup gives {:#06x}", ids[i / width], i % width, g[i], w[i])
            }
            held.push(host.staging_bytes());
            pinned |= host.staging_pinned();
        }
        // The staging buffer grew to the largest call and stayed there.
        if host.decodes_on_device() {
            ensure!(held[2] >= 2400 * (width + width / 32) && held[2..].iter().all(|&b| b == held[2]), "staging bytes per call: {held:?}");
        }
        let e = host.rows(&[0, rows as u32]).expect_err("a row past the end").to_string();
        ensure!(e.contains(name) && e.contains(&rows.to_string()), "{e}");
    }
    Ok(pinned)
}

/// The released table's rows written into the sparse file: `(row, codes, scales)`.
type Written = Vec<(usize, Vec<u8>, Vec<u8>)>;

/// Writes a safetensors file whose Engram layer 1 has the released table shape, as a sparse
/// file: the header, the small tensors of `small`, and only the rows of `rows_to_write` of the
/// table (`[rows, width]` F8_E4M3 + `[rows, width/32]` F8_E8M0); every other byte is a hole.
fn write_sparse_release(path: &std::path::Path, small: &[Raw], rows: usize, width: usize, rows_to_write: &[usize]) -> Result<Written> {
    let sb = width / 32;
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    let mut entry = |name: &str, dtype: &str, shape: &[usize], len: usize| {
        header.insert(name.to_string(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + len]}));
        off += len;
        off - len
    };
    let mut small_at = Vec::new();
    for t in small {
        let dtype = match t.dtype {
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::BF16 => "BF16",
            d => bail!("sparse release file: no spelling for {d:?}"),
        };
        small_at.push(entry(&t.name, dtype, &t.shape, t.data.len()));
    }
    let codes_at = entry("layers.1.engram.embed.weight", "F8_E4M3", &[rows, width], rows * width);
    let scales_at = entry("layers.1.engram.embed.scale", "F8_E8M0", &[rows, sb], rows * sb);
    let mut text = serde_json::to_string(&header)?;
    while (text.len() + 8) % 8 != 0 {
        text.push(' ');
    }
    let data = 8 + text.len() as u64;
    let mut f = std::fs::File::create(path)?;
    f.write_all(&(text.len() as u64).to_le_bytes())?;
    f.write_all(text.as_bytes())?;
    f.set_len(data + off as u64)?;
    let mut at = |pos: usize, bytes: &[u8]| -> Result<()> {
        f.seek(SeekFrom::Start(data + pos as u64))?;
        Ok(f.write_all(bytes)?)
    };
    for (t, &pos) in small.iter().zip(&small_at) {
        at(pos, &t.data)?;
    }
    let mut written = Vec::new();
    for (k, &r) in rows_to_write.iter().enumerate() {
        let codes = bytes(width, 7 + k as u32, true);
        let sc = scales(sb, 11 + k as u32);
        at(codes_at + r * width, &codes)?;
        at(scales_at + r * sb, &sc)?;
        written.push((r, codes, sc));
    }
    Ok(written)
}

/// This process's resident set in bytes (`/proc/self/status`), 0 where there is none.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    kb.unwrap_or(0) * 1024
}

/// The released table shape in a sparse file, on `dev` (see the module doc).
pub fn check_released_shape(dev: &Device) -> Result<()> {
    let mut cfg = Config::from_file(repo_path("tests/fixtures/deepseek-v41-flash/config.json"))?;
    let e = cfg.engram.clone().context("the released config has Engram layers")?;
    let (rows, width) = (e.num_embeddings[0], e.head_dim);
    ensure!((e.layer_ids[0], rows, width) == (1, 384006168, 256), "released Engram layer 1: {rows} x {width}");
    // The table is the release's; the projection `wkv` [(hc+1)·D, cols·width] is narrowed to
    // D = 64 (from 4096) so that the test writes 2 MB of it rather than 126 MB.
    cfg.hidden_size = 64;
    let (hc, d, cols) = (cfg.hc_mult, cfg.hidden_size, (e.max_ngram_size - 1) * e.n_heads);
    let (out, inp) = ((hc + 1) * d, cols * width);
    let p = "layers.1.engram";
    let bf16 = |n: usize, seed: u32| -> Vec<u8> { bytes(n, seed, false).iter().map(|b| b % 64 + 0x3c).flat_map(|b| [0u8, b]).collect() };
    let small = vec![
        raw(&format!("{p}.wkv.weight"), Dtype::F8_E4M3, &[out, inp], bytes(out * inp, 1, true)),
        raw(&format!("{p}.wkv.scale"), Dtype::F8_E8M0, &[out / 32, inp / 32], scales(out / 32 * inp / 32, 2)),
        raw(&format!("{p}.q_weight"), Dtype::BF16, &[hc, d], bf16(hc * d, 3)),
        raw(&format!("{p}.k_weight"), Dtype::BF16, &[hc, d], bf16(hc * d, 4)),
    ];
    let dir = TempDir::new("engram-release")?;
    let file = dir.0.join("model.safetensors");
    let to_write = [0usize, 1, 12_345_678, 200_000_000, rows - 1];
    let written = write_sparse_release(&file, &small, rows, width, &to_write)?;
    let logical = std::fs::metadata(&file)?.len();
    ensure!(logical > 101_000_000_000, "the sparse file has the released size ({logical} bytes)");

    let ckpt = ReleaseCheckpoint::open_dir(&dir.0)?;
    // Nothing the size of the table may be materialized: any attempt stops at 64 MiB.
    ckpt.set_dense_limit(64 << 20);
    let rss_before = rss_bytes();
    let vb = var_builder(ckpt.clone(), DType::BF16, dev).pp("layers").pp(1).pp("engram");
    let engram = Engram::load(&cfg, 1, Numerics::REFERENCE, vb.clone(), &EngramOptions::new(EngramPlacement::Auto, &ckpt))?;
    let info = engram.table_info();
    ensure!(
        (info.layer, info.rows, info.width, info.location, info.bytes) == (1, rows, width, EngramLocation::Host, (rows * (width + width / 32)) as u64),
        "{info:?}"
    );
    let e = Engram::load(&cfg, 1, Numerics::REFERENCE, vb.clone(), &EngramOptions::new(EngramPlacement::Device, &ckpt))
        .expect_err("a resident released table")
        .to_string();
    ensure!(e.contains(&format!("{p}.embed.weight")) && e.contains("dense limit"), "{e}");
    let EngramTable::Host(host) = engram.table() else { bail!("Auto placed the released table as {:?}", engram.table()) };

    // Written rows decode to their values, unwritten ones (holes: code 0, scale 2^-127) to zeros.
    let ids: Vec<u32> = [rows - 1, 5, 200_000_000, 0, 300_000_000, 12_345_678, 1, rows - 1].iter().map(|&r| r as u32).collect();
    let got = bf16_bits(&host.rows(&ids)?)?;
    for (i, &r) in ids.iter().enumerate() {
        let want: Vec<u16> = match written.iter().find(|w| w.0 == r as usize) {
            Some((_, codes, sc)) => {
                dequant_fp8_rows(codes, sc, 1, width)?.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()
            }
            None => vec![0; width],
        };
        ensure!(got[i * width..(i + 1) * width] == want[..], "row {r} decodes wrongly");
    }
    ensure!(got[width..2 * width].iter().all(|&b| b == 0) && got[..width].iter().any(|&b| b != 0));

    // The module on the host table equals the module on the host-dequantized lookup.
    let t = ids.len() / 4 * 4 / cols.max(1) + 2;
    let hash: Vec<u32> = (0..t * cols).map(|i| ids[i % ids.len()]).collect();
    let hash = Tensor::from_vec(hash, (t, cols), &Device::Cpu)?;
    let mut rng = Rng(9);
    let x: Vec<f32> = (0..t * hc * d).map(|_| rng.normal()).collect();
    let x = Tensor::from_vec(x, (t, hc, d), dev)?.to_dtype(DType::BF16)?;
    let rowwise = Engram::with_table(&cfg, 1, Numerics::REFERENCE, vb, EngramTable::Rows(Box::new(ckpt.row_table(&format!("{p}.embed.weight"))?)))?;
    let (a, b) = (engram.forward(&x, &hash)?, rowwise.forward(&x, &hash)?);
    ensure!(bf16_bits(&a)? == bf16_bits(&b)?, "Engram output over the host table differs from the host-dequantized lookup's");

    let grown = rss_bytes().saturating_sub(rss_before);
    ensure!(grown < 1 << 30, "resident set grew by {grown} bytes: the table (101 GB stored) must not be read");
    Ok(())
}

/// Logits of a prompt then `steps` greedy tokens, as f32 bits per call.
fn run_bits(p: &Pretrained, steps: usize) -> Result<Vec<Vec<u32>>> {
    let mut ids = p.tokenizer.encode("ROMEO:\nBut soft, what light", true)?;
    let mut cache = p.new_cache()?;
    let mut out = Vec::new();
    for step in 0..=steps {
        let logits = p.model.forward(if step == 0 { &ids } else { &ids[ids.len() - 1..] }, &mut cache)?;
        let last = logits.get(logits.dim(0)? - 1)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let next = (0..last.len()).max_by(|&a, &b| last[a].total_cmp(&last[b])).context("empty logits")? as u32;
        out.push(logits.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect());
        ids.push(next);
    }
    Ok(out)
}

/// The embedded model on `dev`: `Auto` keeps its (small) tables resident, `Host` reads them by
/// rows, and both give the same logits bit for bit (see the module doc). Returns whether the
/// host tables staged in page-locked memory.
pub fn check_model_host_equals_device(dev: &Device) -> Result<bool> {
    let dir = repo_path("models/v41-shakespeare-tiny");
    let load = |placement| Pretrained::load_dir_with(&dir, Numerics::REFERENCE, DType::BF16, dev, placement);
    let (resident, host) = (load(EngramPlacement::Auto)?, load(EngramPlacement::Host)?);
    let cfg = resident.config.engram.clone().context("the embedded model has Engram layers")?;
    let (ra, rh) = (resident.engram_placements(), host.engram_placements());
    ensure!(ra.len() == cfg.layer_ids.len() && rh.len() == ra.len(), "{ra:?} / {rh:?}");
    for ((a, h), (&layer, &rows)) in ra.iter().zip(&rh).zip(cfg.layer_ids.iter().zip(&cfg.num_embeddings)) {
        let w = cfg.head_dim;
        ensure!((a.layer, a.rows, a.width, a.location, a.bytes) == (layer, rows, w, EngramLocation::Device, (rows * w * 2) as u64), "{a:?}");
        ensure!((h.layer, h.rows, h.width, h.location, h.bytes) == (layer, rows, w, EngramLocation::Host, (rows * (w + w / 32)) as u64), "{h:?}");
    }
    let (a, b) = (run_bits(&resident, 6)?, run_bits(&host, 6)?);
    // Tells a run-to-run difference of the device's kernels apart from one of the tables.
    ensure!(run_bits(&resident, 6)? == a, "the resident model's logits differ between two runs: no bit-for-bit comparison possible");
    for (step, (a, b)) in a.iter().zip(&b).enumerate() {
        ensure!(a == b, "call {step}: the logits with host Engram tables differ from the resident tables'");
    }
    ensure!(rh.iter().all(|i| i.device_extra_bytes > 0), "host tables decode on the device: {rh:?}");
    let modules = host.model.engram_modules();
    Ok(modules.iter().all(|e| matches!(e.table(), EngramTable::Host(h) if h.staging_pinned())))
}

/// Logits of a batched prefill of three prompts of different lengths, then a batched call of one
/// decode token for two of them and a second chunk for the third, as f32 bits per call.
fn batch_bits(p: &Pretrained) -> Result<Vec<Vec<u32>>> {
    let ids = p.tokenizer.encode("ROMEO:\nBut soft, what light through yonder window breaks? It is the east", true)?;
    ensure!(ids.len() >= 12, "the prompt encodes to {} tokens", ids.len());
    let prompts = [&ids[..3], &ids[..ids.len() - 4], &ids[..7]];
    let next: [&[u32]; 3] = [&ids[3..4], &ids[ids.len() - 4..ids.len() - 3], &ids[7..12]];
    let mut caches = prompts.iter().map(|_| p.new_cache()).collect::<candle_core::Result<Vec<_>>>()?;
    let mut out = Vec::new();
    for call in [prompts, next] {
        let mut items: Vec<BatchItem> = call.iter().zip(&mut caches).map(|(t, c)| BatchItem::new(t, c).with_logits(LogitRows::All)).collect();
        let logits = p.model.forward_batch(&mut items)?.logits;
        out.push(logits.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect());
    }
    Ok(out)
}

/// The embedded model on `dev` in batched calls (`Model::forward_batch`, each layer's ids of all
/// items concatenated on the table's ids device): with its tables on the host it gives the
/// resident tables' logits bit for bit.
pub fn check_batch_host_equals_device(dev: &Device) -> Result<()> {
    let dir = repo_path("models/v41-shakespeare-tiny");
    let load = |placement| Pretrained::load_dir_with(&dir, Numerics::REFERENCE, DType::BF16, dev, placement);
    let (resident, host) = (load(EngramPlacement::Auto)?, load(EngramPlacement::Host)?);
    ensure!(host.engram_placements().iter().all(|t| t.location == EngramLocation::Host), "{:?}", host.engram_placements());
    let a = batch_bits(&resident)?;
    ensure!(batch_bits(&resident)? == a, "the resident model's batched logits differ between two runs: no bit-for-bit comparison possible");
    for (call, (a, b)) in a.iter().zip(&batch_bits(&host)?).enumerate() {
        ensure!(a == b, "batched call {call}: the logits with host Engram tables differ from the resident tables'");
    }
    Ok(())
}

/// The embedded model's decode on the batched decode step (`SteppedGeneration`; on CUDA replayed
/// from a CUDA graph) with host Engram tables (their rows staged by `ModelDecodeStep::update`)
/// gives the tokens of the same with resident tables, greedy and sampled; on the CPU also
/// `generate`'s. 32 new tokens after a 9-token prompt.
pub fn check_stepped_host_equals_device(dev: &Device) -> Result<()> {
    use deepseek_v41::generation::{generate, Sampler, Sampling, SteppedGeneration};
    let dir = repo_path("models/v41-shakespeare-tiny");
    let load = |placement| Pretrained::load_dir_with(&dir, Numerics::REFERENCE, DType::BF16, dev, placement);
    let (resident, host) = (load(EngramPlacement::Auto)?, load(EngramPlacement::Host)?);
    ensure!(host.engram_placements().iter().all(|t| t.location == EngramLocation::Host), "{:?}", host.engram_placements());
    let prompt = resident.tokenizer.encode("KING HENRY:\nOnce more", true)?;
    for sampling in [Sampling::GREEDY, Sampling { temperature: 1.0, top_p: 0.9, seed: 3 }] {
        let run = |p: &Pretrained| -> Result<Vec<u32>> {
            let stepped = SteppedGeneration { model: &p.model, config: &p.config, graph: dev.is_cuda() };
            Ok(stepped.generate(&mut p.new_cache()?, &prompt, 32, &mut Sampler::new(sampling)?, None, |_| Ok(()))?)
        };
        let want = run(&resident)?;
        ensure!(run(&host)? == want, "{sampling:?}: the stepped tokens with host Engram tables differ from the resident tables'");
        if !dev.is_cuda() {
            let eager = generate(&resident.model, &mut resident.new_cache()?, &prompt, 32, &mut Sampler::new(sampling)?, None, |_| Ok(()))?;
            ensure!(eager == want, "{sampling:?}: the stepped tokens differ from generate's");
        }
    }
    Ok(())
}
