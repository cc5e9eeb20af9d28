// Parameter block of kernels/compress_pool.cu (the ratio-2 compressor's pooling and carry of the
// batched decode step, spec §5). Same conventions as dsv41_params.h: 8-byte fields first, then
// 4-byte fields; the Rust mirror is crates/deepseek-v41/src/cuda/compress_pool.rs and the
// launcher refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const float* carry_kv;     // [rows, dim] f32, contiguous: the open group's carried wkv projection
    const float* carry_score;  // [rows, dim] f32: its wgate score
    const float* kv;           // [rows, dim] f32: this token's wkv projection
    const float* score;        // [rows, dim] f32: its wgate score
    const uint8_t* closing;    // [rows]: 1 where this token closes the group
    void* pooled;              // [rows, dim] bf16 out: the softmax-weighted pool of the two
    float* new_kv;             // [rows, dim] f32 out: the carry after this token
    float* new_score;          // [rows, dim] f32 out
    int64_t rows;              // >= 0
    int32_t dim;               // >= 1
    int32_t _pad;
} Dsv41CompressPoolParams;

int dsv41_compress_pool(const Dsv41CompressPoolParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
