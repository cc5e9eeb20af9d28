// moe_route: the MoE router's decision (spec §8 steps 1–4) and the token sort a grouped expert
// kernel needs, on the device, for the router logits of T tokens:
//   l' = l · f32(1 / gate_temp) + 0           (only when gate_temp != 1: candle's `Tensor / f64`)
//   s  = sqrt(softplus(l'))                   (softplus(x) = x for x > 20, as torch)
//   ids[t, 0..k)     = top-k of s + bias, descending, equal values by the lower expert id
//   weights[t, 0..k) = s_e / (Σ_sel s + 1e-20) · route_scale   (unbiased s, summed in selection order)
//   counts[e], offsets[e] (exclusive prefix sum, offsets[E] = T·k), and order[T·k]: the slots
//   t·k + j grouped by expert ascending and, within an expert, by slot ascending.
// The CPU reference is model::moe_sort::moe_route_ref (model::moe's select_experts plus
// moe_sort::sort_by_expert); tests/cuda_moe_route.rs compares every output against it.
//
// Layout: logits [T, E] f32 contiguous, bias [E] f32; ids / weights [T, k] contiguous; E <= 512,
// k <= min(E, 16), T·k < 2^31.
//
// Design (a CTA's scores are computed by all its threads, then read by one warp per token):
//   * Scores: the CTA's tokens' T_cta · E biased scores (the FP64 softplus below is a long dependent
//     chain) are spread over all its threads, element i = (token, e) = (i / E, i % E), into
//     shared memory (the order key of the biased score and the unbiased score); then one warp per
//     token selects. At E = 384 a 256-thread CTA of one token computes at most 2 scores per thread
//     (a warp alone would chain 12), a 512-thread CTA of the fused path 1. Each score is the
//     same function of its logit and bias whichever thread computes it, so the outputs do not
//     depend on the mapping.
//   * Selection: a lane holds the 16 keys of elements e = lane + 32 i (read from shared memory),
//     so the selection needs no block barrier: k rounds of a warp arg-max over 64-bit keys
//     (total-order key of the biased score << 32 | ~id, so the larger key is the larger score and
//     then the lower id), each two `redux.sync` max reductions; the owner lane removes the winner
//     and rescans its own registers.
//   * Route grid (T > 8): 256-thread CTAs of one token while T <= 1024 (latency: ~T CTAs, all
//     resident), else of 8 tokens (throughput: 12 scores per thread at E = 384).
//   * Small sort (T <= 256, and the fused path): each token has at most one slot per expert (top-k
//     ids are distinct), so a per-expert token bitmap (bit t of word t / 32; shared atomicOr, the
//     result does not depend on their order) gives counts[e] = popcount, the offsets by a block
//     scan, and slot (t, j) with expert e lands at offsets[e] + #{t' < t chose e} (popcounts of
//     the words and the bits below t). One 512-thread CTA, one read of the ids, four barriers.
//   * Sort (T > 256): the position of slot (t, j) with expert e is offsets[e] + #{t' < t chose e}.
//     A 512-thread CTA owns a range of >= 2048 tokens; it first counts the slots before its range
//     and all slots (per-warp shared histograms, order-free), scans the totals into the offsets,
//     then walks its range in chunks of 512 tokens, one token per thread: each warp marks its
//     tokens in a per-expert lane bitmap (shared atomicOr), a thread per expert scans the 16
//     warps' bitmaps into bases, and a slot lands at base[warp][e] + popc(bitmap[warp][e] & lanes
//     below). Each CTA reads all T·k ids once for its counts (redundant across CTAs; at most 128
//     CTAs, so T = 65536, k = 6 reads 32 × 1.5 MB from L2).
//   * Deterministic: no atomic decides a position or a value.
//   * T <= 8 (decode): one launch, a thread-block cluster of T 512-thread CTAs (one CTA, no
//     cluster, for T = 1): CTA t scores and routes token t and stores its k ids into CTA 0's
//     shared memory (distributed shared memory); after a cluster barrier CTA 0 runs the small
//     sort. A CTA per token rather than one CTA for all: a score is ~80 dependent FP64
//     instructions (exp, log1p with a division), so 8 · 384 scores would keep one SM's FP64 units
//     (64 lanes) busy for ~4000 cycles. Else two launches (route grid, then sort) on the caller's
//     stream.
//   * Launch: programmatic dependent launch (kernels/include/dsv41_launch.cuh). Every kernel here
//     waits (griddepcontrol.wait) before its first global access and then lets the next grid of
//     the stream launch (the chain contract of kernels/sparse_attention.cu: wait before trigger),
//     so the sort grid's launch overlaps the route grid (and the route grid's launch the end of a
//     predecessor that triggers early).
//   * Time: see docs/perf.md (H100, examples/bench_moe_route.rs).
//
// Numerics:
//   * temp scale, sqrt, sum, division and product are IEEE roundings (__fmul_rn, __fadd_rn,
//     __fsqrt_rn, __fdiv_rn, no FMA contraction), the same operations in the same order as the
//     CPU reference, so equal scores give bit-equal weights;
//   * softplus: (float)log1p((double)(float)exp((double)l')), i.e. expf then log1pf, each
//     correctly rounded to f32 (up to double rounding, ~2^-29 of inputs). The CPU reference calls
//     the platform libm (Rust's f32::exp / ln_1p): glibc's expf agrees but on ~0.01 % of inputs;
//     glibc 2.36's log1pf (fdlibm, < 1 ulp) differs by 1 ulp on ~1.5 %, which moves the score
//     s by 1 ulp on ~1.3 % of logits in [-30, 25] (never more). The decisions therefore equal the
//     CPU's except where two biased scores lie within ~1 ulp; exact ties (equal biased scores on
//     both sides, e.g. equal logits and biases, or saturated logits > 20 where s = sqrt(l) exactly)
//     are taken lowest id first like the CPU. A 1-ulp score moves a weight by a few ulp (the sum
//     and the division compound it; measured <= 5 ulp); with saturated logits the weights are
//     bit exact;
//   * ordering is Rust's f32::total_cmp (NaN above +inf, −NaN below −inf), with the NaNs the CPU
//     produces on x86-64: a NaN logit's biased score is that NaN quieted (sign and payload kept
//     through the multiply, expf, log1pf, sqrt and the add), else a NaN bias quieted, else
//     +inf + −inf gives x86's default NaN 0xFFC00000 (below every number). The GPU's own NaNs
//     are canonical, so these bits are set explicitly. A NaN score makes its token's weights NaN.
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "include/dsv41_launch.cuh"
#include "include/dsv41_moe_route.h"
#include "include/dsv41_warp.cuh"

