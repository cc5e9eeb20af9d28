//! Writing small checkpoints in the release format (safetensors via the `safetensors` crate,
//! optionally sharded with `model.safetensors.index.json`) into unique temporary folders.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Result;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A unique temporary folder, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates `<temp>/dsv41-loader-<pid>-<tag>-<n>`.
    pub fn new(tag: &str) -> Result<Self> {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let p = std::env::temp_dir().join(format!("dsv41-loader-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One stored tensor to write.
#[derive(Clone)]
pub struct Raw {
    /// Checkpoint name.
    pub name: String,
    /// Stored dtype.
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes, `numel * size` long.
    pub data: Vec<u8>,
}

/// Shorthand for a [`Raw`].
pub fn raw(name: &str, dtype: Dtype, shape: &[usize], data: Vec<u8>) -> Raw {
    Raw {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

/// Writes `tensors` as one safetensors file (the `safetensors` crate's serializer).
pub fn write_st(path: &Path, tensors: &[Raw]) -> Result<()> {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|t| Ok((t.name.clone(), TensorView::new(t.dtype, t.shape.clone(), &t.data)?)))
        .collect::<Result<_>>()?;
    std::fs::write(path, safetensors::serialize(views, None)?)?;
    Ok(())
}

/// Deterministic bytes; e4m3 NaN codes (0x7f, 0xff) avoided.
pub fn bytes(n: usize, seed: u32, fp8: bool) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1103515245).wrapping_add(12345);
            let b = (x >> 16) as u8;
            if fp8 && b & 0x7f == 0x7f {
                b ^ 1
            } else {
                b
            }
        })
        .collect()
}

/// Deterministic e8m0 scale bytes in 2^-12 ..= 2^7.
pub fn scales(n: usize, seed: u32) -> Vec<u8> {
    bytes(n, seed, false).iter().map(|b| 115 + b % 20).collect()
}

/// Little-endian bf16 bytes of `v` (rounded).
pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect()
}

/// Little-endian f32 bytes of `v`.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes `t` as two shards plus `model.safetensors.index.json`; returns the shard names.
pub fn write_sharded(dir: &Path, t: &[Raw]) -> Result<[String; 2]> {
    let names = [
        "model-00001-of-00002.safetensors".to_string(),
        "model-00002-of-00002.safetensors".to_string(),
    ];
    // Split a weight from its scale on purpose: companions may live in another shard.
    let a: Vec<Raw> = t.iter().step_by(2).cloned().collect();
    let b: Vec<Raw> = t.iter().skip(1).step_by(2).cloned().collect();
    write_st(&dir.join(&names[0]), &a)?;
    write_st(&dir.join(&names[1]), &b)?;
    let mut map = serde_json::Map::new();
    for (shard, part) in names.iter().zip([&a, &b]) {
        for r in part {
            map.insert(r.name.clone(), serde_json::Value::String(shard.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    Ok(names)
}
