//! Loading a model folder in one call: `config.json`, the checkpoint (`model.safetensors` or a
//! sharded `model.safetensors.index.json`), `tokenizer.json`, the Engram token map built from the
//! tokenizer — with a strict check of the checkpoint's tensor names.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Result};

use super::decoder::{Model, ModelCache};
use super::engram_placement::{EngramOptions, EngramPlacement, EngramTableInfo};
use crate::attention::CacheStorage;
use crate::config::Config;
use crate::loader::{var_builder_with, QuantizedWeights, ReleaseCheckpoint};
use crate::numerics::Numerics;
use crate::parallel::{Collective, ExpertPlacement};
use crate::tokenizer::{engram_token_map, Tokenizer};

/// How [`Pretrained`] holds the weights it loads. A [`QuantizedWeights`] converts into it (with
/// the default [`EngramPlacement::Auto`]), so `load_with(.., QuantizedWeights::Native)` reads
/// as before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadOptions {
    /// The quantized weights' format once loaded (takes effect on CUDA only).
    pub quantized: QuantizedWeights,
    /// Where the Engram tables live: [`EngramPlacement::Auto`] keeps the released tables
    /// (~100 GB each) in the memory-mapped checkpoint and small ones on the device.
    pub engram: EngramPlacement,
}

impl From<QuantizedWeights> for LoadOptions {
    fn from(quantized: QuantizedWeights) -> Self {
        Self { quantized, ..Self::default() }
    }
}

impl From<EngramPlacement> for LoadOptions {
    fn from(engram: EngramPlacement) -> Self {
        Self { engram, ..Self::default() }
    }
}

/// A loaded model with its configuration and tokenizer.
#[derive(Debug)]
pub struct Pretrained {
    /// The resolved configuration.
    pub config: Config,
    /// The model.
    pub model: Model,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Activation dtype.
    pub dtype: DType,
    /// Device the model runs on.
    pub device: Device,
    /// How the quantized weights were loaded (takes effect on CUDA only; see
    /// [`QuantizedWeights`]).
    pub quantized_weights: QuantizedWeights,
    /// The Engram placement asked for ([`Pretrained::engram_placements`]: where each table went).
    pub engram_placement: EngramPlacement,
}

impl Pretrained {
    /// Loads the model folder `dir` strictly: one error ([`crate::loader::LoadError::Mismatch`])
    /// lists every missing or malformed text-model tensor and every unexpected one (MTP `mtp.*`,
    /// vision `vision.*` / `aligner.*` / `image_*` tensors are recognised and not loaded, spec
    /// §10). Activations run in `dtype` on `device`; quantized weights are loaded
    /// [`QuantizedWeights::Native`] (FP8 linears keep their release format on CUDA).
    pub fn load_dir(dir: impl AsRef<Path>, numerics: Numerics, dtype: DType, device: &Device) -> Result<Self> {
        Self::load_dir_with(dir, numerics, dtype, device, QuantizedWeights::default())
    }

    /// [`Pretrained::load_dir`] with the given options: the policy for the quantized weights
    /// ([`QuantizedWeights::Dequantized`]: every weight dense, the baseline) and the Engram
    /// placement ([`LoadOptions`]; a bare [`QuantizedWeights`] or [`EngramPlacement`] converts).
    pub fn load_dir_with(
        dir: impl AsRef<Path>,
        numerics: Numerics,
        dtype: DType,
        device: &Device,
        options: impl Into<LoadOptions>,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let config = Config::from_file(dir.join("config.json"))?;
        let tokenizer = Tokenizer::from_file(find(dir, &["tokenizer.json", "tokenizer.json.gz"])?)?;
        let ckpt = ReleaseCheckpoint::open_dir(dir)?;
        Self::load_with(config, tokenizer, ckpt, numerics, dtype, device, options)
    }

    /// Builds the model from parts (see [`Pretrained::load_dir`]).
    pub fn load(
        config: Config,
        tokenizer: Tokenizer,
        ckpt: ReleaseCheckpoint,
        numerics: Numerics,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::load_with(config, tokenizer, ckpt, numerics, dtype, device, LoadOptions::default())
    }

