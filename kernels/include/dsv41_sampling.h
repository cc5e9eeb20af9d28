// Parameter block of kernels/sampling.cu (one token per sequence from its logits row: greedy,
// temperature, top-k, top-p, seeded). Same conventions as dsv41_params.h: 8-byte fields first,
// then 4-byte fields; the Rust mirror is crates/deepseek-v41/src/cuda/sampling.rs and the launcher
// refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV41_SAMPLING_MAX_VOCAB (1 << 23)  // V: a row's fixed-point nucleus masses (<= 2^40 each) sum in 64 bits
#define DSV41_SAMPLING_TABLE_WORDS 8        // u32 words per sequence of `table`

typedef struct {
    const void* logits;      // [B, V] f32 or bf16 (x_f32), row b at logits + b * row_stride, entries contiguous
    const uint32_t* table;   // [B, 8] u32: temperature (f32 bits), top_k, top_p (f32 bits), 0, seed lo, seed hi, step lo, step hi
    uint32_t* ids;           // [B] out: the chosen id of each row
    int64_t row_stride;      // elements between rows (>= V when B > 1)
    int32_t batch;           // B >= 0 (0 launches nothing)
    int32_t vocab;           // V in 1 .. DSV41_SAMPLING_MAX_VOCAB
    int32_t x_f32;           // 1: f32 logits, 0: bf16
    int32_t _pad;
} Dsv41SamplingParams;

// One CTA per row; reads `table` and the logits on the device, writes ids[0..B). Graph-capturable
// (no host read, no allocation).
int dsv41_sampling(const Dsv41SamplingParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
