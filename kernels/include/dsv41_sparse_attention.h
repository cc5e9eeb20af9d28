// Parameter block and launcher of the sparse attention with sink (kernels/sparse_attention.cu,
// spec §4.6-§4.7, §0.1b.6). Mirrored by crates/deepseek-v41/src/cuda/ffi.rs
// (`SparseAttentionParams`); field order and types are ABI. Status codes: dsv41_params.h.
#pragma once
#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

// Row storage of a KV source (spec §7.2; pages of page_size tokens laid out as
// [page_size x data bytes][page_size x scale bytes], crate `cuda::PackedLayout`).
enum {
    DSV41_KV_BF16 = 0,      // bf16 rows of D values, row stride in elements
    DSV41_KV_PACKED_A = 1,  // window KV: 512 e4m3 + 16 UE8M0 scale bytes (block 32) = 528 B per row
    DSV41_KV_PACKED_B = 2,  // compressed KV: 256 B of e2m1 pairs + 32 e4m3 scale bytes (block 16) = 288 B
};

// Which kernel runs (num_splits > 1 forces the all-heads kernel).
enum {
    DSV41_SA_KERNEL_AUTO = 0,       // the launcher picks (head-split for few tokens)
    DSV41_SA_KERNEL_ALL_HEADS = 1,  // all heads of a token per CTA, split-KV over a cluster (sparse_attention.cu)
    DSV41_SA_KERNEL_HEAD_SPLIT = 2, // 32 heads per CTA, all rows, no split (sparse_attention_heads.cu)
    DSV41_SA_KERNEL_HEAD_SPLIT_PINGPONG = 3,  // the same split, two consumers on alternate tiles of a slot ring
                                              // (sparse_attention_pingpong.cu; bf16 rows; packed rows: as 2)
    DSV41_SA_KERNEL_DIM_SPLIT_PAIR = 4,  // all heads, the dims split over a 2-CTA cluster, partial scores exchanged
                                         // (sparse_attention_dimsplit.cu; bf16 rows; packed rows: as 2)
};

// Two KV sources like FlashMLA's k_cache + extra_k_cache: token t attends to the valid rows of
// [kv_window[idx_window[t, :]] ; kv_extra[idx_extra[t, :]]] in that order (no dedupe). An
// index is valid iff 0 <= i < num_rows of its source (-1 = hole / padding; other values are
// skipped too: the kernel never reads outside a source). K = V = the gathered row.
// Limits: D = 512, Kw + Kc <= 4096, Nw and Nc < 2^31.
typedef struct {
    const void* q;           // bf16 [T, H, D]; (t, h, d) at q + t * q_token_stride + h * q_head_stride + d
    const void* kv_window;   // bf16 [Nw, D], row s at kv_window + s * window_row_stride; or packed pages
                             // (window_format) holding slots [0, Nw); may be NULL iff Kw == 0
    const void* kv_extra;    // same for the extra source (extra_format); may be NULL iff Kc == 0
    const void* idx_window;  // i32 or i64 (index_bytes) [T, Kw], contiguous
    const void* idx_extra;   // i32 or i64 (index_bytes) [T, Kc], contiguous
    const float* sink;       // f32 [H]; -inf = no sink
    void* out;               // bf16 [T, H, D], contiguous
    float* lse;              // f32 [T, H], contiguous: ln sum_s e^{l_s} over valid rows (sink excluded), -inf if none
    int64_t q_token_stride;  // elements
    int64_t q_head_stride;   // elements
    int64_t window_row_stride;  // elements (bf16 rows; ignored for packed pages)
    int64_t extra_row_stride;   // elements (bf16 rows; ignored for packed pages)
    int64_t num_window_rows;    // Nw
    int64_t num_extra_rows;     // Nc
    int32_t num_tokens;      // T (no limit besides int32)
    int32_t num_heads;       // H
    int32_t head_dim;        // D (512 only)
    int32_t kw;              // index columns of the window source
    int32_t kc;              // index columns of the extra source
    int32_t index_bytes;     // 4 (i32) or 8 (i64), both index tensors
    float scale;             // softmax scale applied to q.k (not to the sink)
    int32_t num_splits;      // KV splits per token (1..8, one thread-block cluster), 0 = chosen by the launcher
    int32_t window_format;   // DSV41_KV_* of kv_window
    int32_t extra_format;    // DSV41_KV_* of kv_extra
    int32_t window_page_size;  // tokens per page of a packed kv_window (ignored for bf16)
    int32_t extra_page_size;   // tokens per page of a packed kv_extra (ignored for bf16)
    int32_t kernel;            // DSV41_SA_KERNEL_*
} Dsv41SparseAttentionParams;

int dsv41_sparse_attention(const Dsv41SparseAttentionParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
