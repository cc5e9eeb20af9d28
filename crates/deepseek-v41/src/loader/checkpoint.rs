//! [`ReleaseCheckpoint`]: a memory-mapped release checkpoint (one or several safetensors shards,
//! optionally described by `model.safetensors.index.json`) that hands out dequantized tensors.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use super::error::LoadError;
use super::layout::{classify, scale_name, weight_of_scale, StoredTensor, TensorInfo};
use super::shard::{RawEntry, Shard};
use super::staging::materialize;
use super::usage::Usage;

/// The index file name of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";

struct Entry {
    shard: usize,
    raw: RawEntry,
}

/// Called with the stored bytes of each tensor read ([`ReleaseCheckpoint::set_progress`]).
type Progress = Arc<dyn Fn(u64) + Send + Sync>;

struct Inner {
    shards: Vec<Shard>,
    entries: HashMap<String, Entry>,
    usage: Mutex<Usage>,
    progress: Mutex<Option<Progress>>,
}

/// A release-format checkpoint (spec §12), memory-mapped.
///
/// Tensors are addressed by their checkpoint names (`layers.0.attn.wq_a.weight`). Quantized
/// weights are dequantized on [`get`](Self::get) (see [`WeightFormat`](super::layout::WeightFormat)); their `.scale`
/// companions are not variables of their own. The stored bytes of an FP8 or MXFP4 weight are available
/// as they are through [`get_stored_part`](Self::get_stored_part) (`loader::native`). Cloning is cheap (shared maps and usage record).
///
/// Every successful `get` / row lookup records the name as used, for
/// [`check_all_used`](Self::check_all_used).
#[derive(Clone)]
pub struct ReleaseCheckpoint {
    inner: Arc<Inner>,
}

#[derive(Deserialize)]
struct IndexJson {
    weight_map: BTreeMap<String, String>,
}

impl ReleaseCheckpoint {
    /// Opens one or several safetensors files, `model.safetensors.index.json` files (whose
    /// shards are opened and cross-checked) or folders (as [`open_dir`](Self::open_dir)). A
    /// tensor name present in two files is an error.
    pub fn open<P: AsRef<Path>>(paths: &[P]) -> Result<Self, LoadError> {
        let mut files = Vec::new();
        let mut indexes = Vec::new();
        for p in paths {
            let p = &resolve_dir(p.as_ref())?;
            if p.extension().is_some_and(|e| e == "json") {
                let (shards, map) = read_index(p)?;
                files.extend(shards);
                indexes.push((p.to_path_buf(), map));
            } else {
                files.push(p.to_path_buf());
            }
        }
        let mut seen = BTreeSet::new();
        files.retain(|f| seen.insert(f.clone()));
        let ckpt = Self::open_files(&files)?;
        for (index, map) in &indexes {
            ckpt.check_index(index, map)?;
        }
        Ok(ckpt)
    }

    /// Opens a checkpoint folder: `model.safetensors.index.json` and its shards if the index
    /// exists, otherwise `model.safetensors`.
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<Self, LoadError> {
        Self::open(&[resolve_dir(dir.as_ref())?])
    }

    fn open_files(files: &[PathBuf]) -> Result<Self, LoadError> {
        let mut shards = Vec::with_capacity(files.len());
        let mut entries: HashMap<String, Entry> = HashMap::new();
        for path in files {
            let (shard, raws) = Shard::open(path)?;
            let idx = shards.len();
            for raw in raws {
                if let Some(prev) = entries.get(&raw.name) {
                    let first: &Shard = &shards[prev.shard];
                    return Err(LoadError::Duplicate {
                        name: raw.name,
                        first: first.path().to_path_buf(),
                        second: path.clone(),
                    });
                }
                entries.insert(raw.name.clone(), Entry { shard: idx, raw });
            }
            shards.push(shard);
        }
        Ok(Self {
            inner: Arc::new(Inner {
                shards,
                entries,
                usage: Mutex::new(Usage::default()),
                progress: Mutex::new(None),
            }),
        })
    }

