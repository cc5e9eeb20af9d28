// mhc_split_sinkhorn: the mHC coefficient split (spec §3.2 steps 2–8) for all tokens of a call
// in one launch: pre = σ(m·s0 + b) + eps, post = 2·σ(m·s1 + b), comb = row softmax of
// (m·s2 + b) + eps, one column normalization, then iters − 1 (row, column) normalizations with
// eps inside every division.
//
// Why a kernel: written with Candle ops these are ~130 launches of tiny kernels per call (each
// normalization is a sum, an add and a division over [T, hc, hc]); a decode step of a small model
// spent most of its time launching them. Here one thread owns one token's hc×hc matrix in
// registers (hc ≤ 8); the work is negligible, the launch is the cost.
//
// Numerics: bit for bit the same as the Candle ops this replaces on a CUDA device
// (model::mhc::split_sinkhorn's op sequence run by candle's CUDA kernels, checked in
// tests/cuda_layer.rs), so the model's device results do not move:
//   * products and sums are separate IEEE roundings (__fmul_rn / __fadd_rn), as in candle's
//     binary kernels; `x + eps` and `2·x` are candle affines, which round once like __fadd_rn /
//     an exact doubling;
//   * σ(x) = (float)(1.0 / (double)(1.0f + expf(−x))), candle's usigmoid for f32;
//   * softmax: candle's softmax kernel runs one row per 32-lane warp: max, expf(x − max), the
//     row sum by an xor-butterfly over the 32 lanes (lanes ≥ hc hold 0), then
//     x · (float)(1.0 / (double)sum); the butterfly's association order is reproduced below;
//   * the normalizations' sums are candle's small reduction (one thread per output, a sequential
//     sum from 0 in index order); the divisions are IEEE (__fdiv_rn).
// The CPU reference (the same ops on the host) differs from this in the last bits of expf only.
//
// Two layouts, the same operations on every element:
//   * lanes (hc ≤ 5, the models' hc = 4): a group of P = next_pow2(hc²) lanes of one warp per
//     token, one lane per comb element. A row or column sum gathers the hc values with shuffles
//     and adds them from 0 in index order, exactly the serial sum; each lane then divides its own
//     element. The iterations' 2·hc² IEEE divisions per iteration (a subroutine call each, which
//     the compiler cannot overlap) run on hc² lanes at once: 4 µs instead of 23 µs per call at
//     hc = 4 on an H100 (`bench_mhc`).
//   * thread (hc 6..8): one thread owns one token's matrix in registers.
#include <cuda_runtime.h>

#include <type_traits>

#include "include/dsv41_mhc.h"
#include "include/dsv41_mhc_split.cuh"

namespace dsv41 {

constexpr int kMhcThreads = 128;

template <int HC>
__global__ void __launch_bounds__(kMhcThreads) mhc_split_kernel(Dsv41MhcSplitParams p) {
    const int64_t t = static_cast<int64_t>(blockIdx.x) * kMhcThreads + threadIdx.x;
    if (t >= p.tokens) return;
    constexpr int W = (2 + HC) * HC;
    const float* m = p.mixes + t * W;
    const float s0 = p.scale[0], s1 = p.scale[1], s2 = p.scale[2];
    const float eps = p.eps;
    auto part = [&](int k, float s) { return __fadd_rn(__fmul_rn(m[k], s), p.base[k]); };

#pragma unroll
    for (int k = 0; k < HC; ++k) {
        p.pre[t * HC + k] = __fadd_rn(candle_sigmoid(part(k, s0)), eps);
        p.post[t * HC + k] = __fmul_rn(candle_sigmoid(part(HC + k, s1)), 2.0f);
    }

    float c[HC][HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < HC; ++j) {
            c[i][j] = part(2 * HC + i * HC + j, s2);
            mx = fmaxf(mx, c[i][j]);
        }
#pragma unroll
        for (int j = 0; j < HC; ++j) c[i][j] = expf(__fsub_rn(c[i][j], mx));
        const float inv = static_cast<float>(1.0 / static_cast<double>(butterfly_sum<HC>(c[i])));
#pragma unroll
        for (int j = 0; j < HC; ++j) c[i][j] = __fadd_rn(__fmul_rn(c[i][j], inv), eps);
    }
    // Divides every row (kRows) or column of c by its sum + eps; the sum runs from 0 in index order.
    auto normalize = [&](auto rows_tag) {
        constexpr bool kRows = decltype(rows_tag)::value;
#pragma unroll
        for (int a = 0; a < HC; ++a) {
            float s = 0.0f;
#pragma unroll
            for (int b = 0; b < HC; ++b) s = __fadd_rn(s, kRows ? c[a][b] : c[b][a]);
            s = __fadd_rn(s, eps);
#pragma unroll
            for (int b = 0; b < HC; ++b) {
                float& v = kRows ? c[a][b] : c[b][a];
                v = __fdiv_rn(v, s);
            }
        }
    };
    const auto rows = std::true_type{};
    const auto cols = std::false_type{};
    normalize(cols);
    for (int it = 1; it < p.iters; ++it) {
        normalize(rows);
        normalize(cols);
    }
#pragma unroll
    for (int i = 0; i < HC; ++i)
#pragma unroll
        for (int j = 0; j < HC; ++j) p.comb[(t * HC + i) * HC + j] = c[i][j];
}

