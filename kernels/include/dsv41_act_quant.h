// Parameter block of kernels/act_quant.cu (blockwise fake quantization of a dense tensor).
// Same conventions as dsv41_params.h: 8-byte fields first, then 4-byte fields; the Rust mirror
// is crates/deepseek-v41/src/cuda/act_quant.rs and the launcher refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

// out = fake_quant(x) per block of the format's block size (32, or 16 for FP4_E4M3_B16) of
// consecutive elements. A block never straddles two rows because the row length is a multiple
// of the block (checked on the Rust side), so the tensor is treated as one flat array.
typedef struct {
    const void* x;      // [num_elems] bf16 or f32 (is_f32), contiguous, 16-byte aligned
    void* out;          // [num_elems] same dtype as x, contiguous (may equal x: in place)
    int64_t num_elems;  // multiple of the block size
    int32_t quant;      // DSV41_QUANT_FP8_UE8M0_B32, _FP4_E4M3_B16 or _FP4_UE8M0_B32
    int32_t is_f32;     // 1: f32 elements, 0: bf16 elements
} Dsv41FakeQuantParams;

int dsv41_fake_quant(const Dsv41FakeQuantParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
