// mhc_mixes: one mHC sublayer's coefficients (spec §3.2 steps 1–8) in one launch — the raw mixes
// m[t, w] = (Σ_k x[t, k]·fn[w, k]) · rsqrt(Σ_k x[t, k]² / n + norm_eps) over the n = hc·D
// elements of a token's stream, then the pre / post / comb split of kernels/mhc_sinkhorn.cu.
//
// Why a kernel: the op sequence (rms_scale's f32 copy of x, a cuBLAS f32 product of a few rows
// by the (2+hc)·hc × n weight — two or three kernels —, the rsqrt multiply, the split) is five to
// six launches and as many allocations per sublayer; a decode step of a small model is bound by
// its launch count (docs/perf.md). Here: one launch, x read once as bf16, no f32 copy.
//
// Design: a CTA of 256 threads takes a tile of TT tokens (TT = 1 for one token, else 4) and a
// range of n; thread i sums elements k ≡ i (mod 256) of its range, for every token of the tile,
// into (2+hc)·hc dot products and a sum of squares (FMA chains in k order). fn is read once per
// tile (L2-resident after the first tile). The 32 lanes of a warp combine by an xor butterfly
// (16 … 1), the 8 warps through shared memory in warp order. Wide rows (n > 2048, V4.1-Flash's
// 16384) split n over a cluster of `splits` CTAs (grid.y), whose partial sums CTA rank 0 adds in
// rank order from the others' shared memory (distributed shared memory), so one token's fn
// stream is spread over up to 8 SMs. Then the tile's tokens are split by the lanes layout
// (include/dsv41_mhc_split.cuh) in the first warps of rank 0.
//
// Numerics: the split is bit for bit kernels/mhc_sinkhorn.cu; the raw mixes are f32 sums in this
// kernel's own order (not cuBLAS's, not the CPU's: within the golden README's tolerance of the CPU
// reference, tests/cuda_decoder_ops.rs). A token's result depends on n only — not on the number
// of tokens, the tile or the token's place in the batch: the same token gives the same bits in a
// decode step of any batch size and in a prefill.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "include/dsv41_float_io.cuh"
#include "include/dsv41_hopper.cuh"
#include "include/dsv41_launch.cuh"
#include "include/dsv41_mhc.h"
#include "include/dsv41_mhc_split.cuh"

namespace dsv41 {

constexpr int kMixThreads = 256;
constexpr int kMixWarps = kMixThreads / 32;
// Elements of n per CTA of a cluster before the row is split further.
constexpr int kMixSplitElems = 2048;

template <typename T, int HC, int TT>
__global__ void __launch_bounds__(kMixThreads) mhc_mixes_kernel(Dsv41MhcMixesParams p) {
    constexpr int W = (2 + HC) * HC;
    constexpr int V = W + 1;  // the dot products and the sum of squares
    __shared__ float part[kMixWarps][TT * V];
    __shared__ float mixes[TT][W];
    dsv41_ptx::grid_dep_wait();
    const int64_t t0 = static_cast<int64_t>(blockIdx.x) * TT;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int chunk = (p.n + p.splits - 1) / p.splits;
    const int k0 = static_cast<int>(blockIdx.y) * chunk;
    const int k1 = min(p.n, k0 + chunk);
    const T* x = static_cast<const T*>(p.x);

    float acc[TT][V];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int v = 0; v < V; ++v) acc[tt][v] = 0.0f;
    for (int k = k0 + threadIdx.x; k < k1; k += kMixThreads) {
        float xv[TT];
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            xv[tt] = t0 + tt < p.tokens ? load_f32(x, (t0 + tt) * p.n + k) : 0.0f;
            acc[tt][W] = __fmaf_rn(xv[tt], xv[tt], acc[tt][W]);
        }
#pragma unroll
        for (int w = 0; w < W; ++w) {
            const float f = __ldg(p.fn + static_cast<int64_t>(w) * p.n + k);
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) acc[tt][w] = __fmaf_rn(xv[tt], f, acc[tt][w]);
        }
    }
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int v = 0; v < V; ++v) {
            float s = acc[tt][v];
#pragma unroll
            for (int mask = 16; mask > 0; mask >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, mask));
            if (lane == 0) part[warp][tt * V + v] = s;
        }
    __syncthreads();
    // part[0][i] = the CTA's sum over its warps in order (thread i reads only column i).
    if (threadIdx.x < TT * V) {
        float s = part[0][threadIdx.x];
#pragma unroll
        for (int w = 1; w < kMixWarps; ++w) s = __fadd_rn(s, part[w][threadIdx.x]);
        part[0][threadIdx.x] = s;
    }
    if (p.splits > 1) {
        namespace cg = cooperative_groups;
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();
        const bool lead = cluster.block_rank() == 0;
        if (lead && threadIdx.x < TT * V) {
            float s = part[0][threadIdx.x];
            for (int r = 1; r < p.splits; ++r) s = __fadd_rn(s, *cluster.map_shared_rank(&part[0][threadIdx.x], r));
            part[0][threadIdx.x] = s;
        }
        cluster.sync();  // the other CTAs' shared memory stays until rank 0 has read it
        if (!lead) return;
    }
    __syncthreads();
    if (threadIdx.x < TT * W) {
        const int tt = threadIdx.x / W, w = threadIdx.x % W;
        const float mean = __fdiv_rn(part[0][tt * V + W], static_cast<float>(p.n));
        const float rs = __fdiv_rn(1.0f, sqrtf(__fadd_rn(mean, p.norm_eps)));
        mixes[tt][w] = __fmul_rn(part[0][tt * V + w], rs);
    }
    __syncthreads();
    constexpr int P = mhc_split_lanes<HC>();
    constexpr int kSplitThreads = (TT * P + 31) / 32 * 32;
    static_assert(kSplitThreads <= kMixThreads, "the split's warps fit the CTA");
    if (threadIdx.x < kSplitThreads) {
        const int tt = threadIdx.x / P, e = threadIdx.x % P;
        const bool live = tt < TT && t0 + tt < p.tokens;
        const int64_t t = live ? t0 + tt : 0;
        mhc_split_token_lanes<HC>(mixes[live ? tt : 0], live, e, lane - e, p.scale, p.base, p.eps, p.iters, p.pre + t * HC,
                                  p.post + t * HC, p.comb + t * HC * HC);
    }
}

