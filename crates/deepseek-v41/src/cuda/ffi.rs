//! The C ABI of the kernels in the repository's `kernels/` folder: `#[repr(C)]` mirrors of the
//! parameter blocks of `kernels/include/dsv41_params.h` and the launcher declarations.
//!
//! Field order and types must match the header exactly; every launcher also receives
//! `size_of` of the struct and refuses a mismatch (`DSV41_ERR_PARAMS_SIZE`).

use std::ffi::{c_char, c_void, CStr};

/// `enum Dsv41Quant`.
pub(crate) const QUANT_NONE: i32 = 0;
/// Q1, fp8 e4m3 with UE8M0 scales, block 32.
pub(crate) const QUANT_FP8_UE8M0_B32: i32 = 1;
/// Q2, fp4 e2m1 with e4m3 scales, block 16.
pub(crate) const QUANT_FP4_E4M3_B16: i32 = 2;
/// Q3, fp4 e2m1 with UE8M0 scales, block 32.
pub(crate) const QUANT_FP4_UE8M0_B32: i32 = 3;

/// `Dsv41RowInsertParams`: one row per token, `[norm] -> RoPE -> [fake quant] -> cache[slot]`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowInsertParams {
    /// bf16 `[T, D]`, row t at `src + t * src_row_stride`.
    pub src: *const c_void,
    /// f32 `[T, R/2]`, contiguous.
    pub cos: *const f32,
    /// f32 `[T, R/2]`, contiguous.
    pub sin: *const f32,
    /// i64 `[T]`; values outside `[0, num_slots)` skip the token.
    pub slots: *const i64,
    /// f32 `[D]` RMSNorm weight, or null.
    pub norm_weight: *const f32,
    /// bf16 `[S, D]`, row s at `cache + s * cache_row_stride`.
    pub cache: *mut c_void,
    pub src_row_stride: i64,
    pub cache_row_stride: i64,
    pub num_slots: i64,
    pub num_tokens: i32,
    pub head_dim: i32,
    pub rope_dim: i32,
    pub quant: i32,
    pub apply_norm: i32,
    pub norm_eps: f32,
    pub norm_inv_dim: f32,
    pub _pad: i32,
}

/// `Dsv41QRopeParams`: RoPE of the last R dims of every head of `q [T, H, D]`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct QRopeParams {
    /// bf16 `[T, H, D]`, element (t, h, d) at `q + t * q_token_stride + h * q_head_stride + d`.
    pub q: *const c_void,
    /// bf16 `[T, H, D]` output (may equal `q` with equal strides: in place).
    pub out: *mut c_void,
    /// f32 `[T, R/2]`, contiguous.
    pub cos: *const f32,
    /// f32 `[T, R/2]`, contiguous.
    pub sin: *const f32,
    pub q_token_stride: i64,
    pub q_head_stride: i64,
    pub out_token_stride: i64,
    pub out_head_stride: i64,
    pub num_tokens: i32,
    pub num_heads: i32,
    pub head_dim: i32,
    pub rope_dim: i32,
    pub apply_norm: i32,
    pub norm_eps: f32,
    pub norm_inv_dim: f32,
    pub _pad: i32,
}

/// `Dsv41PackedInsertParams`: the insert pipeline storing packed rows in segregated pages.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackedInsertParams {
    /// bf16 `[T, D]`, row t at `src + t * src_row_stride`.
    pub src: *const c_void,
    /// f32 `[T, R/2]`, contiguous.
    pub cos: *const f32,
    /// f32 `[T, R/2]`, contiguous.
    pub sin: *const f32,
    /// i64 `[T]`; values outside `[0, num_slots)` skip the token.
    pub slots: *const i64,
    /// f32 `[D]` RMSNorm weight, or null.
    pub norm_weight: *const f32,
    /// u8 `[pages, page_stride]`: page p holds `page_size` rows of data then their scales.
    pub cache: *mut u8,
    pub src_row_stride: i64,
    pub page_stride: i64,
    pub num_slots: i64,
    pub num_tokens: i32,
    pub head_dim: i32,
    pub rope_dim: i32,
    pub quant: i32,
    pub apply_norm: i32,
    pub page_size: i32,
    pub norm_eps: f32,
    pub norm_inv_dim: f32,
}

