// What the two forms of the grouped MXFP4 expert projections share (kernels/moe_experts.cu: weight
// streaming for decode; kernels/moe_experts_gemm.cu: the tensor-core GEMM for prefill), which take
// the same parameter block (dsv41_moe_experts.h) and write the same outputs: on the device the
// GATE_UP epilogue and the prep kernels' slot sorting; on the host the parameter checks, the
// scratch after each kernel's own activation panel, the checks of a launch's buffers, the prep
// kernel's grid and the kernels' common arguments.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "dsv41_launch.cuh"
#include "dsv41_moe_experts.h"

namespace dsv41_experts {

// The SwiGLU of kernels/swiglu.cu on bf16-rounded a and u, times the routing weight w (limit <= 0:
// no clamp): silu(min(a, L)) · clamp(u, −L, L) · w with an IEEE division and two separate
// roundings, the op sequence of model::moe::Expert.
__device__ __forceinline__ float swiglu(float a, float u, float w, float limit) {
    if (limit > 0.0f) {
        a = fminf(a, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    const float s = __fdiv_rn(a, __fadd_rn(1.0f, expf(-a)));
    return __fmul_rn(__fmul_rn(s, u), w);
}

// The GATE_UP prep kernels' slot part (a grid of blocks of THREADS threads; gid: the global thread
// index), for slot positions p = gid, gid + grid size, ... < slots (the p-th slot in expert order,
// order[p] = t·k + j): its token row t, its routing weight and pos[order[p]] = p (pos may be NULL).
template <int THREADS>
__device__ __forceinline__ void sort_slots(int64_t gid, const uint32_t* __restrict__ order, const float* __restrict__ route_w,
                                           uint32_t* __restrict__ tok_sorted, float* __restrict__ rw_sorted, uint32_t* __restrict__ pos,
                                           int64_t slots, int topk) {
    for (int64_t p = gid; p < slots; p += static_cast<int64_t>(gridDim.x) * THREADS) {
        const uint32_t s = order[p];
        tok_sorted[p] = s / static_cast<uint32_t>(topk);
        rw_sorted[p] = route_w[s];
        if (pos) pos[s] = static_cast<uint32_t>(p);
    }
}

// The checks both launchers make before their own: the block's size, E in 1 ..= MAX_E, k >= 1,
// T >= 0, N >= 1, K a positive multiple of 32, the mode, T·k < 2^31.
inline int validate_common(const Dsv41MoeExpertsParams* p, size_t params_size) {
    if (params_size != sizeof(Dsv41MoeExpertsParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_experts < 1 || p->num_experts > DSV41_MOE_EXPERTS_MAX_E || p->k < 1 || p->num_tokens < 0) return DSV41_ERR_SHAPE;
    if (p->n < 1 || p->kdim < 32 || p->kdim % 32 != 0) return DSV41_ERR_SHAPE;
    if (p->mode != DSV41_MOE_GATE_UP && p->mode != DSV41_MOE_DOWN) return DSV41_ERR_SHAPE;
    if (p->num_tokens * p->k >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    return DSV41_OK;
}

// Rows of the activation panel: the T tokens (GATE_UP: the kernels gather them per slot) or the
// S = T·k slots' activations in expert order (DOWN).
inline int64_t panel_rows(const Dsv41MoeExpertsParams* p) { return p->mode == DSV41_MOE_GATE_UP ? p->num_tokens : p->num_tokens * p->k; }

// The scratch after a kernel's activation panel (which ends at `panel_end` bytes, a multiple of
// 256): for GATE_UP the slots' token rows [S] u32 and routing weights [S] f32 in expert order,
// each 256-byte aligned; `bytes` is the whole scratch (at least 256).
struct SlotScratch {
    int64_t tok_off, rw_off, bytes;
};
inline SlotScratch slot_scratch(const Dsv41MoeExpertsParams* p, int64_t panel_end) {
    const int64_t sorted = p->mode == DSV41_MOE_GATE_UP ? dsv41_launch::align256(p->num_tokens * p->k * 4) : 0;
    SlotScratch s;
    s.tok_off = panel_end;
    s.rw_off = s.tok_off + sorted;
    s.bytes = s.rw_off + sorted;
    if (s.bytes == 0) s.bytes = 256;
    return s;
}

// The checks of a launch with T > 0 (after the parameter checks): the buffers it reads and writes
// (route_w for GATE_UP), a scratch of at least `scratch_need` bytes, 256-byte aligned, and bf16
// x / out.
inline int check_buffers(const Dsv41MoeExpertsParams* p, int64_t scratch_need) {
    const bool gu = p->mode == DSV41_MOE_GATE_UP;
    if (!p->experts || !p->x || !p->counts || !p->order || !p->out || !p->scratch || (gu && !p->route_w)) return DSV41_ERR_NULL;
    if (p->scratch_bytes < scratch_need) return DSV41_ERR_SHAPE;
    if ((reinterpret_cast<uintptr_t>(p->scratch) & 255) != 0 || (reinterpret_cast<uintptr_t>(p->out) & 1) != 0 ||
        (reinterpret_cast<uintptr_t>(p->x) & 1) != 0)
        return DSV41_ERR_ALIGNMENT;
    return DSV41_OK;
}

// Blocks of `threads` for a prep kernel with a warp per (panel row, 32-input block) of `rows` x
// `blocks32` and a thread per slot (GATE_UP's sorted rows), whichever needs more threads; -1 when
// the grid would reach 2^31 blocks (the launchers return DSV41_ERR_SHAPE).
inline int64_t prep_blocks(int64_t rows, int64_t blocks32, int64_t slots, int threads) {
    const int64_t need = rows * blocks32 * 32 > slots ? rows * blocks32 * 32 : slots;
    const int64_t blocks = (need + threads - 1) / threads;
    return blocks >= (int64_t{1} << 31) ? -1 : blocks;
}

// The fields both kernels' Args take from the parameter block and the scratch (the experts'
// table, the counts, the sorted rows and weights, out, E, N, K, K / 32, the SwiGLU limit).
template <class Args>
inline void set_common_args(Args& a, const Dsv41MoeExpertsParams* p, const uint32_t* tok_sorted, const float* rw_sorted) {
    a.experts = p->experts;
    a.counts = p->counts;
    a.tok_sorted = tok_sorted;
    a.rw_sorted = rw_sorted;
    a.out = static_cast<__nv_bfloat16*>(p->out);
    a.e = p->num_experts;
    a.n = p->n;
    a.k = p->kdim;
    a.kb = p->kdim / 32;
    a.limit = p->limit;
}

}  // namespace dsv41_experts