namespace dsv41_moe {

namespace cg = cooperative_groups;

constexpr int MAX_E = DSV41_MOE_ROUTE_MAX_EXPERTS;
constexpr int MAX_K = DSV41_MOE_ROUTE_MAX_K;
constexpr int ROUTE_THREADS = 256;                   // route grid CTA
constexpr int ROUTE_MAX_TOKENS = ROUTE_THREADS / 32;  // tokens per route CTA (a warp each), at most
constexpr int64_t ROUTE_SINGLE_MAX_T = 1024;         // one token per route CTA up to this many tokens
constexpr int SORT_THREADS = 512;                    // sort CTA: one token per thread and chunk
constexpr int SORT_WARPS = SORT_THREADS / 32;
constexpr int FUSED_MAX_T = 8;                       // one launch up to this many tokens
constexpr int SMALL_WORDS = 8;                       // token bitmap words per expert of the small sort
constexpr int64_t SMALL_MAX_T = 32 * SMALL_WORDS;    // the small sort up to this many tokens
constexpr int SMALL_SLOTS = static_cast<int>(SMALL_MAX_T) * MAX_K / SORT_THREADS;  // slots per thread
constexpr int64_t SORT_MIN_TOKENS = 2048;            // tokens per sort CTA, at least
constexpr int64_t SORT_MAX_CTAS = 128;
constexpr unsigned FULL = 0xFFFFFFFFu;
static_assert(MAX_E <= SORT_THREADS, "one sort thread per expert");
static_assert(MAX_E <= 32 * 16 && MAX_K <= 32, "16 scores and at most one selected id per lane");
static_assert(FUSED_MAX_T <= 8, "fused path: one bitmap word, a portable cluster of a CTA per token");
static_assert(SMALL_MAX_T * MAX_K == int64_t{SMALL_SLOTS} * SORT_THREADS, "small sort: every slot has a thread");

// Programmatic dependent launch (header): wait for the stream's previous grids, then let the next
// grid launch.
__device__ __forceinline__ void wait_then_allow_dependents() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Key of Rust's f32::total_cmp: unsigned order of the keys = IEEE totalOrder of the floats.
__device__ __forceinline__ uint32_t order_key(uint32_t bits) { return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u); }

