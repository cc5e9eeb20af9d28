// Parameter block of kernels/sparse_attention_small.cu (sparse attention with a sink for the head
// dims the FlashMLA-style kernels do not take). Same conventions as dsv41_params.h; the Rust
// mirror is crates/deepseek-v41/src/cuda/sparse_attention_small.rs and the launcher refuses a
// size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

// The largest head dim of the kernel (4 dims per thread of its 128).
#define DSV41_SA_SMALL_MAX_DIM 512

typedef struct {
    const void* q;          // [t, h, d] bf16, contiguous
    const void* kv_a;       // [na, d] bf16 rows, contiguous (the window)
    const int64_t* idx_a;   // [t, ka]: rows of kv_a, < 0 or >= na: none
    const void* kv_b;       // [nb, d] bf16 rows, contiguous (the selected entries); may be kv_a
    const int64_t* idx_b;   // [t, kb]: rows of kv_b (NULL when kb = 0)
    const float* sink;      // [h] f32 logits (-inf: no sink)
    void* out;              // [t, h, d] bf16
    int64_t na;             // rows of kv_a >= 0
    int64_t nb;             // rows of kv_b >= 0
    int32_t t;              // tokens >= 0
    int32_t h;              // heads >= 1
    int32_t d;              // head dim 1 ..= DSV41_SA_SMALL_MAX_DIM
    int32_t ka;             // indices per token into kv_a >= 0
    int32_t kb;             // indices per token into kv_b >= 0
    float scale;            // logit scale
} Dsv41SparseAttentionSmallParams;

int dsv41_sparse_attention_small(const Dsv41SparseAttentionSmallParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
