// Parameter block of kernels/swiglu.cu (the MoE experts' clamped SwiGLU with the routing weight,
// spec §8). Same conventions as dsv41_params.h: 8-byte fields first, then 4-byte fields; the
// Rust mirror is crates/deepseek-v41/src/cuda/swiglu.rs and the launcher refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const void* gate;     // [rows, inter] bf16 or f32 (x_f32), contiguous: w1·x
    const void* up;       // [rows, inter] gate's dtype, contiguous: w3·x
    const float* weight;  // [rows] f32 routing weight per row, or NULL (shared expert)
    void* out;            // [rows, inter] gate's dtype
    int64_t rows;         // >= 0
    int32_t inter;        // >= 1
    int32_t x_f32;        // 1: f32 inputs and output, 0: bf16
    int32_t clamp;        // 1: clamp with limit (gate above only, up on both sides), 0: none
    float limit;          // (float)swiglu_limit, > 0 when clamp
} Dsv41SwigluParams;

// out = cast(silu(min(gate, L)) · clamp(up, −L, L) · weight) in f32.
int dsv41_swiglu(const Dsv41SwigluParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
