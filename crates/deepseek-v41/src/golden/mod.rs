//! Checker for golden sets produced by the official V4.1 reference (the format of
//! `tests/fixtures/v41-tiny`, described in its README and MANIFEST).
//!
//! A set is a folder with `config.json`, `model.safetensors`, an optional `modules/` folder of
//! module-level goldens and one folder per case (`inputs.json` + `golden.safetensors`, optionally
//! its own `config.json` / `model.safetensors`). The checker is driven by the golden files: every
//! tensor a case holds is compared with what this crate computes under the same name, or
//! reported as `SKIP name: reason`. Nothing is specific to one set: dims, head counts, windows,
//! sharing layouts and chunkings all come from the set's files.

pub mod compare;
pub mod decisions;
pub mod end_to_end;
pub mod module_formats;
pub mod modules;
pub mod runner;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Result, Tensor};
use serde::Deserialize;

use crate::config::Config;
use crate::model::TokenMap;
pub use compare::{compare, Outcome, Report, Tolerance};
pub use runner::RunOptions;

/// One forward call of a case: tokens `input_ids[start_pos .. start_pos + length]`.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
pub struct Call {
    /// Position of the call's first token.
    pub start_pos: usize,
    /// Number of tokens.
    pub length: usize,
}

/// `inputs.json` of a case.
#[derive(Debug, Clone, Deserialize)]
pub struct Inputs {
    /// The whole token sequence.
    pub input_ids: Vec<u32>,
    /// The forward calls, contiguous from position 0.
    pub calls: Vec<Call>,
    /// Cache fake-quant (QAT) on; defaults to the trained behaviour.
    #[serde(default = "default_true")]
    pub qat: bool,
    /// How the Engram compressed token map was built (free text).
    #[serde(default)]
    pub compressed_token_map: Option<String>,
}

fn default_true() -> bool {
    true
}

/// One case of a golden set.
#[derive(Debug)]
pub struct Case {
    /// Folder name.
    pub name: String,
    /// The case folder.
    pub dir: PathBuf,
    /// The case's configuration.
    pub config: Config,
    /// `inputs.json`.
    pub inputs: Inputs,
    /// The checkpoint file of the case.
    pub weights: PathBuf,
    /// Golden tensors by name.
    pub golden: HashMap<String, Tensor>,
}

/// A golden set on disk.
#[derive(Debug)]
pub struct GoldenSet {
    /// The set's folder.
    pub root: PathBuf,
    /// Case folders, sorted by name.
    pub cases: Vec<PathBuf>,
    /// `modules/golden.safetensors`, if present.
    pub modules: Option<PathBuf>,
}

fn msg(s: String) -> candle_core::Error {
    candle_core::Error::Msg(s)
}

impl GoldenSet {
    /// Scans `root`.
    pub fn open(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        let entries = std::fs::read_dir(&root).map_err(|e| msg(format!("golden set {}: {e}", root.display())))?;
        let mut cases = Vec::new();
        for e in entries {
            let p = e.map_err(|e| msg(format!("golden set {}: {e}", root.display())))?.path();
            let is_modules = p.file_name().is_some_and(|n| n == "modules");
            if !is_modules && p.join("inputs.json").is_file() && p.join("golden.safetensors").is_file() {
                cases.push(p);
            }
        }
        cases.sort();
        let modules = Some(root.join("modules/golden.safetensors")).filter(|p| p.is_file());
        if cases.is_empty() && modules.is_none() {
            candle_core::bail!("{} holds no golden case (no <case>/inputs.json + golden.safetensors)", root.display())
        }
        Ok(Self { root, cases, modules })
    }

    /// Reads `<dir>/inputs.json`.
    pub fn load_inputs(&self, dir: &Path) -> Result<Inputs> {
        let path = dir.join("inputs.json");
        let text = std::fs::read_to_string(&path).map_err(|e| msg(format!("{}: {e}", path.display())))?;
        serde_json::from_str(&text).map_err(|e| msg(format!("{}: {e}", path.display())))
    }

    /// Loads case `dir` (config, inputs, checkpoint path, goldens) onto `device`.
    pub fn load_case(&self, dir: &Path, device: &Device) -> Result<Case> {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let config_path = [dir.join("config.json"), self.root.join("config.json")]
            .into_iter()
            .find(|p| p.is_file())
            .ok_or_else(|| msg(format!("case {name}: no config.json in the case or the set")))?;
        let config = Config::from_file(&config_path)?;
        let inputs = self.load_inputs(dir)?;
        validate_calls(&name, &inputs)?;
        let weights = [dir.join("model.safetensors"), self.root.join("model.safetensors")]
            .into_iter()
            .filter_map(|p| resolve_pointer(&p))
            .next()
            .ok_or_else(|| msg(format!("case {name}: no model.safetensors in the case or the set")))?;
        let golden = candle_core::safetensors::load(dir.join("golden.safetensors"), device)?;
        Ok(Case { name, dir: dir.to_path_buf(), config, inputs, weights, golden })
    }
}

