// Parameter blocks of kernels/fp8_linear.cu (the block-scaled FP8 linear, spec §2.4-§2.5, issue
// 21). Same conventions as dsv41_params.h: 8-byte fields first, then 4-byte fields; the Rust
// mirror is crates/deepseek-v41/src/cuda/ffi.rs and the launchers refuse a size mismatch.
//
// Weight format (the release's dense FP8): codes e4m3fn [N, K] row-major (out = N, in = K),
// scales e8m0 [ceil(N/32), ceil(K/32)] row-major, W[n, k] = e4m3(codes[n, k]) * 2^(scales[n/32,
// k/32] - 127) (byte 255 = NaN).
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const void* x;          // [m, k] bf16, contiguous
    const uint8_t* codes;   // [n, k] e4m3fn bytes, contiguous
    const uint8_t* scales;  // [ceil(n/32), ceil(k/32)] e8m0 bytes, contiguous
    void* out;              // [m, n] bf16, contiguous; with n_first > 0: [m, n_first] (features 0 .. n_first)
    void* out2;             // n_first > 0: [m, n - n_first] bf16, contiguous (features n_first .. n); else NULL
    void* scratch;          // dsv41_fp8_linear_scratch_bytes() bytes, 256-byte aligned (NULL when 0)
    int64_t scratch_bytes;  // size of scratch
    unsigned* counters;     // DSV41_FP8_COUNTERS arrival counters, all zero, left zero (or NULL): what the
                            // fused activation's split-K uses (the prep kernel zeroes its own in the scratch)
    int32_t m;              // tokens, 1 ..= DSV41_FP8_STREAM_MAX_M
    int32_t n;              // output features >= 1
    int32_t k;              // input features >= 1 (a multiple of 32 when act_quant)
    int32_t act_quant;      // 1: FP8 activation quantization per 1x32 block (Q1), 0: bf16 x as is
    int32_t splits;         // split-K factor; 0 = the launcher's choice (WARP: raised to what its shared memory needs)
    int32_t variant;        // DSV41_FP8_VARIANT_*
    int32_t prep;           // DSV41_FP8_PREP_*
    int32_t n_first;        // 0: one output; else a multiple of 32 in 32 .. n - 32: the product of two
                            // linears of one input stacked along N, written to out and out2 (spec §2.5: every
                            // output feature is its own dot product, so each output is its linear's alone)
} Dsv41Fp8LinearParams;

// How the weight-streaming kernel gets its activations. FUSED: REGISTERS with m <= 16 quantizes
// (or reads) x itself, per k32 block in registers - one launch, no panel - where k % 8 == 0, x
// is 16-byte aligned and either one K split runs or `counters` is given; else (and with KERNEL)
// a prep kernel writes the activation panel first (kernels/fp8_linear.cu). AUTO: FUSED for
// weights of at most DSV41_FP8_FUSED_AUTO_MAX_BYTES code bytes (launch-bound sizes), KERNEL
// above. All give the same bits.
#define DSV41_FP8_PREP_AUTO 0
#define DSV41_FP8_PREP_KERNEL 1
#define DSV41_FP8_PREP_FUSED 2
#define DSV41_FP8_FUSED_AUTO_MAX_BYTES (4ll << 20)
// Arrival counters the caller provides for the fused activation (one per 32-row block).
#define DSV41_FP8_COUNTERS 65536

// Weight-streaming kernel variants: AUTO = PIPELINE for m > 16 when k % 128 == 0, the codes are
// 16-byte and the scales 4-byte aligned, else REGISTERS (which also takes any k and alignment).
// WARP takes any k and alignment for m <= 64; asked for with m > 64 it runs what AUTO picks.
#define DSV41_FP8_VARIANT_AUTO 0
#define DSV41_FP8_VARIANT_REGISTERS 1  // 8-byte loads into a register ring, 4 k32 blocks in flight per warp
#define DSV41_FP8_VARIANT_PIPELINE 2   // stream-K: a persistent grid, cp.async stages of 128 rows x 128 bytes in shared memory
#define DSV41_FP8_VARIANT_WARP 3       // warp-owned 16-row units streamed into registers (kernels/fp8_linear_warp.cu)

// Largest m of the weight-streaming kernel (tokens run in chunks of 64 columns).
#define DSV41_FP8_STREAM_MAX_M 256
// Largest m of the WARP variant (one token chunk); above, a WARP call runs what AUTO picks.
#define DSV41_FP8_WARP_MAX_M 64

// Bytes of scratch the weight-streaming launch of *p needs (activation panel, block scales,
// split-K partials, arrival counters); *bytes is set on success.
int dsv41_fp8_linear_scratch_bytes(const Dsv41Fp8LinearParams* p, size_t params_size, int64_t* bytes);

// out = bf16( sum_k xq[m, k] * W[n, k] ) with f32 accumulation (xq = Q1(x) when act_quant, else
// x): the weight-streaming kernel (decode and small prefills).
int dsv41_fp8_linear(const Dsv41Fp8LinearParams* p, size_t params_size, void* stream);

// The large-m FP8 GEMM (kernels/fp8_gemm.cu, wgmma m64n128k32 e4m3): the same parameter block,
// splits and variant ignored (0). Needs act_quant = 1 and k a multiple of 128 (else
// DSV41_ERR_SHAPE: the caller dequantizes instead), any m >= 1 and n >= 1; x 16-byte, codes
// 16-byte, scales 4-byte and out 4-byte aligned (else DSV41_ERR_ALIGNMENT).
int dsv41_fp8_gemm_scratch_bytes(const Dsv41Fp8LinearParams* p, size_t params_size, int64_t* bytes);
int dsv41_fp8_gemm(const Dsv41Fp8LinearParams* p, size_t params_size, void* stream);

typedef struct {
    const uint8_t* codes;   // [n, k] e4m3fn bytes, contiguous
    const uint8_t* scales;  // [ceil(n/32), ceil(k/32)] e8m0 bytes, contiguous
    void* out;              // [n, k] bf16 or f32 (out_f32), contiguous
    int32_t n;              // >= 1
    int32_t k;              // >= 1
    int32_t out_f32;        // 1: f32 output, 0: bf16 (round to nearest even)
    int32_t reserved;       // 0
} Dsv41Fp8DequantParams;

// out[n, k] = W[n, k] (negative zero as +0, as loader::dequant_fp8_block32).
int dsv41_fp8_dequant(const Dsv41Fp8DequantParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
