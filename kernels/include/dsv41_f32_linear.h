// Parameter block of kernels/f32_linear.cu (the f32-weight linears at decode sizes: y = f32(x)·Wᵀ
// for m ≤ 16 rows). Same conventions as dsv41_params.h; the Rust mirror is
// crates/deepseek-v41/src/cuda/f32_linear.rs and the launcher refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV41_F32_LINEAR_MAX_M 16

typedef struct {
    const void* x;   // [m, k] bf16 (x_f32 = 0) or f32, rows `x_stride` elements apart
    const float* w;  // [n, k] f32, contiguous
    float* y;        // [m, n] f32 out, contiguous
    int64_t n;       // >= 1 output features
    int64_t k;       // >= 1 input features
    int64_t x_stride;  // >= k
    int32_t m;       // 1 .. DSV41_F32_LINEAR_MAX_M
    int32_t x_f32;   // 0: x is bf16, 1: f32
} Dsv41F32LinearParams;

int dsv41_f32_linear(const Dsv41F32LinearParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