/// `Dsv41SparseAttentionParams` (`kernels/include/dsv41_sparse_attention.h`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct SparseAttentionParams {
    /// bf16 `[T, H, D]`, (t, h, d) at `q + t * q_token_stride + h * q_head_stride + d`.
    pub q: *const c_void,
    /// bf16 `[Nw, D]`, row s at `kv_window + s * window_row_stride`.
    pub kv_window: *const c_void,
    /// bf16 `[Nc, D]`, row s at `kv_extra + s * extra_row_stride`.
    pub kv_extra: *const c_void,
    /// i32 / i64 `[T, Kw]`, contiguous.
    pub idx_window: *const c_void,
    /// i32 / i64 `[T, Kc]`, contiguous.
    pub idx_extra: *const c_void,
    /// f32 `[H]`.
    pub sink: *const f32,
    /// bf16 `[T, H, D]`, contiguous.
    pub out: *mut c_void,
    /// f32 `[T, H]`, contiguous.
    pub lse: *mut f32,
    pub q_token_stride: i64,
    pub q_head_stride: i64,
    pub window_row_stride: i64,
    pub extra_row_stride: i64,
    pub num_window_rows: i64,
    pub num_extra_rows: i64,
    pub num_tokens: i32,
    pub num_heads: i32,
    pub head_dim: i32,
    pub kw: i32,
    pub kc: i32,
    pub index_bytes: i32,
    pub scale: f32,
    /// KV splits per token (1..=8, one thread-block cluster); 0 = chosen by the launcher.
    pub num_splits: i32,
    /// Row storage of `kv_window`: [`KV_BF16`], [`KV_PACKED_A`] or [`KV_PACKED_B`].
    pub window_format: i32,
    /// Row storage of `kv_extra`.
    pub extra_format: i32,
    /// Tokens per page of a packed `kv_window` (ignored for bf16 rows).
    pub window_page_size: i32,
    /// Tokens per page of a packed `kv_extra`.
    pub extra_page_size: i32,
    /// Which kernel runs: [`SA_KERNEL_AUTO`], [`SA_KERNEL_ALL_HEADS`], [`SA_KERNEL_HEAD_SPLIT`],
    /// [`SA_KERNEL_HEAD_SPLIT_PINGPONG`] or [`SA_KERNEL_DIM_SPLIT_PAIR`].
    pub kernel: i32,
}

/// `DSV41_SA_KERNEL_AUTO`: the launcher picks the kernel.
pub(crate) const SA_KERNEL_AUTO: i32 = 0;
/// `DSV41_SA_KERNEL_ALL_HEADS`: all heads of a token per CTA, split-KV over a cluster.
pub(crate) const SA_KERNEL_ALL_HEADS: i32 = 1;
/// `DSV41_SA_KERNEL_HEAD_SPLIT`: 32 heads per CTA over all of the token's rows, no split.
pub(crate) const SA_KERNEL_HEAD_SPLIT: i32 = 2;
/// `DSV41_SA_KERNEL_HEAD_SPLIT_PINGPONG`: the head-split kernel's ping-pong consumers on a slot
/// ring (bf16 rows).
pub(crate) const SA_KERNEL_HEAD_SPLIT_PINGPONG: i32 = 3;
/// `DSV41_SA_KERNEL_DIM_SPLIT_PAIR`: all heads per CTA, the dims split over a 2-CTA cluster
/// (bf16 rows).
pub(crate) const SA_KERNEL_DIM_SPLIT_PAIR: i32 = 4;

/// `DSV41_KV_BF16`: bf16 rows.
pub(crate) const KV_BF16: i32 = 0;
/// `DSV41_KV_PACKED_A`: 528 B window rows (e4m3 + UE8M0 per 32).
pub(crate) const KV_PACKED_A: i32 = 1;
/// `DSV41_KV_PACKED_B`: 288 B compressed rows (e2m1 pairs + e4m3 per 16).
pub(crate) const KV_PACKED_B: i32 = 2;

