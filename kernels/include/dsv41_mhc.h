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

#ifdef __cplusplus
}
#endif
