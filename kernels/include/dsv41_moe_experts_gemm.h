// The tensor-core form of the grouped MXFP4 expert projections (kernels/moe_experts_gemm.cu): the
// same two launches as dsv41_moe_experts (GATE_UP with the SwiGLU epilogue, DOWN) with the same
// parameter block (dsv41_moe_experts.h) and outputs, for many slots per expert (prefill). The Rust
// mirror is crates/deepseek-v41/src/cuda/moe_experts_gemm.rs.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_moe_experts.h"

#ifdef __cplusplus
extern "C" {
#endif

// Bits of the per-expert flags (dsv41_moe_gemm_flags): a projection whose weights hold a block
// that the bf16 tensor-core path does not multiply exactly runs on the exact f32 path instead.
#define DSV41_MOE_GEMM_FLAG_GATE_UP 1u  // w1 or w3
#define DSV41_MOE_GEMM_FLAG_DOWN 2u     // w2

// Bytes of scratch dsv41_moe_gemm needs for *p (the bf16 activation panel, the sorted token rows
// and routing weights); *bytes is set on success.
int dsv41_moe_gemm_scratch_bytes(const Dsv41MoeExpertsParams* p, size_t params_size, int64_t* bytes);

// One grouped projection (p->mode) over every expert that has slots, on the tensor cores: a prep
// launch (the Q1-quantized activations as bf16 values, the slots' tokens, weights and pos), then
// the GEMM. flags: [E] u32 from dsv41_moe_gemm_flags (read on the device). Every row of p->out
// is written.
int dsv41_moe_gemm(const Dsv41MoeExpertsParams* p, size_t params_size, const uint32_t* flags, void* stream);

typedef struct {
    const uint64_t* gate_up;  // [E, 4] device addresses (w1 codes, w1 scales, w3 codes, w3 scales)
    const uint64_t* down;     // [E, 4] device addresses (w2 codes, w2 scales, 0, 0)
    uint32_t* flags;          // [E] out, zeroed by the caller; bits DSV41_MOE_GEMM_FLAG_*
    int32_t num_experts;      // E in 1 ..= DSV41_MOE_EXPERTS_MAX_E
    int32_t hidden;           // w1 / w3 [inter, hidden], w2 [hidden, inter]; multiples of 32
    int32_t inter;
    int32_t _pad;
} Dsv41MoeGemmFlagsParams;

// Sets, per expert, the flag of each projection with a block (32 inputs of a row) that has scale
// byte 255 (NaN), or a nonzero code under a scale byte outside the fast path's range (see the
// kernel's header comment). One launch; the experts' weights are static, so this runs once.
int dsv41_moe_gemm_flags(const Dsv41MoeGemmFlagsParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
