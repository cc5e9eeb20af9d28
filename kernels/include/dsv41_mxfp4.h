// Parameter block of kernels/mxfp4.cu (the MXFP4 routed-expert weights, spec §2.4). Same
// conventions as dsv41_params.h: 8-byte fields first, then 4-byte fields; the Rust mirror is
// crates/deepseek-v41/src/cuda/ffi.rs and the launcher refuses a size mismatch.
//
// Weight format (the release's routed experts): codes [N, K/2] bytes row-major (out = N, in = K),
// byte j of a row holding the e2m1 code of input 2j in its low nibble and of input 2j+1 in its high
// nibble; scales e8m0 [N, K/32] row-major; W[n, k] = e2m1(code(n, k)) * 2^(scales[n, k/32] - 127)
// (byte 255 = NaN). K is a multiple of 32.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const uint8_t* codes;   // [n, k/2] packed e2m1 bytes, contiguous
    const uint8_t* scales;  // [n, k/32] e8m0 bytes, contiguous
    void* out;              // [n, k] bf16 or f32 (out_f32), contiguous
    int32_t n;              // >= 1
    int32_t k;              // >= 32, a multiple of 32
    int32_t out_f32;        // 1: f32 output, 0: bf16
    int32_t reserved;       // 0
} Dsv41Mxfp4DequantParams;

// out[n, k] = W[n, k] as crate::loader::dequant_mxfp4 computes it (code 8, "-0", as +0; f32
// products, inf where they overflow; the NaN of scale byte 255 as the host's bits 0x7fc00000),
// rounded to bf16 when !out_f32 (exact: every value has at most two significant bits).
int dsv41_mxfp4_dequant(const Dsv41Mxfp4DequantParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
