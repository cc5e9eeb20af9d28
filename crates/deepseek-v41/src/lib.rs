#![warn(missing_docs)]

//! DeepSeek V4.1 on Candle.
//!
//! The crate is organised as the spec (`docs/architecture.md` maps files to spec sections).
//! "spec §N" in the crate's comments refers to the vendored spec in `docs/spec/` (index:
//! `docs/spec/README.md`).
//!
//! * [`config`]: the HF / inference `config.json`, resolved once into typed per-layer roles.
//! * [`numerics`]: the switches that choose the reference (trained) numerics or plain ones.
//! * [`quant`]: the e4m3 / e2m1 / e8m0 formats, the three QAT fake-quant functions and the FP8
//!   activation quantization of the reference's linear operator.
//! * [`nn`]: RMSNorm, RoPE tables and GPT-J partial rotary embedding, the reference linear.
//! * [`attention`]: window cache, compressor, lightning indexer, sparse attention with sink, and
//!   the attention layer with its caller-owned cache.
//! * [`model`]: mHC hyper-connections, MoE, Engram and the whole decoder.
//! * [`loader`]: a `VarBuilder` backend over the release checkpoint format (FP8 / MXFP4).
//! * `cuda` (feature `cuda`): the fused CUDA kernels (cache inserts, query RoPE, indexer, sparse
//!   attention, activation quant, the decoder's small ops) as Candle ops; the modules above call
//!   them for tensors on a CUDA device (`docs/architecture.md`, `docs/kernels.md`).
//! * [`golden`]: the checker for golden sets produced by the official reference code.
//! * [`tokenizer`]: `tokenizer.json` loading, chat / thinking prompts, streaming decoding and the
//!   Engram compressed token map.
//! * [`weights`]: the `weights.toml` catalog of supported checkpoints.
//! * [`input`]: checks of token ids, context length and sampling settings before work starts.
//! * [`sampling`]: one token per sequence of a batch (greedy, temperature, top-k, top-p, seeded),
//!   the same algorithm and ids on the CPU and on a CUDA device (`kernels/sampling.cu`);
//!   [`generation`] samples with it.
//! * [`hub`] (cargo feature `hub`, on by default): downloading checkpoints from the Hugging Face
//!   hub into its shared cache (`docs/hub.md`).
//!
//! # Generating text
//!
//! Load a model folder ([`model::Pretrained::load_dir`]: `config.json`, the checkpoint,
//! `tokenizer.json`), prefill a prompt and decode greedily ([`generation::generate`]). The
//! embedded model (`models/v41-shakespeare-tiny`, 7.4M parameters) runs on the CPU in well
//! under a second:
//!
//! ```
//! # fn main() -> anyhow::Result<()> {
//! use candle_core::{DType, Device};
//! use deepseek_v41::generation::{generate, Sampler, Sampling};
//! use deepseek_v41::model::Pretrained;
//! use deepseek_v41::Numerics;
//!
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/v41-shakespeare-tiny");
//! let p = Pretrained::load_dir(dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)?;
//! let prompt = p.tokenizer.encode("ROMEO:", true)?; // ids, BOS first
//! let mut cache = p.new_cache()?; // one per sequence
//! let mut sampler = Sampler::new(Sampling::GREEDY)?;
//! let new = generate(&p.model, &mut cache, &prompt, 8, &mut sampler, None, |_id| Ok(()))?;
//! assert_eq!(new.len(), 8);
//! // The last new token is not fed back: the cache holds the prompt and the 7 tokens before it.
//! assert_eq!(cache.seq_len(), prompt.len() + 7);
//! let text = p.tokenizer.decode(&new, true)?;
//! assert!(!text.trim().is_empty());
//! # Ok(())
//! # }
//! ```
//!
//! `on_token` sees each id as soon as it is chosen ([`tokenizer::Tokenizer::stream`] turns ids
//! into text pieces); pass `Some(p.tokenizer.eos_id())` to stop at EOS. On a GPU (feature
//! `cuda`) create the device with `cuda::decode_device(0)` and load with that device.
//!
//! # Checkpoints by folder or by name
//!
//! [`model::Pretrained::load_dir`] takes any folder in the release format (FP8 / MXFP4,
//! single-file or sharded). The `weights.toml` catalog ([`weights::WeightsCatalog`]) names the
//! supported checkpoints: local folders, resolved against the catalog's folder, and hub
//! repositories at a pinned revision, which [`hub`] downloads (see its docs). Resolving a name
//! touches no network:
//!
//! ```
//! # fn main() -> anyhow::Result<()> {
//! use candle_core::Device;
//! use deepseek_v41::model::Pretrained;
//! use deepseek_v41::weights::{WeightsCatalog, WeightsSource};
//! use deepseek_v41::Numerics;
//!
//! let catalog = WeightsCatalog::load(concat!(env!("CARGO_MANIFEST_DIR"), "/../../weights.toml"))?;
//! let entry = catalog.get("v41-shakespeare-tiny")?;
//! let dir = catalog.local_dir(entry).expect("a local entry");
//! let p = Pretrained::load_dir(&dir, Numerics::REFERENCE, entry.dtype()?, &Device::Cpu)?;
//! let logits = p.model.forward(&[p.tokenizer.bos_id()], &mut p.new_cache()?)?;
//! assert_eq!(logits.dims(), &[1, p.config.vocab_size]); // [T, vocab] f32
//!
//! let flash = catalog.get("deepseek-v4.1-flash")?;
//! let WeightsSource::Hub { repo, revision } = flash.source()? else { panic!("a hub entry") };
//! assert_eq!((repo, revision.len()), ("deepseek-ai/DeepSeek-V4.1-Flash", 40)); // a pinned commit
//! # Ok(())
//! # }
//! ```
//!
//! # One attention layer, the CUDA ops
//!
//! [`attention::Attention`] runs one layer on its caller-owned [`attention::SequenceCache`]
//! (its docs show a layer with random weights on the CPU). With the `cuda` feature the modules
//! run fused kernels on CUDA tensors, and the kernels are public Candle ops too, e.g.
//! `cuda::SparseAttentionInputs::forward` (the sparse attention with sink) or
//! `cuda::window_insert` (`docs/kernels.md` lists them all).

pub mod attention;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod generation;
mod host_upload;
pub mod golden;
#[cfg(feature = "hub")]
pub mod hub;
pub mod input;
pub mod loader;
pub mod model;
pub mod nn;
pub mod numerics;
pub mod parallel;
pub mod quant;
pub mod sampling;
pub mod tokenizer;
pub mod weights;

pub use config::Config;
pub use numerics::Numerics;

#[cfg(test)]
pub(crate) mod test_util;
