// indexer_select: the top-k of a row of index scores, or its candidate blocks (spec §6.3 step 7,
// §6.4, §0.1b.2), with the CPU reference's rules (`attention::indexer::{top_k,
// candidate_blocks}`): descending score, ties towards the lower id, -inf entries eligible for the
// top-k (visibility alone decides -1), candidate blocks = block max with the newest visible
// entry's block pinned to +inf and only blocks > -inf kept; outputs ascending, -1 padded.
// Top-k launches whose rows fit kernels/indexer_topk.cu (N <= 64K, k <= 2048: the decode shape)
// go there (dsv41_indexer_select below); this file's kernel takes the candidate blocks, longer
// rows and larger k.
//
// Design: exact radix selection on the 16-bit order keys of the bf16 scores (u = bits | 0x8000
// for positive, ~bits for negative: larger u = larger score, total order as f32::total_cmp),
// one CTA of 512 threads per token, no sorting; digits of 11 (high) and 5 (low) bits:
//   1. a 2048-bin histogram of the high digits of the row's keys (one pass with shared
//      atomics); a block scan finds the digit b1 of the k-th largest key;
//   2. one pass: each warp walks its contiguous segment, counts the keys above digit b1, builds
//      a private 32-bin histogram of the low digits of those in b1 and an ordered list of its
//      candidates (digit >= b1); the summed low histogram gives the k-th largest key u*, the
//      count above it and `need` = how many elements equal to u* are taken (the lowest ids), and
//      each warp's counts (> u*, == u*) come from its own histogram; a scan over the warps gives
//      every warp its first output position and its first rank among the ties;
//   3. each warp walks its candidate list (or, when it overflowed, its segment again) in id
//      order with warp scans and writes the selected ids, so the output is ascending without a
//      sort; the tail is filled with -1.
// When the row has <= k elements, step 1 is skipped (b1 = 0: all are taken). Element keys are
// recomputed from the scores in every pass (the rows of one decode batch stay in L2).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "include/dsv41_indexer.h"
#include "include/dsv41_select.cuh"