extern "C" {
    pub(crate) fn dsv41_sparse_attention(
        p: *const SparseAttentionParams,
        params_size: usize,
        stream: *mut c_void,
    ) -> i32;
    pub(crate) fn dsv41_packed_insert(p: *const PackedInsertParams, params_size: usize, stream: *mut c_void) -> i32;
    pub(crate) fn dsv41_window_insert(p: *const RowInsertParams, params_size: usize, stream: *mut c_void) -> i32;
    pub(crate) fn dsv41_compressed_insert(p: *const RowInsertParams, params_size: usize, stream: *mut c_void) -> i32;
    pub(crate) fn dsv41_index_key_insert(p: *const RowInsertParams, params_size: usize, stream: *mut c_void) -> i32;
    pub(crate) fn dsv41_q_rope(p: *const QRopeParams, params_size: usize, stream: *mut c_void) -> i32;
    fn dsv41_cuda_error_string(code: i32) -> *const c_char;
}

/// Turns a launcher's return code into a `Result`, naming the operation.
pub(crate) fn check_status(op: &str, code: i32) -> candle_core::Result<()> {
    let why = match code {
        0 => return Ok(()),
        -1 => "parameter block size mismatch between Rust and C (rebuild the kernels)".to_string(),
        -2 => "head_dim must be 64, 128, 256 or 512".to_string(),
        -3 => "rope_dim must be even, > 0 and <= head_dim".to_string(),
        -4 => "quantization format (or norm) not supported by this kernel".to_string(),
        -5 => "a row pointer or row stride is not aligned for vector access".to_string(),
        -6 => "a required device pointer is null".to_string(),
        -7 => "a count or stride is out of range".to_string(),
        c if c > 0 => {
            // SAFETY: the launcher library returns a pointer to a static NUL-terminated string.
            let s = unsafe { CStr::from_ptr(dsv41_cuda_error_string(c)) };
            format!("CUDA error {c}: {}", s.to_string_lossy())
        }
        c => format!("unknown status {c}"),
    };
    candle_core::bail!("{op}: kernel launch failed: {why}")
}

/// `Dsv41IndexerScoresParams` (`kernels/include/dsv41_indexer.h`): index scores of T queries.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct IndexerScoresParams {
    /// bf16 `[T, H, 128]`, contiguous.
    pub q: *const c_void,
    /// f32 `[T, H]`, contiguous.
    pub w: *const f32,
    /// bf16 rows `[R, 128]` (row stride `key_row_stride` elements) or u8 packed pages.
    pub keys: *const c_void,
    /// u32 `[T]` first key row / slot per token, or null (0).
    pub key_base: *const u32,
    /// u32 `[T]` visible entries per token, or null (causal rule).
    pub visible: *const u32,
    /// u32 `[T, allowed_words]` allowed-block bitmask, or null.
    pub allowed: *const u32,
    /// i64 `[T, ..]` page table (row stride `page_table_stride`), or null (`key_base`).
    pub page_table: *const i64,
    /// bf16 `[T, N]`, row stride `score_row_stride` elements.
    pub scores: *mut c_void,
    pub key_row_stride: i64,
    pub num_key_rows: i64,
    pub score_row_stride: i64,
    pub start: i64,
    pub page_table_stride: i64,
    pub num_tokens: i32,
    pub num_heads: i32,
    pub head_dim: i32,
    pub num_cols: i32,
    pub key_format: i32,
    pub page_size: i32,
    pub ratio: i32,
    pub allowed_words: i32,
    pub allowed_block: i32,
    pub table_page_size: i32,
}

/// `Dsv41IndexerMaskParams`: kept candidate blocks → allowed-block bitmask.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct IndexerMaskParams {
    /// i64 `[T, n_blocks]`, contiguous, −1 = none.
    pub blocks: *const i64,
    /// u32 `[T, words]`, contiguous.
    pub allowed: *mut u32,
    pub num_tokens: i32,
    pub n_blocks: i32,
    pub words: i32,
    pub _pad: i32,
}

