// Parameter blocks of kernels/decoder_ops.cu: the decoder's small per-row ops (RMSNorm, the mHC
// mixes' rsqrt factor, the mHC collapse, the mHC post's elementwise part, the MoE output's f32
// accumulation) in one launch each. Same conventions as
// dsv41_params.h: 8-byte fields first, then 4-byte fields; the Rust mirrors are in
// crates/deepseek-v41/src/cuda/decoder_ops.rs and the launchers refuse a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

// Largest row width of the norm kernels (the reduction is one block of ≤ 1024 threads per row,
// looping over longer rows as candle's does).
#define DSV41_ROW_NORM_MAX_N (1 << 20)
// Largest hc of the collapse kernel (candle sums ≤ 32 elements sequentially).
#define DSV41_COLLAPSE_MAX_HC 32

typedef struct {
    const void* x;        // [rows, n] bf16 or f32 (x_f32), contiguous
    const float* weight;  // [n] f32 (rms_norm; unused by rms_scale)
    void* out;            // rms_norm: [rows, n] in x's dtype; rms_scale: [rows, n] f32 (x as f32)
    float* scale;         // rms_scale: [rows] f32, 1 / sqrt(mean(x²) + eps); unused by rms_norm
    int64_t rows;         // >= 0
    int32_t n;            // 1 .. DSV41_ROW_NORM_MAX_N
    int32_t x_f32;        // 1: x is f32, 0: bf16
    float mean_mul;       // (float)(1.0 / n), the factor candle's mean multiplies the sum by
    float eps;            // (float)eps
} Dsv41RowNormParams;

typedef struct {
    const void* x;        // [tokens, hc, d] bf16 or f32 (x_f32), contiguous: the mHC stream
    const float* pre;     // [tokens, hc] f32, contiguous: collapse weights
    void* out;            // [tokens, d] in x's dtype
    int64_t tokens;       // >= 0
    int32_t hc;           // 1 .. DSV41_COLLAPSE_MAX_HC
    int32_t d;            // >= 1
    int32_t x_f32;        // 1: x is f32, 0: bf16
    int32_t pad;          // 0
} Dsv41CollapseParams;

typedef struct {
    const void* x;        // [tokens, hc, d] bf16 or f32 (x_f32), contiguous: the stream
    const float* comb;    // [tokens, hc, hc] f32, contiguous: comb[t, i, j] moves copy i into copy j
    const void* y;        // [tokens, d] bf16 or f32 (y_f32), contiguous: the sublayer output
    const float* post;    // [tokens, hc] f32, contiguous
    void* out;            // [tokens, hc, d] bf16 or f32 (out_f32)
    int64_t tokens;       // >= 0
    int32_t hc;           // 1 ..= DSV41_MHC_POST_MAX_HC
    int32_t d;            // >= 1
    int32_t x_f32;        // 1: x is f32, 0: bf16
    int32_t y_f32;        // 1: y is f32, 0: bf16
    int32_t out_f32;      // 1: out is f32, 0: bf16
    int32_t pad;
} Dsv41MhcPostParams;

#define DSV41_MHC_POST_MAX_HC 32

typedef struct {
    const float* acc;     // [n] f32, contiguous, or NULL (= +0.0 everywhere)
    const void* v;        // [n] bf16 or f32 (v_f32), contiguous
    void* out;            // [n] bf16 or f32 (out_f32)
    int64_t n;            // >= 0
    int32_t v_f32;        // 1: v is f32, 0: bf16
    int32_t out_f32;      // 1: out is f32, 0: bf16
} Dsv41AccumulateParams;

typedef struct {
    const void* v;        // [n] bf16 or f32 (v_f32), contiguous
    float* out;           // [n] f32
    int64_t n;            // >= 0
    int32_t v_f32;        // 1: v is f32, 0: bf16
    float mul;            // the scale, as f32
} Dsv41ScaleRoundParams;

typedef struct {
    const void* x;        // [tokens, hc, d] bf16 or f32 (x_f32), contiguous: the mHC stream
    const float* kv;      // [tokens, (hc+1)·d] f32, contiguous: wkv output (hc key rows, then the value row)
    const float* qk;      // [hc, d] f32, contiguous: q_weight · k_weight
    void* out;            // [tokens, hc, d] in x's dtype
    int64_t tokens;       // >= 0
    int32_t hc;           // >= 1
    int32_t d;            // 1 .. DSV41_ROW_NORM_MAX_N
    int32_t x_f32;        // 1: x is f32, 0: bf16
    float mean_mul;       // (float)(1.0 / d)
    float eps;            // (float)rms_norm_eps
    float dot_mul;        // (float)(1.0 / sqrt(d))
    float clamp;          // (float)GATE_CLAMP, the floor of |dot| under the signed sqrt
    int32_t pad;          // 0
} Dsv41EngramMixParams;

// out = x / sqrt(mean(x²) + eps) · weight per row, rounded to x's dtype.
int dsv41_rms_norm(const Dsv41RowNormParams* p, size_t params_size, void* stream);
// out = x as f32, scale = 1 / sqrt(mean(x²) + eps) per row.
int dsv41_rms_scale(const Dsv41RowNormParams* p, size_t params_size, void* stream);
// out[t, c] = Σ_k x[t, k, c] · pre[t, k] (f32, k ascending), rounded to x's dtype.
int dsv41_mhc_collapse(const Dsv41CollapseParams* p, size_t params_size, void* stream);
// out[t, k] = cast(h + σ(signed_sqrt(dot))·value), h = f32(x[t, k]) (model::engram::engram_mix).
int dsv41_engram_mix(const Dsv41EngramMixParams* p, size_t params_size, void* stream);
// out = cast(acc + f32(v)) in f32 (acc = 0 when NULL).
int dsv41_accumulate(const Dsv41AccumulateParams* p, size_t params_size, void* stream);
// out = f32(bf16(f32(v)·mul)) (the indexer's head weights).
int dsv41_scale_round(const Dsv41ScaleRoundParams* p, size_t params_size, void* stream);
// out[t, j, c] = cast(post[t, j] · y[t, c] + mixed[t, j, c]) in f32.
int dsv41_mhc_post(const Dsv41MhcPostParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
