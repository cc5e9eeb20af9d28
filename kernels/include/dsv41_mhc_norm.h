// Parameter block of kernels/mhc_norm.cu: an mHC collapse followed by the sublayer's RMSNorm
// (and, for post_norm, the mHC post before it) in one launch. Same conventions as dsv41_params.h:
// 8-byte fields first, then 4-byte fields; the Rust mirror is in
// crates/deepseek-v41/src/cuda/mhc_norm.rs and the launchers refuse a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

// Largest hc of the fused kernels.
#define DSV41_MHC_NORM_MAX_HC 32
// Largest row width d: the collapsed row is kept in shared memory (d f32 = 32 KiB at most, with the reduction's own shared memory under the 48 KiB default).
#define DSV41_MHC_NORM_MAX_D 8192

typedef struct {
    const void* x;          // [tokens, hc, d] bf16 or f32 (x_f32), contiguous: the mHC stream
    const float* pre;       // [tokens, hc] f32, contiguous: the collapse weights
    const float* weight;    // [d] f32: the RMSNorm weight
    void* out;              // [tokens, d] in x's dtype: the normed collapse
    const float* comb;      // post_norm: [tokens, hc, hc] f32 (comb[t, i, j] moves copy i into j)
    const void* y;          // post_norm: [tokens, d] bf16 or f32 (y_f32): the sublayer output
    const float* post;      // post_norm: [tokens, hc] f32
    void* stream_out;       // post_norm: [tokens, hc, d] in x's dtype: the stream after the post
    int64_t tokens;         // >= 0
    int32_t hc;             // 1 .. DSV41_MHC_NORM_MAX_HC
    int32_t d;              // 1 .. DSV41_MHC_NORM_MAX_D
    int32_t x_f32;          // 1: x (and the outputs) f32, 0: bf16
    int32_t y_f32;          // post_norm: 1: y is f32, 0: bf16
    float mean_mul;         // (float)(1.0 / d)
    float eps;              // (float)eps
} Dsv41MhcNormParams;

// out = rms_norm(collapse(x, pre)) (each rounded to x's dtype, as the two kernels of
// decoder_ops.cu compute them).
int dsv41_mhc_collapse_norm(const Dsv41MhcNormParams* p, size_t params_size, void* stream);
// stream_out = post(y, x, post, comb); out = rms_norm(collapse(stream_out, pre)).
int dsv41_mhc_post_norm(const Dsv41MhcNormParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