/// `Dsv41IndexerSelectParams`: top-k / candidate blocks of score rows.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct IndexerSelectParams {
    /// bf16 `[T, N]`, row stride `score_row_stride` elements.
    pub scores: *const c_void,
    /// u32 `[T]` visible entries per token, or null (causal rule).
    pub visible: *const u32,
    /// i64 `[T, k]`, row stride `out_row_stride` elements.
    pub out: *mut i64,
    pub score_row_stride: i64,
    pub out_row_stride: i64,
    pub start: i64,
    pub num_tokens: i32,
    pub num_cols: i32,
    pub k: i32,
    pub mode: i32,
    pub block: i32,
    pub ratio: i32,
}

/// `DSV41_INDEX_KEYS_BF16` / `DSV41_INDEX_KEYS_MXFP4`.
pub(crate) const INDEX_KEYS_BF16: i32 = 0;
pub(crate) const INDEX_KEYS_MXFP4: i32 = 1;
/// `DSV41_SELECT_TOPK` / `DSV41_SELECT_BLOCKS`.
pub(crate) const SELECT_TOPK: i32 = 0;
pub(crate) const SELECT_BLOCKS: i32 = 1;

extern "C" {
    pub(crate) fn dsv41_indexer_scores(p: *const IndexerScoresParams, params_size: usize, stream: *mut c_void) -> i32;
    pub(crate) fn dsv41_indexer_allowed_mask(p: *const IndexerMaskParams, params_size: usize, stream: *mut c_void) -> i32;
    pub(crate) fn dsv41_indexer_select(p: *const IndexerSelectParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// `Dsv41FakeQuantParams` of `kernels/include/dsv41_act_quant.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct FakeQuantParams {
    /// `[num_elems]` bf16 or f32, contiguous.
    pub x: *const c_void,
    /// `[num_elems]` same dtype, contiguous.
    pub out: *mut c_void,
    pub num_elems: i64,
    pub quant: i32,
    pub is_f32: i32,
}

extern "C" {
    pub(crate) fn dsv41_fake_quant(p: *const FakeQuantParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// `Dsv41MhcSplitParams` of `kernels/include/dsv41_mhc.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct MhcSplitParams {
    /// `[tokens, (2+hc)·hc]` f32, contiguous.
    pub mixes: *const f32,
    /// `[3]` f32.
    pub scale: *const f32,
    /// `[(2+hc)·hc]` f32.
    pub base: *const f32,
    /// `[tokens, hc]` f32 out.
    pub pre: *mut f32,
    /// `[tokens, hc]` f32 out.
    pub post: *mut f32,
    /// `[tokens, hc, hc]` f32 out.
    pub comb: *mut f32,
    pub tokens: i64,
    pub hc: i32,
    pub iters: i32,
    pub eps: f32,
}

extern "C" {
    pub(crate) fn dsv41_mhc_split_sinkhorn(p: *const MhcSplitParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// `Dsv41MhcMixesParams` of `kernels/include/dsv41_mhc.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct MhcMixesParams {
    /// `[tokens, n]` bf16 or f32 (`x_f32`), contiguous.
    pub x: *const c_void,
    /// `[(2+hc)·hc, n]` f32, contiguous.
    pub func: *const f32,
    /// `[3]` f32.
    pub scale: *const f32,
    /// `[(2+hc)·hc]` f32.
    pub base: *const f32,
    /// `[tokens, hc]` f32 out.
    pub pre: *mut f32,
    /// `[tokens, hc]` f32 out.
    pub post: *mut f32,
    /// `[tokens, hc, hc]` f32 out.
    pub comb: *mut f32,
    pub tokens: i64,
    pub n: i32,
    pub hc: i32,
    pub iters: i32,
    pub x_f32: i32,
    /// 0: automatic (ceil(n / 2048), at most 8).
    pub splits: i32,
    pub eps: f32,
    pub norm_eps: f32,
    pub reserved: i32,
}

extern "C" {
    pub(crate) fn dsv41_mhc_mixes(p: *const MhcMixesParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// `Dsv41Fp8LinearParams` of `kernels/include/dsv41_fp8_linear.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fp8LinearParams {
    /// `[m, k]` bf16, contiguous.
    pub x: *const c_void,
    /// `[n, k]` e4m3 bytes, contiguous.
    pub codes: *const u8,
    /// `[ceil(n/32), ceil(k/32)]` e8m0 bytes, contiguous.
    pub scales: *const u8,
    /// `[m, n]` bf16 out (`[m, n_first]` when `n_first > 0`).
    pub out: *mut c_void,
    /// `[m, n - n_first]` bf16 out when `n_first > 0`, else null.
    pub out2: *mut c_void,
    /// `scratch_bytes` bytes, 256-byte aligned.
    pub scratch: *mut c_void,
    pub scratch_bytes: i64,
    /// `DSV41_FP8_COUNTERS` zeroed arrival counters the call leaves zero, or null.
    pub counters: *mut u32,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub act_quant: i32,
    /// Split-K factor, 0 = the launcher's choice.
    pub splits: i32,
    /// `DSV41_FP8_VARIANT_*`: 0 auto, 1 register ring, 2 shared-memory pipeline, 3 warp-owned.
    pub variant: i32,
    /// `DSV41_FP8_PREP_*`: 0 auto (fused for small weights), 1 the prep kernel, 2 fused where possible.
    pub prep: i32,
    /// 0: one output; else a multiple of 32 below `n`: the features of `out`, the rest in `out2`.
    pub n_first: i32,
}

/// `DSV41_FP8_COUNTERS`: the arrival counters [`Fp8LinearParams::counters`] points to.
pub(crate) const FP8_COUNTERS: usize = 65536;

/// `DSV41_FP8_STREAM_MAX_M`: the largest `m` of the weight-streaming kernel.
pub(crate) const FP8_STREAM_MAX_M: usize = 256;

/// `DSV41_FP8_WARP_MAX_M`: the largest `m` of the warp-owned variant.
pub(crate) const FP8_WARP_MAX_M: usize = 64;

/// `Dsv41Fp8DequantParams` of `kernels/include/dsv41_fp8_linear.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fp8DequantParams {
    /// `[n, k]` e4m3 bytes, contiguous.
    pub codes: *const u8,
    /// `[ceil(n/32), ceil(k/32)]` e8m0 bytes, contiguous.
    pub scales: *const u8,
    /// `[n, k]` bf16 or f32 (`out_f32`) out.
    pub out: *mut c_void,
    pub n: i32,
    pub k: i32,
    pub out_f32: i32,
    pub reserved: i32,
}

extern "C" {
    pub(crate) fn dsv41_fp8_linear_scratch_bytes(p: *const Fp8LinearParams, params_size: usize, bytes: *mut i64) -> i32;
    pub(crate) fn dsv41_fp8_linear(p: *const Fp8LinearParams, params_size: usize, stream: *mut c_void) -> i32;
    pub(crate) fn dsv41_fp8_dequant(p: *const Fp8DequantParams, params_size: usize, stream: *mut c_void) -> i32;
    pub(crate) fn dsv41_fp8_gemm_scratch_bytes(p: *const Fp8LinearParams, params_size: usize, bytes: *mut i64) -> i32;
    pub(crate) fn dsv41_fp8_gemm(p: *const Fp8LinearParams, params_size: usize, stream: *mut c_void) -> i32;
}

/// `Dsv41Mxfp4DequantParams` of `kernels/include/dsv41_mxfp4.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mxfp4DequantParams {
    /// `[n, k/2]` packed e2m1 bytes, contiguous.
    pub codes: *const u8,
    /// `[n, k/32]` e8m0 bytes, contiguous.
    pub scales: *const u8,
    /// `[n, k]` bf16 or f32 (`out_f32`) out.
    pub out: *mut c_void,
    pub n: i32,
    /// A multiple of 32.
    pub k: i32,
    pub out_f32: i32,
    pub reserved: i32,
}

extern "C" {
    pub(crate) fn dsv41_mxfp4_dequant(p: *const Mxfp4DequantParams, params_size: usize, stream: *mut c_void) -> i32;
}