    /// Every name of the index must be in the shard it names.
    fn check_index(&self, index: &Path, map: &BTreeMap<String, PathBuf>) -> Result<(), LoadError> {
        for (name, shard) in map {
            match self.inner.entries.get(name) {
                Some(e) if self.inner.shards[e.shard].path() == shard => {}
                Some(e) => {
                    return Err(LoadError::BadIndex {
                        path: index.to_path_buf(),
                        detail: format!(
                            "maps `{name}` to {} but it is in {}",
                            shard.display(),
                            self.inner.shards[e.shard].path().display()
                        ),
                    })
                }
                None => {
                    return Err(LoadError::BadIndex {
                        path: index.to_path_buf(),
                        detail: format!("maps `{name}` to {} but that shard has no such tensor", shard.display()),
                    })
                }
            }
        }
        Ok(())
    }

    /// The shard files, in opening order.
    pub fn files(&self) -> Vec<PathBuf> {
        self.inner.shards.iter().map(|s| s.path().to_path_buf()).collect()
    }

    /// Logical tensor names, sorted: every stored tensor except the `.scale` companions of
    /// weights.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .inner
            .entries
            .keys()
            .filter(|n| !self.is_companion(n))
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// Every stored tensor name, `.scale` companions included, sorted.
    pub fn stored_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.inner.entries.keys().cloned().collect();
        v.sort();
        v
    }

    /// Whether `name` is a logical tensor of the checkpoint (a `.scale` companion is not).
    pub fn contains(&self, name: &str) -> bool {
        self.inner.entries.contains_key(name) && !self.is_companion(name)
    }

    /// Whether `name` is the `.scale` companion of a stored weight.
    pub fn is_companion(&self, name: &str) -> bool {
        weight_of_scale(name).is_some_and(|w| self.inner.entries.contains_key(&w))
    }

    fn stored(&self, name: &str) -> Option<StoredTensor> {
        let e = self.inner.entries.get(name)?;
        Some(StoredTensor {
            name: name.to_string(),
            file: self.inner.shards[e.shard].path().to_path_buf(),
            dtype: e.raw.dtype,
            shape: e.raw.shape.clone(),
            byte_range: e.raw.range.clone(),
        })
    }

    /// The format, logical shape and storage of the logical tensor `name`. Errors if it is
    /// missing, is a `.scale` companion, or its dtype / scale combination is not supported.
    pub fn info(&self, name: &str) -> Result<TensorInfo, LoadError> {
        if self.is_companion(name) {
            let w = weight_of_scale(name).unwrap_or_default();
            return Err(LoadError::Missing {
                name: name.to_string(),
                hint: format!(" as a variable: it is the scale companion of `{w}`, dequantized with it"),
            });
        }
        let Some(stored) = self.stored(name) else {
            return Err(LoadError::Missing {
                name: name.to_string(),
                hint: String::new(),
            });
        };
        let scale = scale_name(name).and_then(|s| self.stored(&s));
        let (format, shape) = classify(&stored, scale.as_ref())?;
        Ok(TensorInfo {
            name: name.to_string(),
            format,
            shape,
            stored,
            scale,
        })
    }

    /// The raw stored bytes of any stored tensor (companions included), straight from the map.
    pub fn raw_bytes(&self, name: &str) -> Result<&[u8], LoadError> {
        let e = self.inner.entries.get(name).ok_or_else(|| LoadError::Missing {
            name: name.to_string(),
            hint: String::new(),
        })?;
        Ok(self.inner.shards[e.shard].bytes(e.raw.range.clone()))
    }

    pub(super) fn bytes_of(&self, t: &StoredTensor) -> Result<&[u8], LoadError> {
        self.raw_bytes(&t.name)
    }

    /// Releases the mapped pages of `t` (see [`Shard::release`]) once its bytes were copied.
    pub(super) fn release(&self, t: &StoredTensor) {
        if let Some(e) = self.inner.entries.get(&t.name) {
            self.inner.shards[e.shard].release(e.raw.range.clone());
        }
    }

    /// Marks the pages of `t` as read at random (see [`Shard::advise_random`]).
    pub(super) fn advise_random(&self, t: &StoredTensor) {
        if let Some(e) = self.inner.entries.get(&t.name) {
            self.inner.shards[e.shard].advise_random(e.raw.range.clone());
        }
    }

    /// The logical tensor `name`, dequantized, as `dtype` on `device`.
    ///
    /// Returns the logical shape of [`info`](Self::info) (e.g. `[out, in]` for an MXFP4 weight
    /// stored as `[out, in/2]`). FP8 / MXFP4 weights are dequantized exactly (spec §2.4, the
    /// values of the f32 dequantization cast to `dtype`); unquantized tensors are cast from their
    /// stored dtype. The bytes go from the map to `device` with a bounded host footprint: on CUDA
    /// in their stored dtype, cast or dequantized on the device where a kernel exists, otherwise
    /// in chunks of [`super::staging::STAGING_CHUNK_BYTES`] (`loader::staging`). Records `name`
    /// as used and the bytes of the result as placed ([`placed_bytes`](Self::placed_bytes)).
    /// The tensor's mapped pages are released once copied out (see [`Shard::release`]), so the
    /// process does not keep the checkpoint resident while loading.
    ///
    /// Errors ([`LoadError::TooLarge`]) if the tensor would take more than the dense limit
    /// ([`set_dense_limit`](Self::set_dense_limit)) as f32: use [`row_table`](Self::row_table)
    /// for the Engram tables.
    pub fn get(&self, name: &str, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        let info = self.info(name)?;
        let limit = self.dense_limit();
        let bytes = info.shape.iter().product::<usize>().saturating_mul(4);
        if bytes > limit {
            return Err(LoadError::TooLarge {
                name: name.to_string(),
                shape: info.shape,
                bytes,
                limit,
            }
            .into());
        }
        let t = materialize(self, &info, dtype, device)?;
        // `t` owns its data: the mapped pages of the weight and scale can go.
        self.release(&info.stored);
        if let Some(scale) = &info.scale {
            self.release(scale);
        }
        self.report_progress(info.stored.byte_range.len() + info.scale.as_ref().map_or(0, |s| s.byte_range.len()));
        self.record_placed(name, &t);
        self.mark_used(name);
        Ok(t)
    }

    /// Calls `progress` with the stored bytes (weight and scale) of every tensor [`get`](Self::get)
    /// reads from now on, e.g. to drive a progress bar over [`stored_bytes`](Self::stored_bytes).
    pub fn set_progress(&self, progress: impl Fn(u64) + Send + Sync + 'static) {
        *self.inner.progress.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(progress));
    }

    /// Calls the progress callback (if any) with `bytes` stored bytes read.
    pub(super) fn report_progress(&self, bytes: usize) {
        if let Some(progress) = self.inner.progress.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            progress(bytes as u64);
        }
    }

    /// The bytes of every stored tensor of every shard (headers excluded).
    pub fn stored_bytes(&self) -> u64 {
        self.inner.entries.values().map(|e| e.raw.range.len() as u64).sum()
    }

    pub(super) fn usage(&self) -> std::sync::MutexGuard<'_, Usage> {
        self.inner.usage.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub(super) fn missing_scale(name: &str) -> LoadError {
    LoadError::BadFormat {
        name: name.to_string(),
        detail: "quantized weight lost its scale companion".to_string(),
    }
}

