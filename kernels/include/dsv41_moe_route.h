// Parameter block of kernels/moe_route.cu (the MoE router's decision and the token sort for a
// grouped expert kernel, spec §8 steps 1–4). Same conventions as dsv41_params.h: 8-byte fields
// first, then 4-byte fields; the Rust mirror is crates/deepseek-v41/src/cuda/moe_route.rs and the
// launcher refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV41_MOE_ROUTE_MAX_EXPERTS 512  // E: 16 scores per lane of the token's warp
#define DSV41_MOE_ROUTE_MAX_K 16         // k: one selected expert per lane, in registers

typedef struct {
    const float* logits;  // [T, E] f32, contiguous: the router logits x·Wᵀ (before gate_temp)
    const float* bias;    // [E] f32: the selection bias
    uint32_t* ids;        // [T, k] out: chosen experts, descending biased score, ties lower id first
    float* weights;       // [T, k] out: s_e / (Σ_sel s + 1e-20) · route_scale (unbiased scores)
    uint32_t* counts;     // [E] out: slots routed to each expert
    uint32_t* offsets;    // [E + 1] out: exclusive prefix sum of counts; offsets[E] = T·k
    uint32_t* order;      // [T·k] out: slots t·k + j grouped by expert ascending, slot ascending
    int64_t num_tokens;   // T >= 0, T·k < 2^31
    int32_t num_experts;  // E in 1 .. DSV41_MOE_ROUTE_MAX_EXPERTS
    int32_t k;            // 1 .. min(E, DSV41_MOE_ROUTE_MAX_K)
    float temp_scale;     // (float)(1.0 / (double)gate_temp): l' = l · temp_scale + 0 when apply_temp
    float route_scale;    // routed_scaling_factor, finite
    int32_t apply_temp;   // 1: scale the logits (gate_temp != 1), 0: use them as they are
    int32_t _pad;
} Dsv41MoeRouteParams;

// One launch for T <= 8 (a cluster of T CTAs: scores and route per CTA, sort in CTA 0), else two (route: a CTA of 1 or 8
// tokens; sort: one CTA up to 256 tokens, else ceil(T / tokens-per-CTA) CTAs), launched with
// programmatic dependent launch. Every output element is written.
int dsv41_moe_route(const Dsv41MoeRouteParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
