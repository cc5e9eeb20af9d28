// indexer_topk: the top-k of index-score rows of at most 64K entries (spec §6.3 step 7,
// §0.1b.2; the decode shape: 64K packed keys per sequence at 128K context), with the CPU
// reference's rules (`attention::indexer::top_k`): descending score, ties towards the lower id,
// -inf entries eligible (visibility alone decides), output ascending, -1 padded. Launched by
// dsv41_indexer_select (kernels/indexer_select.cu) for top-k launches with N <= TOPK_MAX_N and
// k <= TOPK_MAX_K; longer rows, larger k and candidate blocks take indexer_select_kernel.
//
// Design: one CTA of 512 threads per row, one read of the row in the common case. Keys are the
// 16-bit order keys of dsv41_select.cuh (high digit: 11 bits, low digit: 5 bits).
//   0. A threshold key tau <= the k-th largest key, from a sample of 512 groups of 8 entries
//      spread over the row (the whole row when it has <= 4096 entries: then exact, tau = b1 << 5,
//      b1 the digit of the k-th largest key): the sample's R-th largest
//      key (digit by a block scan, low digit by a warp scan), R = 2 k S / n + 16 (S = sampled
//      entries: twice the expected count of the top k in the sample plus a margin, so that a
//      row with fewer than k keys >= tau is a >10-sigma event for unstructured rows; such rows
//      are still exact, see the fallback).
//   1. One pass over the row in batches of U = 4 8-entry groups per thread (16-byte loads; the
//      first batch issued before step 0, each next one before the current batch's candidates
//      are written: up to 2U loads in flight): one bf16x2 compare "x >= f(tau) or unordered" per word (exact up
//      to -0 and NaN false positives, removed later; order-key compares when f(tau) is a NaN)
//      gives each lane its candidates, and the warp appends them (bf16 bits << 16 | id) to a
//      shared list after a warp scan and one shared atomic per batch of U groups.
//   2. A walk of the list drops the false positives and builds the low-digit histogram of the
//      keys in digit b1 (exact tau) or the candidates' high-digit histogram (sampled tau: exact
//      for the keys >= tau, so a block scan gives b1 and the count above it, then a second walk
//      the low digits in b1). Then u* (the k-th largest key) and `need` (how many keys equal to
//      u* are taken: the lowest ids).
//   3. The list's keys > u* and == u* set bits in two bitmaps of the row (64K bits each), and
//      each thread emits the ids of 4 words after a block scan of the words' counts: the output
//      is ascending without a sort, and the ties are ranked by id.
//   Fallback, exact for any row: when the list overflows (e.g. rows of equal scores) or the
//   sampled tau was too high (fewer than k keys >= tau), the digits come from full passes over
//   the row (a 2048-bin histogram with shared atomics unless tau was exact; the low digits in b1)
//   and the bitmaps from a third pass, one 32-entry word per thread step.
// Rows with <= k visible entries take all of them (ids 0..L-1) without reading the scores.
// Launch: without programmatic dependent launch, but each CTA lets the grid's dependents launch
// (griddepcontrol.launch_dependents) once its selection is done, before it writes its list: in a
// decode step the sparse attention follows and its launch overlaps this grid's end; it waits in
// griddepcontrol.wait for this grid's output (chain contract in kernels/sparse_attention.cu).
// Measured on the H200: this late trigger gives the attention's in-stream share B = 1 / 64 / 256
// 21.1 / 22.9-23.2 / 80.4-80.5 us against 22.4 / 23.7-24.0 / 81.5 with the trigger at the kernel's
// start (and the dims-split pair launched without PDL), and lets the dims-split pair keep its own
// programmatic dependent launch (behind the early trigger its early-launched clusters cost ~5 us).
// (The measurement's DSV41_TOPK_TRIGGER switch between the two placements is gone.)
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "include/dsv41_indexer.h"
#include "include/dsv41_select.cuh"