    /// [`Pretrained::load`] with the given options ([`LoadOptions`]: quantized weights, Engram
    /// placement; the tables placed in host memory are read by rows from `ckpt`).
    pub fn load_with(
        config: Config,
        tokenizer: Tokenizer,
        ckpt: ReleaseCheckpoint,
        numerics: Numerics,
        dtype: DType,
        device: &Device,
        options: impl Into<LoadOptions>,
    ) -> Result<Self> {
        Self::load_parts(config, tokenizer, ckpt, (numerics, dtype, device), options.into(), None)
    }

    /// [`Pretrained::load_with`] as rank `comm.rank()` of an expert-parallel group of
    /// `comm.world()` ranks ([`Model::expert_parallel`]): every MoE layer holds only the rank's
    /// share of the routed experts ([`ExpertPlacement::new`]), and only those experts' tensors
    /// are read from `ckpt` — the strict check expects the other ranks' experts unused. Every
    /// rank of the group loads its own and makes the group's calls (`Model::expert_parallel`'s
    /// protocol; [`crate::parallel::run_local_ranks`] runs the ranks as threads).
    #[allow(clippy::too_many_arguments)]
    pub fn load_rank(
        config: Config,
        tokenizer: Tokenizer,
        ckpt: ReleaseCheckpoint,
        numerics: Numerics,
        dtype: DType,
        device: &Device,
        options: impl Into<LoadOptions>,
        comm: Arc<dyn Collective>,
    ) -> Result<Self> {
        Self::load_parts(config, tokenizer, ckpt, (numerics, dtype, device), options.into(), Some(comm))
    }

    fn load_parts(
        config: Config,
        tokenizer: Tokenizer,
        ckpt: ReleaseCheckpoint,
        (numerics, dtype, device): (Numerics, DType, &Device),
        options: LoadOptions,
        group: Option<Arc<dyn Collective>>,
    ) -> Result<Self> {
        let LoadOptions { quantized, engram } = options;
        if tokenizer.vocab_size() > config.vocab_size {
            candle_core::bail!("tokenizer has {} ids but the model's vocab_size is {}", tokenizer.vocab_size(), config.vocab_size)
        }
        let token_map = match config.engram {
            Some(_) => Some(engram_token_map(&tokenizer)?),
            None => None,
        };
        ckpt.set_collect_missing(true);
        let vb = var_builder_with(ckpt.clone(), dtype, device, quantized);
        let engram_options = EngramOptions::new(engram, &ckpt);
        let placement = match &group {
            Some(comm) => Some(ExpertPlacement::new(config.n_routed_experts, comm.world(), comm.rank())?),
            None => None,
        };
        let model = match (&group, placement) {
            (Some(comm), Some(placement)) => Model::expert_parallel(&config, numerics, token_map, vb, &engram_options, placement, comm.clone()),
            _ => Model::with_engram(&config, numerics, token_map, vb, &engram_options),
        };
        let model = match model {
            // A failure unrelated to the checkpoint's names: the unused list would be noise.
            Err(e) if ckpt.load_problems().is_empty() => return Err(e),
            model => model,
        };
        ckpt.check_strict_except(|name| placement.is_some_and(|p| p.held_elsewhere(name)))?;
        let model = model?;
        Ok(Self { config, model, tokenizer, dtype, device: device.clone(), quantized_weights: quantized, engram_placement: engram })
    }

    /// Every Engram table by layer: rows, width, where it lives and its bytes there
    /// ([`Model::engram_placements`]).
    pub fn engram_placements(&self) -> Vec<EngramTableInfo> {
        self.model.engram_placements()
    }

    /// A fresh cache for one sequence.
    pub fn new_cache(&self) -> Result<ModelCache> {
        ModelCache::new(&self.config, self.dtype, &self.device)
    }

    /// A fresh cache for one sequence with its rows in `storage` ([`CacheStorage::Packed`]: the
    /// V4.1 formats A / B / E, ~3.6x fewer long-range bytes and the same results — bit for bit
    /// where the attention kernel is the same for both storages, see
    /// `Attention::forward_fused`; needs the `cuda` feature and the reference
    /// numerics' cache fake quant).
    pub fn new_cache_with(&self, storage: CacheStorage) -> Result<ModelCache> {
        ModelCache::with_storage(&self.config, storage, self.dtype, &self.device)
    }
}

fn find(dir: &Path, names: &[&str]) -> Result<PathBuf> {
    names
        .iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
        .ok_or_else(|| candle_core::Error::Msg(format!("{} holds none of {names:?}", dir.display())))
}