// The biased score's bits of logit `l_raw` with bias `b` as the CPU reference computes them
// (NaNs included, see the header), and the unbiased score `s`.
__device__ __forceinline__ uint32_t biased_bits(float l_raw, float b, const Dsv41MoeRouteParams& p, float& s) {
    const float l = p.apply_temp ? __fadd_rn(__fmul_rn(l_raw, p.temp_scale), 0.0f) : l_raw;
    const float e = __double2float_rn(exp(static_cast<double>(l)));
    const float sp = l > 20.0f ? l : __double2float_rn(log1p(static_cast<double>(e)));
    s = __fsqrt_rn(sp);
    const float v = __fadd_rn(s, b);
    if (!isnan(v)) return __float_as_uint(v);
    if (isnan(l_raw)) return __float_as_uint(l_raw) | 0x00400000u;
    if (isnan(b)) return __float_as_uint(b) | 0x00400000u;
    return 0xFFC00000u;
}

// The scores of the n tokens t0 .. t0 + n by all NT threads of the CTA: element i = (t - t0)·E + e
// gets khi[i] = order key of the biased score, sc[i] = the unbiased score (shared memory, n·E
// entries each). The caller synchronizes before reading them.
template <int NT>
__device__ __forceinline__ void score_tokens(const Dsv41MoeRouteParams& p, int64_t t0, int n, uint32_t* khi, float* sc) {
    const int E = p.num_experts, total = n * E, step = NT % E;
    const float* src = p.logits + t0 * E;
    int e = static_cast<int>(threadIdx.x) % E;  // = i % E, advanced by NT mod E per element
    for (int i = threadIdx.x; i < total; i += NT) {
        float s;
        const uint32_t bits = biased_bits(src[i], p.bias[e], p, s);
        khi[i] = order_key(bits);
        sc[i] = s;
        e += step;
        e = e >= E ? e - E : e;
    }
}

// Routes token t with the calling warp (all 32 lanes call it) from its scores khi / sc (shared
// memory, E entries, see score_tokens): writes ids[t, 0..k) and weights[t, 0..k) and returns the
// j-th chosen expert to lane j < k. PER: scores per lane (E <= 32 · PER).
template <int PER>
__device__ __forceinline__ uint32_t route_token(const Dsv41MoeRouteParams& p, int64_t t, int lane, const uint32_t* khi, const float* sc_in) {
    const int E = p.num_experts, k = p.k;
    uint64_t key[PER];  // 0 = no expert (past E, or already selected)
    float sc[PER];
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        key[i] = 0;
        sc[i] = 0.0f;
        if (e < E) {
            key[i] = (static_cast<uint64_t>(khi[e]) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(e));
            sc[i] = sc_in[e];
            best = key[i] > best ? key[i] : best;
        }
    }
    uint32_t my_id = 0;
    float my_s = 0.0f, sum = 0.0f;
    for (int j = 0; j < k; ++j) {
        // The warp's largest key: its high word, then the largest low word among lanes with it
        // (a lane with no expert left has key 0; its low word 0 loses to every real ~id).
        const uint32_t hi = __reduce_max_sync(FULL, static_cast<uint32_t>(best >> 32));
        const uint32_t lo = __reduce_max_sync(FULL, static_cast<uint32_t>(best >> 32) == hi ? static_cast<uint32_t>(best) : 0u);
        const uint32_t id = ~lo;
        const int owner = static_cast<int>(id & 31u), slot = static_cast<int>(id >> 5);
        float ws = 0.0f;
        if (lane == owner) {
            best = 0;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                if (i == slot) {
                    ws = sc[i];
                    key[i] = 0;
                }
                best = key[i] > best ? key[i] : best;
            }
        }
        ws = __shfl_sync(FULL, ws, owner);
        // Σ_sel s in selection order, from the first score (the CPU's sum from ±0 adds it exactly).
        sum = j == 0 ? ws : __fadd_rn(sum, ws);
        if (lane == j) {
            my_id = id;
            my_s = ws;
        }
    }
    if (lane < k) {
        p.ids[t * k + lane] = my_id;
        p.weights[t * k + lane] = __fmul_rn(__fdiv_rn(my_s, __fadd_rn(sum, 1e-20f)), p.route_scale);
    }
    return my_id;
}

