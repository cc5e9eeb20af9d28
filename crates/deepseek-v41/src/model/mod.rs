//! The decoder's non-attention parts: mHC hyper-connections (spec §3.2), MoE (§8), Engram (§9).

pub mod batch;
pub mod decode_step;
#[cfg(feature = "cuda")]
pub mod decode_graph;
pub mod decoder;
pub mod engram;
pub mod engram_hash;
pub mod engram_next;
pub mod engram_host;
pub mod engram_placement;
pub mod mhc;
mod side_work;
pub mod moe;
pub mod moe_sort;
pub mod numpy_rng;
pub mod pretrained;

pub use batch::{BatchError, BatchItem, BatchOutput, LogitRows};
pub use decode_step::ModelDecodeStep;
#[cfg(feature = "cuda")]
pub use decode_graph::GraphedDecodeStep;
pub use decoder::{DecoderLayer, Model, ModelCache};
pub use engram::{engram_mix, Engram, EngramTable};
pub use engram_hash::{
    EngramHasher, EngramHistory, EngramIds, EngramLayerLayout, EngramLayout, TokenMap,
};
pub use engram_host::{GatheredRows, HostRows};
pub use engram_placement::{EngramLocation, EngramOptions, EngramPlacement, EngramTableInfo, AUTO_DEVICE_MAX_BYTES};
pub use mhc::{collapse, collapse_norm, post, post_collapse_norm, split_sinkhorn, HcCoeffs, HcMix, HcSublayer};
pub use pretrained::{LoadOptions, Pretrained};
pub use moe::{Expert, Gate, Moe, MoeOutput, Routing};
pub use moe_sort::{moe_route_ref, sort_by_expert, ExpertSort};
