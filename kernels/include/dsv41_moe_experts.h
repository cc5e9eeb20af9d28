// Parameter blocks of kernels/moe_experts.cu (the routed MXFP4 experts of one MoE layer as two
// grouped launches and a combine, spec §8, §2.4). Same conventions as dsv41_params.h: 8-byte
// fields first, then 4-byte fields; the Rust mirror is crates/deepseek-v41/src/cuda/moe_experts.rs
// and the launchers refuse a size mismatch.
//
// Expert weights stay as the release stores them (MXFP4): codes [N, K/2] u8, two e2m1 codes per
// byte (low nibble = even input), scales [N, K/32] e8m0 bytes; W[n, k] = e2m1 * 2^(s - 127).
// Each expert's tensors live anywhere on the device: the launch reads them through a table of
// device pointers, so the checkpoint's per-expert tensors are used where they were loaded.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV41_MOE_EXPERTS_MAX_E 512      // experts per layer (one scan thread per expert)
#define DSV41_MOE_EXPERTS_MAX_KDIM 5120  // inputs per projection (a chunk's panel stays in shared memory)

// mode
#define DSV41_MOE_GATE_UP 0  // act[p] = bf16(silu(min(bf16(x·w1ᵀ), L)) · clamp(bf16(x·w3ᵀ), ±L) · g)
#define DSV41_MOE_DOWN 1     // y[p] = bf16(act_q[p]·w2ᵀ)

typedef struct {
    const uint64_t* experts;  // [E, 4] device addresses: GATE_UP (w1 codes, w1 scales, w3 codes, w3 scales); DOWN (w2 codes, w2 scales, 0, 0)
    const void* x;            // bf16, contiguous. GATE_UP: [T, K] the layer input; DOWN: [S, K] the activations in expert order (S = T·k)
    const uint32_t* counts;   // [E] slots per expert (kernels/moe_route.cu)
    const uint32_t* order;    // [S] slots t·k + j grouped by expert (kernels/moe_route.cu)
    const float* route_w;     // [S] routing weight of slot t·k + j (GATE_UP; NULL for DOWN)
    void* out;                // [S, N] bf16: row p = the p-th slot in expert order
    uint32_t* pos;            // [S] out (GATE_UP, may be NULL): pos[order[p]] = p, for the combine
    void* scratch;            // dsv41_moe_experts_scratch_bytes() bytes, 256-byte aligned
    int64_t scratch_bytes;
    int64_t num_tokens;       // T >= 0 (T·k < 2^31)
    int32_t num_experts;      // E in 1 ..= DSV41_MOE_EXPERTS_MAX_E
    int32_t k;                // experts per token, >= 1
    int32_t n;                // rows of each weight (N): inter for GATE_UP, hidden for DOWN
    int32_t kdim;             // K, a positive multiple of 32, at most DSV41_MOE_EXPERTS_MAX_KDIM
    int32_t mode;             // DSV41_MOE_GATE_UP / DSV41_MOE_DOWN
    float limit;              // SwiGLU limit L (GATE_UP); <= 0: no clamp
} Dsv41MoeExpertsParams;

// Bytes of scratch the launch of *p needs (activation panel and scales, sorted token rows and
// weights); *bytes is set on success.
int dsv41_moe_experts_scratch_bytes(const Dsv41MoeExpertsParams* p, size_t params_size, int64_t* bytes);

// One grouped projection over every expert that has slots (two launches: the activation panel,
// then the weight-streaming kernel). Every row of out is written.
int dsv41_moe_experts(const Dsv41MoeExpertsParams* p, size_t params_size, void* stream);

typedef struct {
    const void* y;          // [S, D] bf16 expert outputs in expert order (DOWN's out)
    const uint32_t* ids;    // [T, k] experts of each token (kernels/moe_route.cu)
    const uint32_t* pos;    // [S] position in expert order of slot t·k + j (GATE_UP's pos)
    const void* shared;     // [T, D] bf16 shared expert output, or NULL
    void* out;              // [T, D] bf16
    int64_t num_tokens;     // T >= 0
    int32_t k;              // >= 1, <= 16
    int32_t d;              // D >= 1
} Dsv41MoeCombineParams;

// out[t] = bf16( (0 + Σ_{slots of t by ascending expert id} f32(y[pos])) + f32(shared[t]) ):
// the CPU MoE's f32 sum order (model::moe).
int dsv41_moe_combine(const Dsv41MoeCombineParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
