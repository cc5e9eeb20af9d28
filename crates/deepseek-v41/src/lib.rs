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
//! * [`hub`] (cargo feature `hub`, on by default): downloading checkpoints from the Hugging Face
//!   hub into its shared cache (`docs/hub.md`).

pub mod attention;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod generation;
pub mod golden;
#[cfg(feature = "hub")]
pub mod hub;
pub mod input;
pub mod loader;
pub mod model;
pub mod nn;
pub mod numerics;
pub mod quant;
pub mod tokenizer;
pub mod weights;

pub use config::Config;
pub use numerics::Numerics;

#[cfg(test)]
pub(crate) mod test_util;