namespace dsv41_sel {

using namespace dsv41_select;

constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr uint32_t NEG_INF_KEY = 0x007F;  // key of bf16 -inf (0xFF80)
constexpr uint32_t PINNED_KEY = 0xFFFF;   // above every real key (+inf is 0xFF80; 0xFFFF is a NaN)
constexpr uint32_t ABSENT = 0xFFFFFFFFu; // element past the row
constexpr uint32_t LIST = 384;           // candidate-list entries per warp

struct Row {
    const uint16_t* s;  // the token's scores
    int64_t L;          // visible entries
    int64_t n;          // elements (entries or blocks)
    int64_t pinned;     // pinned block (blocks mode), else -1
    int block;
    bool blocks;
};

// Keys of the 8 elements e0 .. e0+7 (e0 a multiple of 8); elements >= n get ABSENT.
__device__ __forceinline__ void load8(const Row& r, int64_t e0, uint32_t (&k)[8]) {
    if (!r.blocks) {
        if (e0 + 8 <= r.n) {
            const uint4 v = *reinterpret_cast<const uint4*>(r.s + e0);
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                k[2 * i] = order_key(static_cast<uint16_t>(w[i] & 0xFFFF));
                k[2 * i + 1] = order_key(static_cast<uint16_t>(w[i] >> 16));
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) k[i] = e0 + i < r.n ? order_key(r.s[e0 + i]) : ABSENT;
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int64_t b = e0 + i;
        if (b >= r.n) {
            k[i] = ABSENT;
        } else if (b == r.pinned) {
            k[i] = PINNED_KEY;
        } else {
            const int64_t j0 = b * r.block;
            const int64_t j1 = j0 + r.block < r.L ? j0 + r.block : r.L;
            uint32_t m = 0;
            for (int64_t j = j0; j < j1; ++j) {
                const uint32_t u = order_key(r.s[j]);
                m = u > m ? u : m;
            }
            k[i] = m;
        }
    }
}

// Calls f(key) for every element of the row, thread x taking the 8-element groups x, x + THREADS,
// ...; UNROLL groups are loaded before any is used (a pass over a 64K row is latency bound:
// 16 dependent L2 round trips per thread without it).
template <int UNROLL, typename F>
__device__ __forceinline__ void for_each_key(const Row& r, F f) {
    for (int64_t base = 8LL * threadIdx.x; base < r.n; base += 8LL * THREADS * UNROLL) {
        uint32_t kk[UNROLL][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t e0 = base + 8LL * THREADS * u;
            if (e0 < r.n) {
                load8(r, e0, kk[u]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) kk[u][i] = ABSENT;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (kk[u][i] != ABSENT) f(kk[u][i]);
    }
}

// U2: 256-element groups pass 2 loads before using any. BLK: blocks mode (p.mode == DSV41_SELECT_BLOCKS), a template parameter so that the top-k
// instance carries no block-maximum code (64 registers: 2 CTAs of 512 threads per SM).
template <bool BLK, int U2>
__global__ void __launch_bounds__(THREADS, 2) indexer_select_kernel(const Dsv41IndexerSelectParams p) {
    __shared__ __align__(16) uint32_t hist[HI_BINS];  // high-digit histogram of pass 1
    __shared__ uint32_t whist[WARPS][LO_BINS];  // per-warp low-digit histograms of pass 2
    __shared__ uint32_t clist[WARPS][LIST];     // per-warp candidates: (offset in segment) << 16 | key
    __shared__ uint32_t warp_gt[WARPS], warp_eq[WARPS], warp_out[WARPS], warp_rank[WARPS], wsum[WARPS];
    __shared__ uint32_t s_bin, s_above, s_total;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = blockIdx.x;
    const int64_t N = p.num_cols;
    int64_t L = p.visible ? static_cast<int64_t>(p.visible[t]) : (p.start + t + 1) / p.ratio;
    L = L < N ? L : N;
    Row r;
    r.s = reinterpret_cast<const uint16_t*>(p.scores) + t * p.score_row_stride;
    r.L = L;
    r.blocks = BLK;
    r.block = p.block;
    r.n = r.blocks ? (L + p.block - 1) / p.block : L;
    r.pinned = r.blocks && L >= 1 ? (L - 1) / p.block : -1;
    const uint32_t k = static_cast<uint32_t>(p.k);
    int64_t* out = p.out + t * p.out_row_stride;
    const bool big = r.n > static_cast<int64_t>(k);

    // Pass 1 (only when the row has more than k elements): the high digit b1 of the k-th
    // largest key, from a pass over the row.
    uint32_t b1 = 0, above1 = 0;
    if (big) {
        for (int i = threadIdx.x; i < HI_BINS; i += THREADS) hist[i] = 0;
        __syncthreads();
        for_each_key<2>(r, [&](uint32_t u) { atomicAdd(&hist[u >> LO_BITS], 1u); });
        __syncthreads();
        find_hi_bin_all<THREADS>(hist, k, wsum, &s_bin, &s_above, b1, above1);
    }

    // Pass 2: each warp walks its contiguous segment (a multiple of 256 elements) once: counts
    // the keys whose high digit is above b1, a private histogram of the low digits of those in
    // bin b1, and an ordered list of the candidates (high digit >= b1: every selected key is
    // one), so that pass 3 need not read the row again unless a list overflows. (Short rows:
    // b1 = 0.)
    const int64_t seg = ((r.n + WARPS - 1) / WARPS + 255) / 256 * 256;
    const int64_t w0 = warp * seg, w1 = (w0 + seg < r.n ? w0 + seg : r.n);
    uint32_t* wh = whist[warp];
    wh[lane] = 0;
    __syncwarp();
    const bool lists = seg <= 65536;  // offsets in 16 bits
    uint32_t gt_hi = 0, n_list = 0;
    for (int64_t base = w0; base < w1; base += U2 * 256) {
        // Score rows: U2 raw 16-byte groups in flight (4 registers each); the keys are made at use.
        uint4 raw[U2];
#pragma unroll
        for (int u = 0; u < U2; ++u) {
            const int64_t e0 = base + 256 * u + 8 * lane;
            if (!r.blocks && e0 + 8 <= w1) raw[u] = *reinterpret_cast<const uint4*>(r.s + e0);
        }
#pragma unroll
        for (int u = 0; u < U2; ++u) {
            const int64_t e0 = base + 256 * u + 8 * lane;
            uint32_t kk[8];
            if (!r.blocks && e0 + 8 <= w1) {
                const uint32_t wd[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    kk[2 * i] = order_key(static_cast<uint16_t>(wd[i] & 0xFFFF));
                    kk[2 * i + 1] = order_key(static_cast<uint16_t>(wd[i] >> 16));
                }
            } else if (e0 < w1) {
                load8(r, e0, kk);  // w1 is r.n or a multiple of 256: no element past it
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) kk[i] = ABSENT;
            }
            uint32_t cm = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const uint32_t key = kk[i];
                if (key == ABSENT) continue;
                const uint32_t hi = key >> LO_BITS;
                gt_hi += hi > b1;
                if (hi == b1) atomicAdd(&wh[key & (LO_BINS - 1)], 1u);
                cm |= static_cast<uint32_t>(hi >= b1) << i;
            }
            if (lists && __any_sync(0xFFFFFFFFu, cm != 0)) {
                uint32_t total;
                uint32_t at = n_list + warp_exclusive(__popc(cm), lane, total);
                if (n_list + total <= LIST) {
                    const uint32_t off0 = static_cast<uint32_t>(e0 - w0);
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                        if ((cm >> i) & 1u) clist[warp][at++] = ((off0 + i) << 16) | kk[i];
                }
                n_list += total;
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) gt_hi += __shfl_xor_sync(0xFFFFFFFFu, gt_hi, o);
    __syncthreads();
    // Threshold: select key > thr, and the first `need` (in id order) of key == thr.
    uint32_t thr = 0, need = 0xFFFFFFFFu;
    if (big) {
        // The row's low-digit histogram of bin b1 = the sum of the warps'.
        if (threadIdx.x < LO_BINS) {
            uint32_t sum = 0;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) sum += whist[w][threadIdx.x];
            hist[threadIdx.x] = sum;
        }
        __syncthreads();
        if (warp == 0) find_lo_bin(hist, k - above1, lane, &s_bin, &s_above);
        __syncthreads();
        thr = (b1 << LO_BITS) | s_bin;
        need = k - above1 - s_above;
    }
    // Blocks: keep only blocks > -inf. If that moves thr out of digit b1 (only -inf / NaN keys
    // are <= NEG_INF_KEY), the warps' counts are redone by a walk.
    bool recount = false;
    if (r.blocks && thr <= NEG_INF_KEY) {
        recount = (NEG_INF_KEY >> LO_BITS) != b1;
        thr = NEG_INF_KEY;
        need = 0;
    }
    if (recount) {
        uint32_t gt = 0;
        for (int64_t e0 = w0 + 8 * lane; e0 < w1; e0 += 256) {
            uint32_t kk[8];
            load8(r, e0, kk);
#pragma unroll
            for (int i = 0; i < 8; ++i) gt += kk[i] != ABSENT && kk[i] > thr;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) gt += __shfl_xor_sync(0xFFFFFFFFu, gt, o);
        if (lane == 0) {
            warp_gt[warp] = gt;
            warp_eq[warp] = 0;
        }
    } else {
        // The warp's counts (> thr, == thr) from its histogram: thr's high digit is b1.
        const uint32_t lo = thr & (LO_BINS - 1);
        const uint32_t v = wh[lane];
        uint32_t gt = static_cast<uint32_t>(lane) > lo ? v : 0u;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) gt += __shfl_xor_sync(0xFFFFFFFFu, gt, o);
        const uint32_t eq = __shfl_sync(0xFFFFFFFFu, v, lo);
        if (lane == 0) {
            warp_gt[warp] = gt_hi + gt;
            warp_eq[warp] = eq;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t pos = 0, rank = 0;
        for (int w = 0; w < WARPS; ++w) {
            warp_out[w] = pos;
            warp_rank[w] = rank;
            const uint32_t take_eq = need > rank ? (need - rank < warp_eq[w] ? need - rank : warp_eq[w]) : 0;
            pos += warp_gt[w] + take_eq;
            rank += warp_eq[w];
        }
        s_total = pos;
    }
    __syncthreads();

    // Pass 3: ordered compaction of the warp's selected ids.
    uint32_t pos = warp_out[warp], rank = warp_rank[warp];
    if (lists && n_list <= LIST && !recount) {
        // From the candidate list (in id order), 32 at a time.
        for (uint32_t c0 = 0; c0 < n_list; c0 += 32) {
            const uint32_t ci = c0 + lane;
            const uint32_t e = ci < n_list ? clist[warp][ci] : 0u;
            const uint32_t key = e & 0xFFFF;
            const bool in = ci < n_list;
            const uint32_t eqb = __ballot_sync(0xFFFFFFFFu, in && key == thr);
            const uint32_t below = (1u << lane) - 1u;
            const bool sel = in && (key > thr || (key == thr && rank + __popc(eqb & below) < need));
            const uint32_t selb = __ballot_sync(0xFFFFFFFFu, sel);
            if (sel) out[pos + __popc(selb & below)] = w0 + (e >> 16);
            pos += __popc(selb);
            rank += __popc(eqb);
        }
    } else {
        for (int64_t base = w0; base < w1; base += 256) {
            const int64_t e0 = base + 8 * lane;
            uint32_t kk[8];
            if (e0 < w1) {
                load8(r, e0, kk);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) kk[i] = ABSENT;
            }
            uint32_t eqm = 0, gtm = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (kk[i] == ABSENT) continue;
                gtm |= static_cast<uint32_t>(kk[i] > thr) << i;
                eqm |= static_cast<uint32_t>(kk[i] == thr) << i;
            }
            uint32_t eq_total;
            const uint32_t eq_before = rank + warp_exclusive(__popc(eqm), lane, eq_total);
            // Selected: all of gtm, and the eq elements whose rank among ties is < need.
            uint32_t selm = gtm, er = eq_before;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if ((eqm >> i) & 1u) {
                    if (er < need) selm |= 1u << i;
                    ++er;
                }
            }
            uint32_t sel_total;
            uint32_t at = pos + warp_exclusive(__popc(selm), lane, sel_total);
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if ((selm >> i) & 1u) out[at++] = e0 + i;
            pos += sel_total;
            rank += eq_total;
        }
    }
    __syncthreads();
    for (int64_t i = s_total + threadIdx.x; i < p.k; i += THREADS) out[i] = -1;
}

bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; }

}  // namespace dsv41_sel

extern "C" int dsv41_indexer_select(const Dsv41IndexerSelectParams* p, size_t params_size, void* stream) {
    using namespace dsv41_sel;
    if (params_size != sizeof(Dsv41IndexerSelectParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_tokens < 0 || p->num_cols < 0 || p->k < 1 || p->score_row_stride < p->num_cols ||
        p->score_row_stride % 8 || p->out_row_stride < p->k || p->start < 0 || (!p->visible && p->ratio < 1) ||
        (p->mode != DSV41_SELECT_TOPK && p->mode != DSV41_SELECT_BLOCKS) ||
        (p->mode == DSV41_SELECT_BLOCKS && p->block < 1))
        return DSV41_ERR_SHAPE;
    if (p->num_tokens == 0) return DSV41_OK;
    if (!p->out || (p->num_cols > 0 && !p->scores)) return DSV41_ERR_NULL;
    if (p->num_cols > 0 && !aligned16(p->scores)) return DSV41_ERR_ALIGNMENT;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    // Top-k of rows of at most 64K entries: kernels/indexer_topk.cu.
    if (dsv41_topk_launch(*p, s)) return static_cast<int>(cudaGetLastError());
    if (p->mode == DSV41_SELECT_BLOCKS)
        indexer_select_kernel<true, 1><<<p->num_tokens, THREADS, 0, s>>>(*p);
    else
        indexer_select_kernel<false, 2><<<p->num_tokens, THREADS, 0, s>>>(*p);
    return static_cast<int>(cudaGetLastError());
}
