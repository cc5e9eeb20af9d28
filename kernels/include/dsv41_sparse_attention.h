// Parameter block and launcher of the sparse attention with sink (kernels/sparse_attention.cu,
// spec §4.6-§4.7, §0.1b.6). Mirrored by crates/deepseek-v41/src/cuda/ffi.rs
// (`SparseAttentionParams`); field order and types are ABI. Status codes: dsv41_params.h.
#pragma once
#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

// Two KV sources like FlashMLA's k_cache + extra_k_cache: token t attends to the valid rows of
// [kv_window[idx_window[t, :]] ; kv_extra[idx_extra[t, :]]] in that order (no dedupe). An
// index is valid iff 0 <= i < num_rows of its source (-1 = hole / padding; other values are
// skipped too: the kernel never reads outside a source). K = V = the gathered row.
// Limits: D = 512, Kw + Kc <= 4096, Nw and Nc < 2^31.
typedef struct {
    const void* q;           // bf16 [T, H, D]; (t, h, d) at q + t * q_token_stride + h * q_head_stride + d
    const void* kv_window;   // bf16 [Nw, D]; row s at kv_window + s * window_row_stride (may be NULL iff Kw == 0)
    const void* kv_extra;    // bf16 [Nc, D]; row s at kv_extra + s * extra_row_stride (may be NULL iff Kc == 0)
    const void* idx_window;  // i32 or i64 (index_bytes) [T, Kw], contiguous
    const void* idx_extra;   // i32 or i64 (index_bytes) [T, Kc], contiguous
    const float* sink;       // f32 [H]; -inf = no sink
    void* out;               // bf16 [T, H, D], contiguous
    float* lse;              // f32 [T, H], contiguous: ln sum_s e^{l_s} over valid rows (sink excluded), -inf if none
    int64_t q_token_stride;  // elements
    int64_t q_head_stride;   // elements
    int64_t window_row_stride;  // elements
    int64_t extra_row_stride;   // elements
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
} Dsv41SparseAttentionParams;

int dsv41_sparse_attention(const Dsv41SparseAttentionParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