// Exclusive sum of `v` over the SORT_THREADS threads of the CTA (all call it; one barrier).
// wsum: SORT_WARPS words of scratch, not read by the CTA since its last barrier.
__device__ __forceinline__ uint32_t block_exclusive_sum(uint32_t v, uint32_t* wsum) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint32_t incl = dsv41_warp::inclusive_sum(v, lane);
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    uint32_t pre = 0;
#pragma unroll
    for (int w = 0; w < SORT_WARPS; ++w) pre += w < warp ? wsum[w] : 0u;
    return pre + incl - v;
}

// Small sort, step 2 (all SORT_THREADS threads call it, after a barrier that completed the
// bitmaps): mask[w·E + e] bit b = token 32w + b chose expert e (W words per expert). Writes
// counts, offsets and offsets[E] = T·k, and pre[w·E + e] = offsets[e] + the slots of expert e of
// the tokens below 32w. The caller synchronizes before reading pre.
template <int W>
__device__ __forceinline__ void small_sort_bases(const Dsv41MoeRouteParams& p, const uint32_t* mask, uint32_t* pre, uint32_t* wsum) {
    const int tid = threadIdx.x, E = p.num_experts;
    uint32_t m[W], c = 0;
#pragma unroll
    for (int w = 0; w < W; ++w) {
        m[w] = tid < E ? mask[w * E + tid] : 0u;
        c += __popc(m[w]);
    }
    const uint32_t excl = block_exclusive_sum(c, wsum);
    if (tid < E) {
        p.counts[tid] = c;
        p.offsets[tid] = excl;
        uint32_t acc = excl;
#pragma unroll
        for (int w = 0; w < W; ++w) {
            pre[w * E + tid] = acc;
            acc += __popc(m[w]);
        }
    }
    if (tid == 0) p.offsets[E] = static_cast<uint32_t>(p.num_tokens * p.k);
}

// Small sort, step 3: the position of token t's slot with expert e (see small_sort_bases).
__device__ __forceinline__ uint32_t small_sort_position(const uint32_t* mask, const uint32_t* pre, int E, uint32_t e, int t) {
    const int i = (t >> 5) * E + static_cast<int>(e);
    return pre[i] + __popc(mask[i] & ((1u << (t & 31)) - 1u));
}

// How many of the slots [lo, hi) chose each expert: returned to thread e < E (0 elsewhere).
// bm: SORT_WARPS · E words of scratch, one histogram per warp.
__device__ __forceinline__ uint32_t count_slots(const uint32_t* ids, int64_t lo, int64_t hi, int E, uint32_t* bm) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    uint32_t* h = bm + warp * E;
    __syncthreads();  // earlier readers of bm are done
    for (int e = lane; e < E; e += 32) h[e] = 0;
    __syncwarp();
    int64_t s = lo + tid;
    for (; s + 3 * SORT_THREADS < hi; s += 4 * SORT_THREADS) {
        uint32_t v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = ids[s + u * SORT_THREADS];
#pragma unroll
        for (int u = 0; u < 4; ++u) atomicAdd(&h[v[u]], 1u);
    }
    for (; s < hi; s += SORT_THREADS) atomicAdd(&h[ids[s]], 1u);
    __syncthreads();
    uint32_t c = 0;
    if (tid < E)
        for (int w = 0; w < SORT_WARPS; ++w) c += bm[w * E + tid];
    return c;
}

