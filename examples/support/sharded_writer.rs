//! Writes a checkpoint as safetensors shards plus `model.safetensors.index.json` (the release
//! layout, spec §12.1), streaming every tensor to disk in fixed-size chunks: the host holds one
//! chunk, never a tensor or a shard (include it with
//! `#[path = "support/sharded_writer.rs"] mod sharded_writer;`).
//!
//! The safetensors layout (<https://github.com/huggingface/safetensors#format>): an 8-byte
//! little-endian header length, the JSON header (`{name: {dtype, shape, data_offsets}}` plus
//! `__metadata__`, padded with spaces to a multiple of 8 bytes), then the tensors' bytes in the
//! header's offset order.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::synthetic_values::{Content, Stream};

/// Bytes generated and written per step.
const CHUNK: usize = 4 << 20;

/// One stored tensor to write.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Checkpoint name.
    pub name: String,
    /// safetensors dtype string (`F8_E4M3`, `F8_E8M0`, `I8`, `U8`, `BF16`, `F32`).
    pub dtype: &'static str,
    /// Stored shape.
    pub shape: Vec<usize>,
    /// Bytes per element of `dtype`.
    pub elem_bytes: usize,
    /// What its bytes are.
    pub content: Content,
}

impl Planned {
    /// Stored bytes.
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.elem_bytes as u64
    }
}

/// The shard file name of shard `i` (0-based) of `n`: `model-0000{i+1}-of-0000{n}.safetensors`.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
}

/// Splits `tensors` (in order) into shards of at most `max_bytes` each; a tensor larger than
/// `max_bytes` gets a shard of its own.
pub fn plan_shards(tensors: Vec<Planned>, max_bytes: u64) -> Vec<Vec<Planned>> {
    let mut shards: Vec<Vec<Planned>> = Vec::new();
    let mut size = 0u64;
    for t in tensors {
        match shards.last_mut() {
            Some(last) if size + t.bytes() <= max_bytes => {
                size += t.bytes();
                last.push(t);
            }
            _ => {
                size = t.bytes();
                shards.push(vec![t]);
            }
        }
    }
    shards
}

/// Removes the checkpoint files a previous run may have left in `dir` (`model.safetensors`,
/// `model-*-of-*.safetensors`, the index), so that the folder holds one checkpoint.
pub fn remove_old_checkpoint(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let shard = name.starts_with("model-") && name.contains("-of-") && name.ends_with(".safetensors");
        if shard || name == "model.safetensors" || name == "model.safetensors.index.json" {
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// The JSON header of one shard, padded to a multiple of 8 bytes.
fn header(tensors: &[Planned]) -> Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut at = 0u64;
    for t in tensors {
        let end = at + t.bytes();
        map.insert(t.name.clone(), serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [at, end]}));
        at = end;
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(map))?;
    h.resize(h.len().div_ceil(8) * 8, b' ');
    Ok(h)
}

/// Writes one shard: header, then every tensor's bytes from its content stream.
fn write_shard(path: &Path, tensors: &[Planned], buf: &mut [u8]) -> Result<u64> {
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::with_capacity(CHUNK, file);
    let h = header(tensors)?;
    w.write_all(&(h.len() as u64).to_le_bytes())?;
    w.write_all(&h)?;
    let mut written = 8 + h.len() as u64;
    for t in tensors {
        let mut stream = Stream::new(t.content, &t.name);
        let mut left = t.bytes();
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            stream.fill(&mut buf[..n]);
            w.write_all(&buf[..n]).with_context(|| format!("writing {}", path.display()))?;
            left -= n as u64;
        }
        written += t.bytes();
    }
    w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    Ok(written)
}

/// What [`write_checkpoint`] wrote.
pub struct Written {
    /// The shard paths.
    pub shards: Vec<PathBuf>,
    /// Stored tensors.
    pub tensors: usize,
    /// Bytes of all shards (headers included).
    pub bytes: u64,
    /// Seconds spent generating and writing (file syncs included).
    pub secs: f64,
}

/// Writes `tensors` into `dir` as shards of at most `max_shard_bytes` plus
/// `model.safetensors.index.json`, printing one line per shard.
pub fn write_checkpoint(dir: &Path, tensors: Vec<Planned>, max_shard_bytes: u64) -> Result<Written> {
    let count = tensors.len();
    let total: u64 = tensors.iter().map(Planned::bytes).sum();
    let shards = plan_shards(tensors, max_shard_bytes);
    if shards.is_empty() {
        bail!("no tensors to write");
    }
    let mut weight_map = serde_json::Map::new();
    let mut paths = Vec::new();
    let mut buf = vec![0u8; CHUNK];
    let (t0, mut bytes) = (Instant::now(), 0u64);
    for (i, shard) in shards.iter().enumerate() {
        let name = shard_name(i, shards.len());
        let path = dir.join(&name);
        let n = write_shard(&path, shard, &mut buf)?;
        bytes += n;
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "  {name}: {} tensors, {:.2} GB ({:.1} of {:.1} GB in {secs:.0} s)",
            shard.len(),
            n as f64 / 1e9,
            bytes as f64 / 1e9,
            total as f64 / 1e9
        );
        for t in shard {
            weight_map.insert(t.name.clone(), serde_json::Value::String(name.clone()));
        }
        paths.push(path);
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index)?)?;
    Ok(Written { shards: paths, tensors: count, bytes, secs: t0.elapsed().as_secs_f64() })
}
