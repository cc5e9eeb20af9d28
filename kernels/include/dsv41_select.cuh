// Radix-selection primitives shared by the indexer's selection kernels (kernels/indexer_select.cu:
// top-k and candidate blocks of any row; kernels/indexer_topk.cu: the top-k of rows of at most
// 64K entries). Header-only, inlined.
//
// Order key of a bf16 score (dsv41_indexer.h): u = bits | 0x8000 for a clear sign bit, ~bits (16
// bits) otherwise; larger u = larger score, the total order of f32::total_cmp. Radix digits: the
// high digit u >> LO_BITS (DSV41_SELECT_HIST_BINS = 2048 bins) and the low digit u & 31.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "dsv41_indexer.h"
#include "dsv41_warp.cuh"

namespace dsv41_select {

constexpr int LO_BITS = 5;
constexpr int LO_BINS = 1 << LO_BITS;
constexpr int HI_BINS = DSV41_SELECT_HIST_BINS;
static_assert(HI_BINS << LO_BITS == 65536, "digits of a 16-bit key");

__device__ __forceinline__ uint32_t order_key(uint16_t bits) {
    return (bits & 0x8000u) ? (~static_cast<uint32_t>(bits) & 0xFFFFu) : (static_cast<uint32_t>(bits) | 0x8000u);
}

// Exclusive prefix sum over the warp's lanes; returns the exclusive value, `total` = the sum.
__device__ __forceinline__ uint32_t warp_exclusive(uint32_t v, int lane, uint32_t& total) {
    const uint32_t x = dsv41_warp::inclusive_sum(v, lane);
    total = __shfl_sync(0xFFFFFFFFu, x, 31);
    return x - v;
}

// Finds the bin b holding the `want`-th largest element of a HI_BINS-bin histogram in shared
// memory (1 <= want <= its total): count(bins > b) < want <= count(bins >= b); writes b and
// count(bins > b). Block of THREADS = HI_BINS / 4 threads, thread x owning bins HI_BINS - 1 - 4x - i
// (i = 0..3, descending), a block scan through `wsum` (THREADS / 32 words). Every thread must
// call it; the result is in *bin / *above after the caller's barrier.
template <int THREADS>
__device__ __forceinline__ void find_hi_bin(const uint32_t* hist, uint32_t want, uint32_t* wsum, uint32_t* bin,
                                            uint32_t* above) {
    static_assert(HI_BINS == 4 * THREADS, "4 bins per thread");
    constexpr int WARPS = THREADS / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint32_t cnt[4], local = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        cnt[i] = hist[HI_BINS - 1 - 4 * threadIdx.x - i];
        local += cnt[i];
    }
    uint32_t wtotal;
    uint32_t before = warp_exclusive(local, lane, wtotal);
    if (lane == 0) wsum[warp] = wtotal;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) before += w < warp ? wsum[w] : 0u;
    if (before < want && before + local >= want) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (before < want && before + cnt[i] >= want) {
                *bin = HI_BINS - 1 - 4 * threadIdx.x - i;
                *above = before;
            }
            before += cnt[i];
        }
    }
}

// find_hi_bin followed by the barrier that publishes its result: every thread gets the bin in
// `bin` and count(bins > bin) in `above` (s_bin / s_above: the shared words it goes through).
template <int THREADS>
__device__ __forceinline__ void find_hi_bin_all(const uint32_t* hist, uint32_t want, uint32_t* wsum, uint32_t* s_bin,
                                                uint32_t* s_above, uint32_t& bin, uint32_t& above) {
    find_hi_bin<THREADS>(hist, want, wsum, s_bin, s_above);
    __syncthreads();
    bin = *s_bin;
    above = *s_above;
}

// The same for the low digit (LO_BINS = 32 bins, one warp: lane l owns bin 31 - l).
__device__ __forceinline__ void find_lo_bin(const uint32_t* hist, uint32_t want, int lane, uint32_t* bin,
                                            uint32_t* above) {
    const uint32_t cnt = hist[LO_BINS - 1 - lane];
    uint32_t total;
    const uint32_t before = warp_exclusive(cnt, lane, total);
    if (before < want && before + cnt >= want) {
        *bin = LO_BINS - 1 - lane;
        *above = before;
    }
}

}  // namespace dsv41_select

// Launches kernels/indexer_topk.cu's kernel for a validated top-k launch whose rows fit it
// (N <= DSV41_TOPK_MAX_N, k <= DSV41_TOPK_MAX_K) and returns true; false (nothing launched)
// otherwise.
bool dsv41_topk_launch(const Dsv41IndexerSelectParams& p, cudaStream_t stream);