// The sort of the tokens [t0, t1) by one CTA of SORT_THREADS (see the header); the CTA with
// `first` also writes counts and offsets. Reads ids written by an earlier launch.
__device__ __forceinline__ void sort_tokens(const Dsv41MoeRouteParams& p, int64_t t0, int64_t t1, bool first, uint32_t* bm,
                                            uint32_t* wsum) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int E = p.num_experts, k = p.k;
    const int64_t T = p.num_tokens;
    const uint32_t* ids = p.ids;
    const uint32_t before = count_slots(ids, 0, t0 * k, E, bm);
    const uint32_t all = before + count_slots(ids, t0 * k, T * k, E, bm);

    // offsets: exclusive block scan of the totals (threads >= E hold 0).
    const uint32_t excl = block_exclusive_sum(all, wsum);
    if (first && tid < E) {
        p.counts[tid] = all;
        p.offsets[tid] = excl;
    }
    if (first && tid == 0) p.offsets[E] = static_cast<uint32_t>(T * k);
    // Thread e: the position of expert e's next slot (of a token >= the current chunk).
    uint32_t base = excl + before;

    const uint32_t below = (1u << lane) - 1u;
    uint32_t* mine = bm + warp * E;
    for (int64_t c0 = t0; c0 < t1; c0 += SORT_THREADS) {
        const int64_t t = c0 + tid;
        const bool has = t < t1;
        __syncthreads();  // the previous chunk's readers of bm are done
        for (int e = lane; e < E; e += 32) mine[e] = 0;
        __syncwarp();
        uint32_t ex[MAX_K], rank[MAX_K];
#pragma unroll
        for (int j = 0; j < MAX_K; ++j) {
            ex[j] = 0;
            if (j < k && has) {
                ex[j] = ids[t * k + j];
                atomicOr(&mine[ex[j]], 1u << lane);
            }
        }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < MAX_K; ++j) rank[j] = j < k && has ? __popc(mine[ex[j]] & below) : 0u;
        __syncthreads();  // every warp's bitmaps are complete and read
        if (tid < E) {
            uint32_t acc = base;
            for (int w = 0; w < SORT_WARPS; ++w) {
                const uint32_t m = bm[w * E + tid];
                bm[w * E + tid] = acc;
                acc += __popc(m);
            }
            base = acc;
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < MAX_K; ++j)
            if (j < k && has) p.order[mine[ex[j]] + rank[j]] = static_cast<uint32_t>(t * k + j);
    }
}

// Route grid: CTA b routes the tokens [b·tokens_per_cta, ...) (tokens_per_cta <= ROUTE_MAX_TOKENS).
template <int PER>
__global__ void __launch_bounds__(ROUTE_THREADS) moe_route_kernel(const Dsv41MoeRouteParams p, int tokens_per_cta) {
    __shared__ uint32_t khi[ROUTE_MAX_TOKENS * MAX_E];
    __shared__ float sc[ROUTE_MAX_TOKENS * MAX_E];
    wait_then_allow_dependents();
    const int64_t t0 = static_cast<int64_t>(blockIdx.x) * tokens_per_cta;
    const int n = static_cast<int>(p.num_tokens - t0 < tokens_per_cta ? p.num_tokens - t0 : tokens_per_cta);
    score_tokens<ROUTE_THREADS>(p, t0, n, khi, sc);
    __syncthreads();
    const int warp = threadIdx.x >> 5, E = p.num_experts;
    if (warp < n) route_token<PER>(p, t0 + warp, threadIdx.x & 31, khi + warp * E, sc + warp * E);
}

