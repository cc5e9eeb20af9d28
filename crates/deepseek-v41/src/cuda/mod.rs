//! CUDA kernels of the attention caches (compiled only with the `cuda` feature), bound as
//! Candle ops. Each op has a CUDA path (one fused kernel from the repository's `kernels/`
//! folder, built by `build.rs`) and a CPU path that is the reference: the crate's own
//! [`crate::nn::rope`], [`crate::nn::rms_norm`] and [`crate::quant::fake_quant`](mod@crate::quant::fake_quant) functions. The
//! CUDA kernels match the CPU path bit for bit (`tests/cuda_insert.rs`).
//!
//! * [`window_insert`]: window KV row `fq_Q1(RoPE(p)(kv))` into a row cache (spec §4.3).
//! * [`compressed_insert`]: compressed entry `fq_Q2(RoPE(j·r)(latent))` (spec §4.4).
//! * [`index_key_insert`]: index key `fq_Q3(RoPE(j·r)(k_norm(k_pre)))` (spec §6.2).
//! * [`q_rope`] / [`q_rope_inplace`]: the query RoPE, with the optional weightless per-head
//!   RMSNorm of V4.0 (spec §4.2).
//! * [`packed_insert`] with a [`PackedLayout`]: the same inserts into the packed, paged cache
//!   formats of spec §7.2 (528 B window rows, 288 B compressed rows, 68 B index rows).
//! * [`fake_quant_device`]: blockwise QAT / FP8 activation fake quant of a dense tensor.
//! * [`SparseAttentionInputs::forward`]: sparse attention with sink over window + extra rows
//!   (spec §4.7), each source bf16 rows or a packed cache ([`KvRows`]), returning the output and
//!   the log-sum-exp; [`sparse_attention_two_source`] is its bf16-rows shorthand.
//! * [`index_select`]: the lightning indexer (spec §6.3–§6.4): index scores over bf16 or packed
//!   MXFP4 key rows ([`masked_index_scores`]), top-k ([`index_topk`]) and candidate blocks
//!   ([`candidate_blocks`]) in one chunked, memory-bounded call; [`index_select_with_options`]
//!   chooses the scratch size and whether the top-k's first histogram is built by the scores
//!   kernel ([`SelectOptions`]).
//! * [`split_sinkhorn_device`]: the mHC coefficient split (Sinkhorn) in one launch, bit for bit
//!   the Candle op sequence it replaces on a CUDA device; [`mhc_mixes_device`]: the raw mixes
//!   (rsqrt-scaled product with `hc_*_fn`) and that split in one launch.
//! * [`rms_norm_device`], [`rms_scale_device`], [`collapse_device`], [`mhc_post_device`],
//!   [`engram_mix_device`], [`accumulate_device`], [`swiglu_device`]: the decoder's small ops
//!   (RMSNorm, the mHC mixes' rsqrt factor, collapse and post, the Engram gate, the MoE's f32
//!   sum and SwiGLU) in one launch each, bit for bit the Candle op sequences they replace on a
//!   CUDA device (the decode step of a small model is launch-bound); [`compress_pool_device`]: the
//!   ratio-2 compressor's pooling and carry of the batched decode step, likewise;
//!   [`step_inputs_device`]: the step's position-derived inputs, likewise; [`engram_next_device`]:
//!   the tokens and Engram row ids of a step following the last one on the device; [`sparse_attention_small`]:
//!   the sparse attention of head dims below the FlashMLA-style kernels' 512 in one launch; [`page_rows_device`]:
//!   its top-k entries mapped to page-pool rows, likewise; [`collapse_norm_device`],
//!   [`mhc_post_norm_device`]: a collapse and its RMSNorm (after a post) in one launch, bit for
//!   bit the separate kernels.
//! * [`f32_linear_device`]: the f32-weight linears (router, compressor, head) at decode sizes in
//!   one launch over bf16 or f32 input ([`f32_linear_ref`] is the reference).
//! * [`group_diagonal_device`]: the diagonal blocks of a stacked grouped product (the grouped
//!   `wo_a` at decode sizes) gathered in one launch ([`group_diagonal_ref`]).
//! * [`fp8_linear`]: the block-scaled FP8 linear over an [`crate::quant::Fp8Weight`] kept in its
//!   release format (weight streaming for small m, dequantize + cuBLAS or the FP8 wgmma GEMM for
//!   large m), and [`fp8_dequantize_device`].
//! * [`mxfp4_dequantize_device`]: the exact dequantization of an [`crate::quant::Mxfp4Weight`]
//!   (the routed experts, packed e2m1 codes + e8m0 scales kept on the device), which every
//!   product of an MXFP4 linear runs before the dense path's matmul.
//! * [`moe_route_device`]: the MoE router's decision (sqrt-softplus scores, biased top-k, weights)
//!   and the slots sorted by expert for a grouped expert kernel, from the `[T, E]` logits, all on
//!   the device ([`crate::model::moe_route_ref`] is its CPU reference); `model::Gate::route` uses
//!   it inside [`with_device_routing`].
//! * [`moe_experts_device`] over [`GroupedExperts`]: the routed MXFP4 experts of a layer in
//!   grouped launches (gate/up with the SwiGLU, down, the combine with the shared expert), over the
//!   packed codes, for any number of tokens and without a host read: weight streaming for decode,
//!   a tensor-core GEMM for prefill ([`MoeExpertsKernel`], [`moe_experts_device_with`]).
//! * [`sample_device`]: one token per sequence of a batch (greedy, temperature, top-k, top-p,
//!   seeded) from `[B, V]` logits, only the ids written ([`crate::sampling`] defines the algorithm
//!   and its CPU reference; [`crate::sampling::sample_batch`] dispatches to it).
//! * `PinnedStaging` (crate-internal): a reused page-locked host buffer and one asynchronous
//!   copy per call, for the rows of the Engram tables kept in host memory
//!   ([`crate::model::engram_host`]).
//! * [`decode_device`]: a CUDA device set up for a decode loop's many small tensors (no
//!   per-buffer CUDA events, a memory pool that keeps its memory across synchronizations).
//! * [`StepGraph`]: a step's device work captured once into a CUDA graph (warm-up and capture
//!   with Candle's host-upload cache on) and replayed; [`crate::model::GraphedDecodeStep`] is the
//!   whole-model decode step on it.
//! * [`with_plain_candle`]: run a closure with the fused kernels switched off (plain Candle
//!   ops on the device, the benchmarks' baseline); [`fused_kernels`] is the dispatch test.
//!
//! All of them take the per-token `cos`/`sin` rows (`[T, R/2]` f32) of
//! [`crate::nn::RopeTable::cos_sin`] rather than positions: a step computes them once for q,
//! kv and every layer of the same frequency set, and the kernels need no trigonometry, which
//! keeps them bit-exact with the CPU. Cache rows are addressed by per-token `slots` (`[T]` i64),
//! so one call serves many sequences (ring slots, paged slots, ...).