pub(super) fn with_name(name: &str, e: LoadError) -> LoadError {
    LoadError::BadFormat {
        name: name.to_string(),
        detail: e.to_string(),
    }
}

/// A folder's checkpoint file: its index if there is one, else `model.safetensors`. Other
/// paths are returned unchanged.
fn resolve_dir(dir: &Path) -> Result<PathBuf, LoadError> {
    if !dir.is_dir() {
        return Ok(dir.to_path_buf());
    }
    for name in [INDEX_FILE, SINGLE_FILE] {
        let p = dir.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(LoadError::Io {
        path: dir.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("neither {INDEX_FILE} nor {SINGLE_FILE} in this folder"),
        ),
    })
}

/// Reads an index file: the shard paths (deduplicated, relative to the index's folder, each
/// checked to exist) and the name -> shard map.
fn read_index(index: &Path) -> Result<(Vec<PathBuf>, BTreeMap<String, PathBuf>), LoadError> {
    let text = std::fs::read_to_string(index).map_err(|source| LoadError::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let parsed: IndexJson = serde_json::from_str(&text).map_err(|e| LoadError::BadIndex {
        path: index.to_path_buf(),
        detail: format!("not a valid index: {e}"),
    })?;
    let dir = index.parent().unwrap_or_else(|| Path::new("."));
    let mut shards = Vec::new();
    let mut seen = BTreeSet::new();
    let mut map = BTreeMap::new();
    for (name, file) in parsed.weight_map {
        let path = dir.join(&file);
        if seen.insert(path.clone()) {
            if !path.is_file() {
                return Err(LoadError::MissingShard {
                    index: index.to_path_buf(),
                    shard: path,
                    tensor: name,
                });
            }
            shards.push(path.clone());
        }
        map.insert(name, path);
    }
    Ok((shards, map))
}
