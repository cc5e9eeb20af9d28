//! A candle `VarBuilder` backend over the DeepSeek V4.1 release checkpoint format (spec §2.4,
//! §12).
//!
//! * [`dequant`]: FP8 (32×32 blocks or 1×32 rows) and MXFP4 dequantization on raw bytes.
//! * [`shard`]: one memory-mapped safetensors file, header validated.
//! * [`layout`]: how a weight and its `.scale` companion form one logical tensor.
//! * [`checkpoint`]: [`ReleaseCheckpoint`] (one file, several files, or a folder with
//!   `model.safetensors.index.json`), dequantizing `get`, Engram row lookups.
//! * [`rows`]: row lookups without materializing a table ([`RowTable`], for Engram).
//! * [`staging`]: how a tensor goes from the map to its device with a bounded host footprint.
//! * [`usage`]: strict loading (unused tensors, collect mode for missing ones) and the bytes
//!   placed per tensor.
//! * [`plan`]: what a load will place where, from the config alone ([`LoadPlan`]).
//! * [`native`]: quantized weights kept in their release format ([`QuantizedWeights`]) and the
//!   virtual tensor names through which the backend hands out an FP8 or MXFP4 weight's stored bytes.
//! * [`backend`]: the [`candle_nn::var_builder::SimpleBackend`] and [`var_builder`] /
//!   [`var_builder_with`].
//!
//! ```no_run
//! use deepseek_v41::loader::{var_builder, ReleaseCheckpoint};
//! # fn main() -> candle_core::Result<()> {
//! let ckpt = ReleaseCheckpoint::open_dir("/path/to/DeepSeek-V4.1-Flash")?;
//! let vb = var_builder(ckpt.clone(), candle_core::DType::BF16, &candle_core::Device::Cpu);
//! let wq_a = vb.pp("layers.0.attn.wq_a").get((1024, 4096), "weight")?; // dequantized FP8
//! // ... build the model from `vb`, then:
//! ckpt.check_all_used(&[])?;
//! # Ok(()) }
//! ```

pub mod backend;
pub mod checkpoint;
pub mod dequant;
pub mod error;
pub mod layout;
pub mod native;
pub mod plan;
pub mod rows;
pub mod shard;
pub mod staging;
pub mod usage;

pub use backend::{var_builder, var_builder_with, ReleaseBackend};
pub use checkpoint::ReleaseCheckpoint;
pub use dequant::{dequant_fp8_block32, dequant_fp8_rows, dequant_mxfp4, fp8_rows_products};
pub use error::LoadError;
pub use layout::{StoredTensor, TensorInfo, WeightFormat};
pub use native::{QuantizedWeights, StoredPart};
pub use plan::{LoadPlan, PlanDevice, PlanOptions};
pub use rows::RowTable;
pub use shard::StoredDtype;
pub use usage::{DEFAULT_DENSE_LIMIT, NON_TEXT_PREFIXES, NON_TEXT_SUFFIXES};