template <typename T, int HC, int TT>
cudaError_t launch_mixes(const Dsv41MhcMixesParams& p, cudaStream_t s) {
    const dim3 grid(static_cast<unsigned>((p.tokens + TT - 1) / TT), static_cast<unsigned>(p.splits));
    return dsv41_launch::launch_pdl(mhc_mixes_kernel<T, HC, TT>, grid, dim3(kMixThreads), 0, s, p.splits, p);
}

template <typename T, int HC>
cudaError_t launch_tile(const Dsv41MhcMixesParams& p, cudaStream_t s) {
    return p.tokens == 1 ? launch_mixes<T, HC, 1>(p, s) : launch_mixes<T, HC, 4>(p, s);
}

template <typename T>
cudaError_t launch_hc(const Dsv41MhcMixesParams& p, cudaStream_t s) {
    switch (p.hc) {
        case 1: return launch_tile<T, 1>(p, s);
        case 2: return launch_tile<T, 2>(p, s);
        case 3: return launch_tile<T, 3>(p, s);
        default: return launch_tile<T, 4>(p, s);
    }
}

}  // namespace dsv41

extern "C" int dsv41_mhc_mixes(const Dsv41MhcMixesParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41MhcMixesParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->tokens < 0 || p->n < 1 || p->hc < 1 || p->hc > DSV41_MHC_MIXES_MAX_HC || p->iters < 1 || p->x_f32 < 0 ||
        p->x_f32 > 1 || p->splits < 0 || p->splits > DSV41_MHC_MIXES_MAX_SPLITS || p->splits > p->n)
        return DSV41_ERR_SHAPE;
    if ((p->tokens + 3) / 4 >= (int64_t{1} << 31) || p->tokens > INT64_MAX / p->n) return DSV41_ERR_SHAPE;
    if (p->tokens == 0) return DSV41_OK;
    if (!p->x || !p->fn || !p->scale || !p->base || !p->pre || !p->post || !p->comb) return DSV41_ERR_NULL;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    Dsv41MhcMixesParams q = *p;
    if (q.splits == 0) {
        const int64_t auto_splits = (static_cast<int64_t>(q.n) + kMixSplitElems - 1) / kMixSplitElems;
        q.splits = static_cast<int32_t>(auto_splits > DSV41_MHC_MIXES_MAX_SPLITS ? DSV41_MHC_MIXES_MAX_SPLITS : auto_splits);
    }
    const cudaError_t e = q.x_f32 ? launch_hc<float>(q, s) : launch_hc<__nv_bfloat16>(q, s);
    return static_cast<int>(e);
}