// Small sort (T <= SMALL_MAX_T) of the ids written by the route grid, one CTA.
__global__ void __launch_bounds__(SORT_THREADS) moe_sort_small_kernel(const Dsv41MoeRouteParams p) {
    __shared__ uint32_t mask[SMALL_WORDS * MAX_E];
    __shared__ uint32_t pre[SMALL_WORDS * MAX_E];
    __shared__ uint32_t wsum[SORT_WARPS];
    const int tid = threadIdx.x, E = p.num_experts, k = p.k;
    const int n = static_cast<int>(p.num_tokens) * k;
    for (int i = tid; i < SMALL_WORDS * E; i += SORT_THREADS) mask[i] = 0;
    wait_then_allow_dependents();
    uint32_t ex[SMALL_SLOTS];
#pragma unroll
    for (int u = 0; u < SMALL_SLOTS; ++u) {
        const int s = tid + u * SORT_THREADS;
        ex[u] = s < n ? p.ids[s] : 0u;
    }
    __syncthreads();  // bitmaps zeroed
#pragma unroll
    for (int u = 0; u < SMALL_SLOTS; ++u) {
        const int s = tid + u * SORT_THREADS, t = s / k;
        if (s < n) atomicOr(&mask[(t >> 5) * E + static_cast<int>(ex[u])], 1u << (t & 31));
    }
    __syncthreads();
    small_sort_bases<SMALL_WORDS>(p, mask, pre, wsum);
    __syncthreads();
#pragma unroll
    for (int u = 0; u < SMALL_SLOTS; ++u) {
        const int s = tid + u * SORT_THREADS;
        if (s < n) p.order[small_sort_position(mask, pre, E, ex[u], s / k)] = static_cast<uint32_t>(s);
    }
}

__global__ void __launch_bounds__(SORT_THREADS) moe_sort_kernel(const Dsv41MoeRouteParams p, int64_t tokens_per_cta) {
    __shared__ uint32_t bm[SORT_WARPS * MAX_E];
    __shared__ uint32_t wsum[SORT_WARPS];
    wait_then_allow_dependents();
    const int64_t t0 = static_cast<int64_t>(blockIdx.x) * tokens_per_cta;
    const int64_t t1 = t0 + tokens_per_cta < p.num_tokens ? t0 + tokens_per_cta : p.num_tokens;
    sort_tokens(p, t0, t1, blockIdx.x == 0, bm, wsum);
}

// T <= FUSED_MAX_T: a cluster of T CTAs (gridDim.y; one CTA and no cluster for T <= 1). CTA r
// scores token r (all threads) and routes it (warp 0), and writes its ids into CTA 0's `sel`
// (distributed shared memory); after a cluster barrier CTA 0 sorts the T·k slots (small sort).
template <int PER>
__global__ void __launch_bounds__(SORT_THREADS) moe_route_sort_kernel(const Dsv41MoeRouteParams p) {
    __shared__ uint32_t khi[MAX_E];
    __shared__ float sc[MAX_E];
    __shared__ uint32_t sel[FUSED_MAX_T * MAX_K];  // CTA 0: the chosen ids, slot t·k + j
    __shared__ uint32_t mask[MAX_E];
    __shared__ uint32_t pre[MAX_E];
    __shared__ uint32_t wsum[SORT_WARPS];
    const int tid = threadIdx.x, E = p.num_experts, k = p.k, n = static_cast<int>(p.num_tokens);
    const int r = static_cast<int>(blockIdx.y);
    const bool cluster = gridDim.y > 1;
    // Every CTA of the cluster has started (its shared memory may be written) once the matching
    // wait below returns.
    if (cluster) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    for (int i = tid; i < E; i += SORT_THREADS) mask[i] = 0;
    wait_then_allow_dependents();
    if (r < n) score_tokens<SORT_THREADS>(p, r, 1, khi, sc);
    __syncthreads();
    if (cluster) asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    if (r < n && tid < 32) {
        const uint32_t id = route_token<PER>(p, r, tid, khi, sc);
        uint32_t* dst = cluster ? cg::this_cluster().map_shared_rank(sel, 0) : sel;
        if (tid < k) dst[r * k + tid] = id;
    }
    // Release / acquire: CTA 0 sees every CTA's sel writes (a CTA barrier without a cluster).
    if (cluster) cg::this_cluster().sync();
    else __syncthreads();
    if (r != 0) return;
    const int slots = n * k;
    for (int s = tid; s < slots; s += SORT_THREADS) atomicOr(&mask[sel[s]], 1u << (s / k));
    __syncthreads();
    small_sort_bases<1>(p, mask, pre, wsum);
    __syncthreads();
    for (int s = tid; s < slots; s += SORT_THREADS) p.order[small_sort_position(mask, pre, E, sel[s], s / k)] = static_cast<uint32_t>(s);
}