namespace dsv41_topk {

using namespace dsv41_select;

constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr int MAX_N = DSV41_TOPK_MAX_N;  // entries per row: ids in 16 bits, bitmaps of MAX_N bits
constexpr int WORDS = MAX_N / 32;
constexpr int CAP = 4096;                // candidate-list entries
constexpr int SAMPLE_GROUPS = THREADS;   // 8-entry groups sampled for the threshold
constexpr int U = 4;                     // 8-entry groups per thread and batch of the main pass
static_assert(WORDS == 4 * THREADS, "4 bitmap words per thread");
static_assert(DSV41_TOPK_MAX_K <= CAP, "k candidates fit the list");

// The order keys of the two bf16 halves of a word, as the halves of a word.
__device__ __forceinline__ uint32_t keys2(uint32_t w) {
    const uint32_t neg = (w >> 15) & 0x00010001u;
    return w ^ (neg * 0x7FFFu + 0x80008000u);
}

// Group g (entries 8g .. 8g+7) of a row of n entries; entries past the row read as 0xFFFF (key 0).
__device__ __forceinline__ uint4 load_group(const uint16_t* s, int64_t n, int64_t g) {
    const int64_t e0 = 8 * g;
    if (e0 + 8 <= n) return *reinterpret_cast<const uint4*>(s + e0);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t lo = e0 + 2 * i < n ? s[e0 + 2 * i] : 0xFFFFu;
        const uint32_t hi = e0 + 2 * i + 1 < n ? s[e0 + 2 * i + 1] : 0xFFFFu;
        w[i] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void group_keys(const uint4 v, uint32_t (&k)[4]) {
    k[0] = keys2(v.x);
    k[1] = keys2(v.y);
    k[2] = keys2(v.z);
    k[3] = keys2(v.w);
}

__device__ __forceinline__ uint32_t key_at(const uint32_t (&k)[4], int i) { return (k[i / 2] >> (16 * (i & 1))) & 0xFFFFu; }

// Mask of the group's entries inside the row.
__device__ __forceinline__ uint32_t valid_mask(int64_t n, int64_t g) {
    const int64_t left = n - 8 * g;
    return left >= 8 ? 0xFFu : (left <= 0 ? 0u : (1u << left) - 1u);
}

// Exclusive block prefix sums of a and c (every thread calls; wa / wc: WARPS words each, not
// reused before the caller's next barrier).
__device__ __forceinline__ void block_exclusive2(uint32_t a, uint32_t c, uint32_t* wa, uint32_t* wc, uint32_t& ea,
                                                 uint32_t& ec) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t xa = dsv41_warp::inclusive_sum(a, lane), xc = dsv41_warp::inclusive_sum(c, lane);
    if (lane == 31) {
        wa[warp] = xa;
        wc[warp] = xc;
    }
    __syncthreads();
    uint32_t pa = 0, pc = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        pa += w < warp ? wa[w] : 0u;
        pc += w < warp ? wc[w] : 0u;
    }
    ea = pa + xa - a;
    ec = pc + xc - c;
}

// Mask (0xFFFF per 16-bit half) of the halves of a word of two bf16 scores whose order key is
// >= tau. FLOAT: one bf16x2 compare "x >= f or unordered" against f = tau's bf16 (tau_bits2: its
// bits in both halves; tau must be a number): exact for numbers except -0 when f = +0, and true
// for every NaN, so the true keys >= tau are all included and the false positives (-0, negative
// NaNs) are removed by the caller. Else: order-key compares.
template <bool FLOAT>
__device__ __forceinline__ uint32_t ge_mask(uint32_t w, uint32_t tau, uint32_t tau_bits2) {
    if (FLOAT) {
        uint32_t d;
        asm("set.geu.u32.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(w), "r"(tau_bits2));
        return d;
    }
    const uint32_t kw = keys2(w);
    return ((kw & 0xFFFFu) >= tau ? 0x0000FFFFu : 0u) | ((kw >> 16) >= tau ? 0xFFFF0000u : 0u);
}

// Entries of a group as mask bits: entry 2j + h (word j, half h) is bit j + 16 h.
__device__ __forceinline__ uint32_t group_bits(int64_t n, int64_t g) {
    const int64_t left = n - 8 * g;
    if (left >= 8) return 0x000F000Fu;
    uint32_t v = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) v |= e < left ? 1u << ((e >> 1) + 16 * (e & 1)) : 0u;
    return v;
}