impl GoldenSet {
    /// The Engram compressed token map of a case: the set's `engram.token_map` module golden if
    /// present, else the synthetic `id // 2` map when `inputs.json` says so; `None` when the
    /// config has no Engram layer.
    pub fn token_map(&self, case: &Case) -> Result<Option<TokenMap>> {
        if case.config.engram.is_none() {
            return Ok(None);
        }
        if let Some(map) = declared_token_map(&case.inputs, case.config.vocab_size) {
            return Ok(Some(map));
        }
        if let Some(m) = &self.modules {
            let st = candle_core::safetensors::load(m, &Device::Cpu)?;
            if let Some(t) = st.get("engram.token_map") {
                let v: Vec<u32> = t.to_dtype(candle_core::DType::I64)?.to_vec1::<i64>()?.into_iter().map(|x| x as u32).collect();
                return Ok(Some(TokenMap::new(v)?));
            }
        }
        candle_core::bail!(
            "case {}: the config has Engram layers but inputs.json declares no known token map ({:?}) and the set has no engram.token_map",
            case.name,
            case.inputs.compressed_token_map
        )
    }
}

/// The Engram token map a case's `inputs.json` declares in words, when it is one this checker
/// knows: the synthetic `id // 2` map of tokenizer-less golden sets.
pub fn declared_token_map(inputs: &Inputs, vocab_size: usize) -> Option<TokenMap> {
    let words = inputs.compressed_token_map.as_deref()?;
    words.contains("id // 2").then(|| TokenMap::div2(vocab_size))
}

fn validate_calls(name: &str, inputs: &Inputs) -> Result<()> {
    let mut next = 0;
    for (i, c) in inputs.calls.iter().enumerate() {
        if c.start_pos != next || c.length == 0 || c.start_pos + c.length > inputs.input_ids.len() {
            candle_core::bail!(
                "case {name}: calls[{i}] = {{start_pos: {}, length: {}}} does not continue at {next} within {} tokens",
                c.start_pos,
                c.length,
                inputs.input_ids.len()
            )
        }
        next += c.length;
    }
    Ok(())
}

/// A checkpoint path, following a lost symlink stored as a small text file holding a relative
/// path (as in some copies of the sets).
fn resolve_pointer(p: &Path) -> Option<PathBuf> {
    let meta = std::fs::metadata(p).ok()?;
    if meta.len() < 1024 {
        let target = std::fs::read_to_string(p).ok()?;
        let target = p.parent()?.join(target.trim());
        return target.is_file().then_some(target);
    }
    Some(p.to_path_buf())
}

/// Checks a whole set: module goldens, then every case. Prints one line per compared tensor and
/// returns the report (the caller prints the summary).
///
/// The models run on `device`; the golden tensors stay on the host (only the inputs a run
/// needs are moved to `device`, and results are compared on the host). The module goldens are
/// bit-level checks of the host reference functions and always run on the host.
pub fn check_set(root: impl AsRef<Path>, device: &Device) -> Result<Report> {
    check_set_opts(root, device, RunOptions::default())
}

/// [`check_set`] with the attention caches of the model runs in `storage` (packed: cases with
/// QAT off still run bf16 caches, see `runner::check_case`).
pub fn check_set_with(root: impl AsRef<Path>, device: &Device, storage: crate::attention::CacheStorage) -> Result<Report> {
    check_set_opts(root, device, RunOptions { storage, ..Default::default() })
}

/// [`check_set`] with the model runs set up as `opts` says: cache storage (as
/// [`check_set_with`]) and how the quantized weights are held (FP8 as stored or dequantized; on
/// CUDA only).
pub fn check_set_opts(root: impl AsRef<Path>, device: &Device, opts: RunOptions) -> Result<Report> {
    let set = GoldenSet::open(root)?;
    let mut report = Report::default();
    if let Some(m) = &set.modules {
        if !device.is_cpu() {
            println!("NOTE modules: module goldens check the host reference functions bit for bit; run on the host");
        }
        modules::check_modules(&set, m, &Device::Cpu, &mut report)?;
    }
    for dir in &set.cases {
        let case = set.load_case(dir, &Device::Cpu)?;
        let token_map = set.token_map(&case)?;
        runner::check_case(&case, token_map.as_ref(), device, opts, &mut report)?;
    }
    Ok(report)
}