// The lanes layout (see the header comment and include/dsv41_mhc_split.cuh).
template <int HC>
__global__ void __launch_bounds__(kMhcThreads) mhc_split_lanes_kernel(Dsv41MhcSplitParams p) {
    constexpr int P = mhc_split_lanes<HC>();
    constexpr int W = (2 + HC) * HC;
    const int64_t gid = static_cast<int64_t>(blockIdx.x) * kMhcThreads + threadIdx.x;
    const int64_t t = gid / P;
    const int e = static_cast<int>(gid % P);
    const int base_lane = static_cast<int>(threadIdx.x % 32) - e;
    const bool live = t < p.tokens;
    const int64_t tr = live ? t : 0;
    mhc_split_token_lanes<HC>(p.mixes + tr * W, live, e, base_lane, p.scale, p.base, p.eps, p.iters, p.pre + tr * HC,
                              p.post + tr * HC, p.comb + tr * HC * HC);
}

}  // namespace dsv41

extern "C" int dsv41_mhc_split_sinkhorn(const Dsv41MhcSplitParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41MhcSplitParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->tokens < 0 || p->hc < 1 || p->hc > DSV41_MHC_MAX_HC || p->iters < 1) return DSV41_ERR_SHAPE;
    if (p->tokens / kMhcThreads >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    if (p->tokens == 0) return DSV41_OK;
    if (!p->mixes || !p->scale || !p->base || !p->pre || !p->post || !p->comb) return DSV41_ERR_NULL;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (p->hc <= 5) {
        const int lanes = p->hc == 1 ? 1 : p->hc == 2 ? 4 : 16 * (p->hc > 4 ? 2 : 1);
        const int64_t threads = p->tokens * lanes;
        if (threads / kMhcThreads >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
        const dim3 lgrid(static_cast<unsigned>((threads + kMhcThreads - 1) / kMhcThreads));
        switch (p->hc) {
            case 1: mhc_split_lanes_kernel<1><<<lgrid, kMhcThreads, 0, s>>>(*p); break;
            case 2: mhc_split_lanes_kernel<2><<<lgrid, kMhcThreads, 0, s>>>(*p); break;
            case 3: mhc_split_lanes_kernel<3><<<lgrid, kMhcThreads, 0, s>>>(*p); break;
            case 4: mhc_split_lanes_kernel<4><<<lgrid, kMhcThreads, 0, s>>>(*p); break;
            default: mhc_split_lanes_kernel<5><<<lgrid, kMhcThreads, 0, s>>>(*p); break;
        }
        return static_cast<int>(cudaGetLastError());
    }
    const dim3 grid(static_cast<unsigned>((p->tokens + kMhcThreads - 1) / kMhcThreads));
    switch (p->hc) {
        case 1: mhc_split_kernel<1><<<grid, kMhcThreads, 0, s>>>(*p); break;
        case 2: mhc_split_kernel<2><<<grid, kMhcThreads, 0, s>>>(*p); break;
        case 3: mhc_split_kernel<3><<<grid, kMhcThreads, 0, s>>>(*p); break;
        case 4: mhc_split_kernel<4><<<grid, kMhcThreads, 0, s>>>(*p); break;
        case 5: mhc_split_kernel<5><<<grid, kMhcThreads, 0, s>>>(*p); break;
        case 6: mhc_split_kernel<6><<<grid, kMhcThreads, 0, s>>>(*p); break;
        case 7: mhc_split_kernel<7><<<grid, kMhcThreads, 0, s>>>(*p); break;
        default: mhc_split_kernel<8><<<grid, kMhcThreads, 0, s>>>(*p); break;
    }
    return static_cast<int>(cudaGetLastError());
}
