//! The V4.1 sparse attention stack (spec §4–§7).
//!
//! * [`window`]: the per-layer sliding-window ring (every layer).
//! * [`compressor`]: the kv sources' compressor (ratio 1: per-token stream; ratio 2: gated pairs),
//!   with its carry across calls.
//! * [`indexer`]: the lightning indexer (index keys, scores, visibility, candidate blocks, top-k).
//! * [`sparse_attention`](mod@sparse_attention): attention over gathered rows with a per-head sink.
//! * [`selection`]: the top-k step of a compressed layer (index sources compute and publish,
//!   reuse layers read), on the activations' device.
//! * [`layer`]: the attention layer wiring all of the above (with the `cuda` feature, its fused
//!   device path in `layer_fused.rs`).
//! * [`cache`]: the caller-owned per-sequence cache through which layers share compressed KV,
//!   index keys, top-k sets and candidate blocks; [`storage`]: its storage choice (bf16 rows or
//!   the packed V4.1 formats); [`pool`]: a pool of window-ring pages shared by many sequences.
//! * [`rollback`]: truncating a cache to a shorter length, with the bounded [`history`] of rows
//!   it keeps for that.
//! * [`decode_batch`]: the single-token decode step of one layer for B sequences over pooled
//!   caches ([`batch_cache`], the kv sources' entries in pages: [`page_table`]) with its
//!   position-dependent inputs on the device ([`decode_inputs`]), capturable into a CUDA graph (its ops: the `cuda` feature's, or their
//!   CPU references without it).

pub mod batch_cache;
pub mod cache;
pub mod compress_pool;
pub mod compressor;
pub mod decode_batch;
pub mod decode_error;
pub mod decode_inputs;
mod decode_ops;
mod device_cache;
pub mod history;
pub mod indexer;
pub mod layer;
pub mod page_table;
pub mod pool;
pub mod rollback;
pub mod selection;
pub mod sparse_attention;
pub mod storage;
pub mod trace;
pub mod window;

pub use batch_cache::{BatchStorage, BatchedLayerCache, BatchedSource, PoolRows};
pub use cache::SequenceCache;
pub use compress_pool::{compress_pool, compress_pool_ref};
pub use decode_batch::{DecodeLayer, DecodeLayerKind, DecodeStep, DecodeStepOutput, Projections, Published, StepOptions, StepSelection};
pub use decode_error::DecodeStepError;
pub use decode_inputs::{CompressedInputs, DecodeStepInputs};
pub use layer::{Attention, AttentionParams};
pub use page_table::{page_rows, page_rows_ref, PageTable, PageUse};
pub use pool::{CachePool, PoolError, PoolLease, PoolOccupancy};
pub use rollback::RollbackError;
#[cfg(feature = "cuda")]
pub use layer::LayerPhase;
pub use sparse_attention::{sparse_attention, sparse_attention_ref};
pub use storage::{CacheKind, CacheStorage};
pub use trace::Trace;