mod act_quant;
mod compressed_insert;
mod decode_device;
mod decoder_ops;
mod device;
mod f32_linear;
mod ffi;
mod fp8_linear;
pub(crate) use fp8_linear::auto_streams;
mod group_diagonal;
mod index_key_insert;
mod indexer_inputs;
mod indexer_scores;
mod indexer_select;
mod indexer_topk;
mod mhc_mixes;
mod mhc_norm;
mod mhc_sinkhorn;
mod moe_experts;
mod moe_experts_gemm;
mod moe_route;
mod mxfp4;
mod insert_op;
mod packed_insert;
mod pinned_staging;
mod policy;
mod q_rope;
mod row_inputs;
mod sampling;
mod side_stream;
mod slots;
mod step_graph;
mod sparse_attention;
mod sparse_attention_small;
mod swiglu;
mod compress_pool;
mod engram_next;
mod pinned_readback;
mod step_inputs;
mod page_rows;
mod window_insert;

pub use act_quant::fake_quant_device;
pub use compressed_insert::compressed_insert;
pub use decode_device::decode_device;
pub use f32_linear::{f32_linear_device, f32_linear_ref, f32_linear_supported, F32_LINEAR_MAX_M};
pub use fp8_linear::{
    arrival_counters, fp8_dequantize_device, fp8_linear, fp8_linear_split, fp8_linear_with, Fp8LinearOptions, Fp8LinearPath, Fp8Prep, Fp8StreamVariant, FP8_AUTO_STREAM_MAX_M, FP8_FUSED_AUTO_MAX_BYTES,
    FP8_STREAM_MAX_M, FP8_WARP_MAX_M,
};
pub use decoder_ops::{
    accumulate_device, accumulate_supported, collapse_device, collapse_supported, engram_mix_device, engram_mix_supported, mhc_post_device,
    mhc_post_supported, rms_norm_device, rms_scale_device, row_norm_supported, scale_round_device, COLLAPSE_MAX_HC, MHC_POST_MAX_HC, ROW_NORM_MAX_N,
};
pub use group_diagonal::{group_diagonal_device, group_diagonal_ref};
pub use index_key_insert::index_key_insert;
pub use indexer_inputs::{IndexKeys, KeyPages, KeySource, Visibility, INDEX_HEAD_DIM, MAX_INDEX_HEADS};
pub use indexer_scores::masked_index_scores;
pub use indexer_select::{index_select, index_select_with_options, SelectOptions, SCORE_SCRATCH_BYTES};
pub(crate) use indexer_select::select_on_device;
pub use indexer_topk::{candidate_blocks, index_topk};
pub use mhc_mixes::{mhc_mixes_device, mhc_mixes_supported, MHC_MIXES_MAX_FN_TRAFFIC, MHC_MIXES_MAX_HC};
pub use mhc_norm::{collapse_norm_device, mhc_norm_supported, mhc_post_norm_device, MHC_NORM_MAX_D, MHC_NORM_MAX_HC};
pub use mhc_sinkhorn::{split_sinkhorn_device, MHC_MAX_HC};
pub use mxfp4::mxfp4_dequantize_device;
pub(crate) use moe_experts::moe_experts_device_joined;
pub use moe_experts::{moe_experts_device, moe_experts_device_with, GroupedExperts, MoeExpertsOutput, MOE_EXPERTS_MAX_E, MOE_EXPERTS_MAX_K};
pub use moe_experts_gemm::{MoeExpertsKernel, MOE_GEMM_MIN_AVG_SLOTS};
pub use moe_route::{moe_route_device, moe_route_supported, DeviceRouting, MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_K};
pub use packed_insert::{packed_insert, PackedLayout};
pub(crate) use pinned_staging::PinnedStaging;
pub use policy::{device_routing, fused_kernels, unfused, with_device_routing, with_plain_candle, UNFUSE_NAMES};
pub use q_rope::{q_rope, q_rope_inplace};
pub use sampling::sample_device;
pub use side_stream::SideStream;
pub use slots::keep_last_writer;
pub use step_graph::{graph_census, StepGraph};
pub use swiglu::{swiglu_device, swiglu_supported};
pub use compress_pool::compress_pool_device;
pub use engram_next::engram_next_device;
pub(crate) use pinned_readback::PinnedReadback;
pub use step_inputs::{step_inputs_device, EntryRows};
pub use page_rows::page_rows_device;
pub use sparse_attention_small::{sparse_attention_small, sparse_attention_small_supported, SPARSE_ATTENTION_SMALL_MAX_DIM};
pub use sparse_attention::{
    sparse_attention_two_source, sparse_attention_two_source_with, KvRows, SparseAttentionInputs, SparseAttentionKernel,
    SparseAttentionOptions, SPARSE_ATTENTION_HEAD_DIM, SPARSE_ATTENTION_MAX_INDICES, SPARSE_ATTENTION_MAX_SPLITS,
};
pub use window_insert::window_insert;

#[cfg(test)]
mod cpu_tests;