// Step 1 of the kernel: appends (bf16 bits << 16 | id) of every entry whose key is >= tau (and
// the compare's false positives) to `cand` (*count = all; only valid when <= CAP). raw: the
// thread's first U groups (x + THREADS u), loaded by the caller. Warp-aggregated: one shared
// atomic per warp and batch of U groups.
template <bool FLOAT>
__device__ __forceinline__ void collect(const uint16_t* s, int n, int G, uint4 (&raw)[U], uint32_t tau, uint32_t tau_bits2,
                                        uint32_t* cand, uint32_t* count) {
    const int x = threadIdx.x, lane = x % 32;
    for (int g0 = 0; g0 < G; g0 += THREADS * U) {
        uint32_t bits[U], c = 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int g = g0 + x + THREADS * u;
            const uint32_t m0 = ge_mask<FLOAT>(raw[u].x, tau, tau_bits2), m1 = ge_mask<FLOAT>(raw[u].y, tau, tau_bits2);
            const uint32_t m2 = ge_mask<FLOAT>(raw[u].z, tau, tau_bits2), m3 = ge_mask<FLOAT>(raw[u].w, tau, tau_bits2);
            uint32_t v = (m0 & 0x00010001u) | (m1 & 0x00020002u) | (m2 & 0x00040004u) | (m3 & 0x00080008u);
            if (8 * g + 8 > n) v &= g < G ? group_bits(n, g) : 0u;
            bits[u] = v;
            c += __popc(v);
        }
        // The next groups are loaded before this batch's candidates are written.
        const int gn = g0 + THREADS * U;
        uint4 nxt[U];
        if (gn < G) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int g = gn + x + THREADS * u;
                nxt[u] = g < G ? load_group(s, n, g) : raw[u];
            }
        }
        if (__any_sync(0xFFFFFFFFu, c != 0)) {
            uint32_t total;
            uint32_t at = warp_exclusive(c, lane, total);
            uint32_t base = 0;
            if (lane == 0) base = atomicAdd(count, total);
            at += __shfl_sync(0xFFFFFFFFu, base, 0);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t g = g0 + x + THREADS * u;
                for (uint32_t v = bits[u]; v; v &= v - 1) {
                    const uint32_t bit = __ffs(v) - 1, j = bit & 15u, h = bit >> 4;
                    const uint32_t w01 = (j & 1u) ? raw[u].y : raw[u].x, w23 = (j & 1u) ? raw[u].w : raw[u].z;
                    const uint32_t bf = h ? ((j & 2u) ? w23 : w01) >> 16 : ((j & 2u) ? w23 : w01) & 0xFFFFu;
                    // Past CAP the list wraps: it is then not used (fallback).
                    cand[at & (CAP - 1)] = (bf << 16) | (8 * g + 2 * j + h);
                    ++at;
                }
            }
        }
        if (gn < G) {
#pragma unroll
            for (int u = 0; u < U; ++u) raw[u] = nxt[u];
        }
    }
}