template <int PER>
cudaError_t launch(const Dsv41MoeRouteParams& p, cudaStream_t s) {
    using dsv41_launch::launch_pdl;
    const int64_t T = p.num_tokens;
    if (T <= FUSED_MAX_T) {
        const int ctas = T > 1 ? static_cast<int>(T) : 1;  // a cluster of T CTAs (launch_pdl: none for 1)
        return launch_pdl(moe_route_sort_kernel<PER>, dim3(1, ctas, 1), dim3(SORT_THREADS), 0, s, ctas, p);
    }
    const int per_route = T <= ROUTE_SINGLE_MAX_T ? 1 : ROUTE_MAX_TOKENS;
    const unsigned route_ctas = static_cast<unsigned>((T + per_route - 1) / per_route);
    cudaError_t e = launch_pdl(moe_route_kernel<PER>, dim3(route_ctas), dim3(ROUTE_THREADS), 0, s, 1, p, per_route);
    if (e != cudaSuccess) return e;
    if (T <= SMALL_MAX_T) return launch_pdl(moe_sort_small_kernel, dim3(1), dim3(SORT_THREADS), 0, s, 1, p);
    // Tokens per sort CTA: a multiple of the chunk, at least SORT_MIN_TOKENS, at most SORT_MAX_CTAS CTAs.
    int64_t per_cta = (T + SORT_MAX_CTAS - 1) / SORT_MAX_CTAS;
    per_cta = (per_cta + SORT_THREADS - 1) / SORT_THREADS * SORT_THREADS;
    per_cta = per_cta > SORT_MIN_TOKENS ? per_cta : SORT_MIN_TOKENS;
    return launch_pdl(moe_sort_kernel, dim3(static_cast<unsigned>((T + per_cta - 1) / per_cta)), dim3(SORT_THREADS), 0, s, 1, p, per_cta);
}

}  // namespace dsv41_moe

extern "C" int dsv41_moe_route(const Dsv41MoeRouteParams* p, size_t params_size, void* stream) {
    using namespace dsv41_moe;
    if (params_size != sizeof(Dsv41MoeRouteParams)) return DSV41_ERR_PARAMS_SIZE;
    const int64_t T = p->num_tokens;
    const int E = p->num_experts, k = p->k;
    if (T < 0 || E < 1 || E > MAX_E || k < 1 || k > E || k > MAX_K) return DSV41_ERR_SHAPE;
    if (T >= (int64_t{1} << 31) || T * k >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    if (!isfinite(p->route_scale) || (p->apply_temp && !(isfinite(p->temp_scale) && p->temp_scale > 0.0f))) return DSV41_ERR_SHAPE;
    if (!p->bias || !p->counts || !p->offsets) return DSV41_ERR_NULL;
    if (T > 0 && (!p->logits || !p->ids || !p->weights || !p->order)) return DSV41_ERR_NULL;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    cudaError_t e;
    if (E <= 32) e = launch<1>(*p, s);
    else if (E <= 128) e = launch<4>(*p, s);
    else if (E <= 256) e = launch<8>(*p, s);
    else if (E <= 384) e = launch<12>(*p, s);
    else e = launch<16>(*p, s);
    return static_cast<int>(e);
}
