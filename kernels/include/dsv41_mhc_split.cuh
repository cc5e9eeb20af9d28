// The mHC coefficient split of one token (spec §3.2 steps 2–8) as device code shared by
// kernels/mhc_sinkhorn.cu (the split alone) and kernels/mhc_mixes.cu (the mixes and the split in
// one launch). The numerics are those documented in kernels/mhc_sinkhorn.cu: bit for bit the
// Candle op sequence of model::mhc::split_sinkhorn on a CUDA device.
#pragma once

#include <cuda_runtime.h>

namespace dsv41 {

__device__ __forceinline__ float candle_sigmoid(float x) {
    return static_cast<float>(1.0 / static_cast<double>(__fadd_rn(1.0f, expf(-x))));
}

// Sum of v[0..N) (N ≤ 32) in the order of a 32-lane xor-butterfly with masks 16, 8, 4, 2, 1 and
// zeros in lanes ≥ N: lane 0's value after each level is its own partial plus the partner's.
template <int N>
__device__ __forceinline__ float butterfly_sum(const float* v) {
    float lane[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) lane[i] = i < N ? v[i] : 0.0f;
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) {
#pragma unroll
        for (int i = 0; i < mask; ++i) lane[i] = __fadd_rn(lane[i], lane[i + mask]);
    }
    return lane[0];
}

// Lanes per token of the lanes layout: next_pow2(hc²) (hc ≤ 5).
template <int HC>
__host__ __device__ constexpr int mhc_split_lanes() {
    return HC * HC <= 1 ? 1 : HC * HC <= 2 ? 2 : HC * HC <= 4 ? 4 : HC * HC <= 8 ? 8 : HC * HC <= 16 ? 16 : 32;
}

// The lanes layout: mhc_split_lanes<HC>() consecutive lanes of a warp per token, lane e < hc²
// holds comb[e / hc][e % hc]. `m`: the token's (2+hc)·hc rsqrt-scaled raw mixes (readable even
// when !live); `pre`, `post`, `comb`: the token's output rows, written only when `live`.
// `base_lane`: the warp lane of the token's e = 0. Every lane of the warp must call (the shuffles
// are full-warp); a lane of a token past the end passes live = false and computes on zeros.
template <int HC>
__device__ __forceinline__ void mhc_split_token_lanes(const float* m, bool live, int e, int base_lane, const float* scale,
                                                      const float* base, float eps, int iters, float* pre, float* post,
                                                      float* comb) {
    constexpr int N = HC * HC;
    static_assert(N <= 32, "the lanes layout takes hc <= 5");
    const int i = e / HC, j = e % HC;
    auto part = [&](int k, float s) { return __fadd_rn(__fmul_rn(m[k], s), base[k]); };
    if (live && e < HC) {
        pre[e] = __fadd_rn(candle_sigmoid(part(e, scale[0])), eps);
        post[e] = __fmul_rn(candle_sigmoid(part(HC + e, scale[1])), 2.0f);
    }
    // Element k of the token's matrix from its lane (every lane calls; k < N).
    auto at = [&](float v, int k) { return __shfl_sync(0xffffffffu, v, base_lane + k); };
    float c = live && e < N ? part(2 * HC + e, scale[2]) : 0.0f;
    // Row softmax: max, expf, the butterfly sum of the row, times the reciprocal, + eps.
    float row[HC];
#pragma unroll
    for (int b = 0; b < HC; ++b) row[b] = at(c, i < HC ? i * HC + b : b);
    float mx = -INFINITY;
#pragma unroll
    for (int b = 0; b < HC; ++b) mx = fmaxf(mx, row[b]);
#pragma unroll
    for (int b = 0; b < HC; ++b) row[b] = expf(__fsub_rn(row[b], mx));
    const float inv = static_cast<float>(1.0 / static_cast<double>(butterfly_sum<HC>(row)));
    c = __fadd_rn(__fmul_rn(row[j], inv), eps);
    // Divides the lane's element by its column's (rows: row's) sum + eps, summed from 0 in order.
    auto normalize = [&](bool rows) {
        float s = 0.0f;
#pragma unroll
        for (int b = 0; b < HC; ++b) {
            const int k = rows ? i * HC + b : b * HC + j;
            s = __fadd_rn(s, at(c, k < N ? k : 0));
        }
        c = __fdiv_rn(c, __fadd_rn(s, eps));
    };
    normalize(false);
    for (int it = 1; it < iters; ++it) {
        normalize(true);
        normalize(false);
    }
    if (live && e < N) comb[e] = c;
}

}  // namespace dsv41
