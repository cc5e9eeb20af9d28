// Parameter block of kernels/mhc_sinkhorn.cu (the mHC coefficient split, spec §3.2 steps 2–8).
// Same conventions as dsv41_params.h: 8-byte fields first, then 4-byte fields; the Rust mirror
// is crates/deepseek-v41/src/cuda/mhc_sinkhorn.rs and the launcher refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV41_MHC_MAX_HC 8

typedef struct {
    const float* mixes;  // [tokens, (2+hc)·hc] f32, contiguous: the rsqrt-scaled raw mixes
    const float* scale;  // [3] f32: scales of the pre, post and comb parts
    const float* base;   // [(2+hc)·hc] f32
    float* pre;          // [tokens, hc] f32 out
    float* post;         // [tokens, hc] f32 out
    float* comb;         // [tokens, hc, hc] f32 out
    int64_t tokens;      // >= 0
    int32_t hc;          // 1 .. DSV41_MHC_MAX_HC
    int32_t iters;       // >= 1 (Sinkhorn iterations)
    float eps;           // hc_eps, as f32
} Dsv41MhcSplitParams;

int dsv41_mhc_split_sinkhorn(const Dsv41MhcSplitParams* p, size_t params_size, void* stream);

// kernels/mhc_mixes.cu: the raw mixes (x·fnᵀ)·rsqrt(mean(x²) + norm_eps) and the split above in
// one launch (spec §3.2 steps 1–8).
#define DSV41_MHC_MIXES_MAX_HC 4
#define DSV41_MHC_MIXES_MAX_SPLITS 8

typedef struct {
    const void* x;       // [tokens, n] bf16 (x_f32 = 0) or f32, contiguous: the stream rows (n = hc·D)
    const float* fn;     // [(2+hc)·hc, n] f32, contiguous: hc_{attn,ffn}_fn
    const float* scale;  // [3] f32
    const float* base;   // [(2+hc)·hc] f32
    float* pre;          // [tokens, hc] f32 out
    float* post;         // [tokens, hc] f32 out
    float* comb;         // [tokens, hc, hc] f32 out
    int64_t tokens;      // >= 0
    int32_t n;           // >= 1
    int32_t hc;          // 1 .. DSV41_MHC_MIXES_MAX_HC
    int32_t iters;       // >= 1
    int32_t x_f32;       // 0: x is bf16, 1: f32
    int32_t splits;      // CTAs of a cluster sharing a token tile's n: 0 = ceil(n / 2048) capped at
                         // DSV41_MHC_MIXES_MAX_SPLITS, else 1 .. that cap (≤ n)
    float eps;           // hc_eps
    float norm_eps;      // rms_norm_eps
    int32_t reserved;    // 0
} Dsv41MhcMixesParams;

int dsv41_mhc_mixes(const Dsv41MhcMixesParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