__global__ void __launch_bounds__(THREADS, 2) indexer_topk_kernel(const Dsv41IndexerSelectParams p) {
    __shared__ __align__(16) uint32_t hist[HI_BINS];  // sampled / candidates' high digits
    __shared__ __align__(16) uint32_t gbits[WORDS];   // entries with key > u*
    __shared__ __align__(16) uint32_t ebits[WORDS];   // entries with key == u*
    __shared__ uint32_t cand[CAP];                    // bf16 bits << 16 | id
    __shared__ uint32_t lohist[LO_BINS], slo[LO_BINS];
    __shared__ uint32_t wsum[WARPS], wsum2[WARPS];
    __shared__ uint32_t s_bin, s_above, s_lo, s_lo_above, s_n, s_bad;
    const int x = threadIdx.x;
    const int64_t t = blockIdx.x;
    int64_t n = p.visible ? static_cast<int64_t>(p.visible[t]) : (p.start + t + 1) / p.ratio;
    n = n < p.num_cols ? n : p.num_cols;
    const uint32_t k = static_cast<uint32_t>(p.k);
    int64_t* out = p.out + t * p.out_row_stride;
    if (n <= static_cast<int64_t>(k)) {
        for (int64_t i = x; i < k; i += THREADS) out[i] = i < n ? i : -1;
        return;
    }
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p.scores) + t * p.score_row_stride;
    const int64_t G = (n + 7) / 8;

    reinterpret_cast<uint4*>(gbits)[x] = make_uint4(0, 0, 0, 0);
    reinterpret_cast<uint4*>(ebits)[x] = make_uint4(0, 0, 0, 0);
    if (x < LO_BINS) lohist[x] = 0;
    if (x == 0) {
        s_n = 0;
        s_bad = 0;
    }
    // The main pass's first groups, in flight during step 0.
    uint4 raw[U] = {};
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int64_t g = x + static_cast<int64_t>(THREADS) * u;
        if (g < G) raw[u] = load_group(s, n, g);
    }

    // Step 0: the threshold digit b; exact: b is b1 (the k-th largest key's digit).
    uint32_t b1 = 0, above1 = 0;
    const bool exact = G <= SAMPLE_GROUPS;
    reinterpret_cast<uint4*>(hist)[x] = make_uint4(0, 0, 0, 0);
    __syncthreads();
    {
        const int64_t g = exact ? x : x * G / SAMPLE_GROUPS;
        uint32_t kk[4] = {0, 0, 0, 0}, m = 0;
        if (g < G) {
            group_keys(load_group(s, n, g), kk);
            m = valid_mask(n, g);
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if ((m >> i) & 1u) atomicAdd(&hist[key_at(kk, i) >> LO_BITS], 1u);
        }
        if (x < LO_BINS) slo[x] = 0;
        __syncthreads();
        // Sampled entries: all n, or SAMPLE_GROUPS full groups (x * G / 512 < G - 1 for G > 512).
        const uint64_t sampled = exact ? static_cast<uint64_t>(n) : 8ull * SAMPLE_GROUPS;
        const uint64_t r = 2ull * k * sampled / static_cast<uint64_t>(n) + 16;
        const uint32_t want = exact ? k : static_cast<uint32_t>(r < sampled ? r : sampled);
        find_hi_bin<THREADS>(hist, want, wsum, &s_bin, &s_above);
        __syncthreads();
        if (!exact) {
            // The sample's want-th largest key itself: its low digit among the sample's keys in
            // digit s_bin.
            const uint32_t sb = s_bin;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (((m >> i) & 1u) && (key_at(kk, i) >> LO_BITS) == sb) atomicAdd(&slo[key_at(kk, i) & (LO_BINS - 1)], 1u);
            __syncthreads();
            if (x < 32) find_lo_bin(slo, want - s_above, x, &s_lo, &s_lo_above);
        }
    }
    __syncthreads();
    const uint32_t b = s_bin;
    // Candidates: keys >= tau (exact: tau = b1 << 5; sampled: the sample's want-th largest key).
    const uint32_t tau = exact ? b << LO_BITS : (b << LO_BITS) | s_lo;
    if (exact) {
        b1 = b;
        above1 = s_above;
    } else {
        // hist now collects the candidates' high digits.
        reinterpret_cast<uint4*>(hist)[x] = make_uint4(0, 0, 0, 0);
        __syncthreads();
    }

    // Step 1: the candidates.
    const uint32_t tau_bits = tau >= 0x8000u ? (tau & 0x7FFFu) : (~tau & 0xFFFFu);
    if (tau >= 0x007Fu && tau <= 0xFF80u)  // tau is a number: bf16 compares
        collect<true>(s, static_cast<int>(n), static_cast<int>(G), raw, tau, tau_bits * 0x00010001u, cand, &s_n);
    else  // tau's bf16 is a NaN: order-key compares
        collect<false>(s, static_cast<int>(n), static_cast<int>(G), raw, tau, 0u, cand, &s_n);
    __syncthreads();
    const uint32_t nc = s_n;
    // Uniform over the CTA: the list overflowed, or (below) the sampled b was above b1: fewer
    // than k keys >= tau (the list's false positives, keys < tau, do not count).
    bool fallback = nc > CAP;

    // Step 2: b1 (sampled b), the low digits in b1.
    if (!fallback) {
        // One walk of the list: false positives; the candidates' high digits (sampled tau: exact
        // for the keys >= tau, which hold the k largest) or the low digits in b1.
        for (uint32_t i = x; i < nc; i += THREADS) {
            const uint32_t key = order_key(static_cast<uint16_t>(cand[i] >> 16));
            if (key < tau)
                atomicAdd(&s_bad, 1u);
            else if (!exact)
                atomicAdd(&hist[key >> LO_BITS], 1u);
            else if ((key >> LO_BITS) == b1)
                atomicAdd(&lohist[key & (LO_BINS - 1)], 1u);
        }
        __syncthreads();
        fallback = nc - s_bad < k;
        if (!fallback && !exact) {
            find_hi_bin_all<THREADS>(hist, k, wsum, &s_bin, &s_above, b1, above1);
            for (uint32_t i = x; i < nc; i += THREADS) {
                const uint32_t key = order_key(static_cast<uint16_t>(cand[i] >> 16));
                if (key >= tau && (key >> LO_BITS) == b1) atomicAdd(&lohist[key & (LO_BINS - 1)], 1u);
            }
        }
    }
    if (fallback) {
        if (!exact) {
            // The row's whole high-digit histogram.
            reinterpret_cast<uint4*>(hist)[x] = make_uint4(0, 0, 0, 0);
            __syncthreads();
            for (int64_t g = x; g < G; g += THREADS) {
                uint32_t kk[4];
                group_keys(load_group(s, n, g), kk);
                const uint32_t m = valid_mask(n, g);
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    if ((m >> i) & 1u) atomicAdd(&hist[key_at(kk, i) >> LO_BITS], 1u);
            }
            __syncthreads();
            find_hi_bin_all<THREADS>(hist, k, wsum, &s_bin, &s_above, b1, above1);
        }
        for (int64_t g = x; g < G; g += THREADS) {
            uint32_t kk[4];
            group_keys(load_group(s, n, g), kk);
            const uint32_t m = valid_mask(n, g);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const uint32_t key = key_at(kk, i);
                if (((m >> i) & 1u) && (key >> LO_BITS) == b1) atomicAdd(&lohist[key & (LO_BINS - 1)], 1u);
            }
        }
    }
    __syncthreads();
    if (x < 32) find_lo_bin(lohist, k - above1, x, &s_lo, &s_lo_above);
    __syncthreads();
    const uint32_t thr = (b1 << LO_BITS) | s_lo;
    const uint32_t need = k - above1 - s_lo_above;  // keys == thr taken, the lowest ids

    // Step 3: bitmaps of the keys > thr and == thr.
    if (!fallback) {
        for (uint32_t i = x; i < nc; i += THREADS) {
            const uint32_t e = cand[i], key = order_key(static_cast<uint16_t>(e >> 16)), id = e & 0xFFFFu;
            if (key > thr)
                atomicOr(&gbits[id >> 5], 1u << (id & 31));
            else if (key == thr)
                atomicOr(&ebits[id >> 5], 1u << (id & 31));
        }
    } else {
        for (int64_t w = x; w < (n + 31) / 32; w += THREADS) {
            uint32_t gw = 0, ew = 0;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int64_t g = 4 * w + q;
                uint32_t kk[4];
                group_keys(load_group(s, n, g), kk);
                const uint32_t m = valid_mask(n, g);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const uint32_t key = key_at(kk, i), bit = ((m >> i) & 1u) << (8 * q + i);
                    gw |= key > thr ? bit : 0u;
                    ew |= key == thr ? bit : 0u;
                }
            }
            gbits[w] = gw;
            ebits[w] = ew;
        }
    }
    __syncthreads();
    // Programmatic dependent launch: the next kernel of the stream may launch once every CTA of this
    // grid triggered (or exited) if it was launched with the attribute (the sparse attention
    // kernels: they read this grid's output only after griddepcontrol.wait, which returns once this
    // grid completed). This kernel is launched without the attribute, so it starts only after the
    // previous grid completed: the chain contract of kernels/sparse_attention.cu holds. Triggered
    // here, before the emit step, not at the start (header comment: measured).
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    // Emit: thread x owns words 4x .. 4x+3; position = (> thr before) + min(== thr before, need).
    const uint4 gv = reinterpret_cast<const uint4*>(gbits)[x];
    const uint4 ev = reinterpret_cast<const uint4*>(ebits)[x];
    const uint32_t gw[4] = {gv.x, gv.y, gv.z, gv.w}, ew[4] = {ev.x, ev.y, ev.z, ev.w};
    uint32_t gc = 0, ec = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        gc += __popc(gw[i]);
        ec += __popc(ew[i]);
    }
    uint32_t g_before, e_before;
    block_exclusive2(gc, ec, wsum, wsum2, g_before, e_before);
    uint32_t pos = g_before + (e_before < need ? e_before : need);
    uint32_t rem = e_before < need ? need - e_before : 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t sel = gw[i], eq = ew[i];
        const uint32_t c = __popc(eq);
        if (c <= rem) {
            rem -= c;
        } else {
            // Keep the lowest `rem` ties of the word.
            eq = rem == 0 ? 0u : eq;
            while (static_cast<uint32_t>(__popc(eq)) > rem) eq &= ~(0x80000000u >> __clz(eq));
            rem = 0;
        }
        sel |= eq;
        while (sel) {
            out[pos++] = 128 * x + 32 * i + (__ffs(sel) - 1);
            sel &= sel - 1;
        }
    }
}

}  // namespace dsv41_topk

bool dsv41_topk_launch(const Dsv41IndexerSelectParams& p, cudaStream_t stream) {
    using namespace dsv41_topk;
    if (p.mode != DSV41_SELECT_TOPK || p.num_cols > MAX_N || p.k > DSV41_TOPK_MAX_K) return false;
    indexer_topk_kernel<<<p.num_tokens, THREADS, 0, stream>>>(p);
    return true;
}
