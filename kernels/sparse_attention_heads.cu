// sparse_attention_heads: the head-split decode kernel of the sparse attention with sink
// (kernels/sparse_attention.cu holds the launcher, the definition and the numerics; this kernel
// computes the same function). Chosen by the launcher for few tokens (decode), where the
// all-heads kernel needs split-KV and a split merge across the SMs of a cluster.
//
// Design. grid = (T, ceil(H / 32)), 256 threads, 1 CTA per SM (~190 KB shared memory). CTA (t, z)
// owns heads [32 z, 32 z + 32) of token t and ALL of the token's valid rows, so there is no
// split and no merge: the token's two (H = 64) CTAs read the same rows (the second from L2) and
// each writes its heads' output rows directly. Rows are the wgmma M dimension (32 heads would
// fill only half of an M = 64 instruction):
//   1. All 256 threads compact the token's valid indices (dsv41_sparse_attention_common.cuh,
//      ValidIndicesR) while warpgroup 0 copies q (32 heads x 512, a 32-row swizzled K-major
//      tile) and the sink.
//   2. Warpgroup 1 is the producer (produce_tiles, shared with the all-heads kernel: 64-row
//      tiles into a two-stage ring, bf16 or packed rows). Warpgroup 0 consumes, per tile:
//      S^T [64 rows, 32 heads] = K . q^T: 32 x wgmma m64n32k16 (A = the row tile, K-major; B = q,
//        K-major); warp w holds rows 16 w .. +16, thread (g, tq) = (lane / 4, lane % 4) rows
//        16 w + g (+8) of heads 8 i + 2 tq (+1), i = 0..3.
//      Softmax per head over rows: the fragments of S^T go to shared memory ([head][row], f32),
//        and lane l of warp w takes head 8 w + l / 4 over 16 of the tile's rows (the 4 lanes of
//        a head exchange max and sum by two shuffles): m_new, p = e^{l - m_new} summed (f32)
//        into the head's denominator and rounded to bf16 into P^T [32 heads][64 rows] (the
//        K-major B operand, 128-byte swizzle, two 16-byte stores), alpha = e^{m_old - m_new}
//        to shared memory for the O rescale.
//      O^T [512 dims, 32 heads] += V^T . P^T: per 16 rows 8 x m64n32k16 (A = the row tile read
//        MN-major: dims are its M dimension, 64-dim planes; B = P^T), 128 f32 accumulators per
//        thread: o[16 mb + 4 i + c] = dim 64 mb + 16 w + g + 8 (c / 2), head 8 i + 2 tq + c % 2.
//      Then the stage goes back to the producer, which meanwhile gathered tile j + 1 into the
//        other stage (two 64 KB stages: q, the stages, P^T and S^T take ~180 KB; a third does
//        not fit, so the softmax does not overlap the products).
//      Ping-pong kernel (bf16 rows; the launcher's choice where this kernel would run, and
//        DSV41_SA_KERNEL_HEAD_SPLIT_PINGPONG): kernels/sparse_attention_pingpong.cu, two consumer
//        warpgroups on alternate tiles of a slot ring, so one's softmax runs under the other's
//        products. Forced HeadSplit (and packed rows) run this two-stage loop. (A one-consumer
//        slot ring, the next tile's Sᵀ issued during the softmax, measured 28.0-28.2 us at B = 64
//        standalone against this loop's 25.5, 28.6-29.1 against 32.7-33.8 in-stream; the
//        ping-pong kernel replaced it.)
//   3. Epilogue: per head (one lane) the factor fl(1 / (den + e^{sink - m})) as the all-heads
//      kernel with one split, and lse = m + ln den; out = fl(O f) rounded to bf16 and transposed
//      into [head][dim] rows by stmatrix .trans (in a stage tile, free after the last one), then
//      16-byte stores (the CTA's 32 output rows are contiguous).
// Numerics: those of the all-heads kernel with one split (the reference's 64-row blocks, p
// rounded to bf16 relative to the block's running max); only the f32 orders of the dot
// products, tensor-core sums and denominators differ.
// Launch: programmatic dependent launch as the all-heads kernel (chain contract in
// kernels/sparse_attention.cu: nothing is read before griddepcontrol.wait). Diagnostics (the DIAG
// instantiation, compiled only with the DSV41_SA_DIAG switch: include/dsv41_sparse_attention_common.cuh):
// mode bit 0 traces CTA (0, 0), bit 2 skips the gather (bit 1 does not apply).
// Prologue variants measured on the H200 at B = 64, none kept: the window tiles
// gathered by the producer before the compaction (slower: issuing 128 KB of cp.async delays the
// producer's share of the compaction, 29.5 vs 26.8 us); L2 prefetches (cp.async.bulk.prefetch.L2)
// of the CTA's q rows and first 128 window rows before griddepcontrol.wait, and of tile 2's
// rows after tile 1's copies (no gain standalone or in-stream); TMA bulk stores of the out rows
// (no gain); the q copies and the window tiles' gather before the wait (-1.8 us in-stream behind
// the top-k, but sound only with the caller's guarantee, see the chain contract).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "include/dsv41_hopper.cuh"
#include "include/dsv41_launch.cuh"
#include "include/dsv41_sparse_attention.h"
#include "include/dsv41_sparse_attention_common.cuh"
#include "include/dsv41_sparse_attention_heads.cuh"

namespace dsv41_sa {
namespace heads {

using namespace dsv41_ptx;

// Shared memory map of the two-stage kernel (bytes).
constexpr int SM_Q = 0;                        // bf16 [8 planes][32 heads][128 B]
constexpr int SM_K = SM_Q + HS * D * 2;        // bf16 [2 stages][64 rows][512] (epilogue: bf16 out rows [32][OUT_STRIDE])
constexpr int SM_P = SM_K + 2 * TILEB;         // bf16 [32 heads][64 rows], 128-byte swizzle
constexpr int SM_S = SM_P + HS * BLK * 2;      // f32 [32 heads][64 rows], swizzled (s_swz): S^T of a tile (softmax input)
constexpr int SM_ALPHA = SM_S + S_BYTES;       // f32 [32 heads]: e^{m_old - m_new} of the tile
constexpr int SM_FAC = SM_ALPHA + HS * 4;      // f32 [32 heads]: epilogue factors
constexpr int SM_SINK = SM_FAC + HS * 4;       // f32 [32 heads]
constexpr int SM_CNT = SM_SINK + HS * 4;       // i32 [MAX_ROUNDS * 8] per-warp valid counts -> offsets
constexpr int SM_TOTAL = SM_CNT + MAX_ROUNDS * 8 * 4;  // i32 [1]
constexpr int SM_BAR = SM_TOTAL + 16;          // u64 [4]: full[2], empty[2]
constexpr int SM_ENT = SM_BAR + 32;            // u32 [valid rows]
static_assert(SM_K % 1024 == 0 && SM_P % 1024 == 0, "wgmma operand tiles start on 1024-byte boundaries");
static_assert(HS * OUT_STRIDE <= 2 * TILEB, "out rows fit the stages");

constexpr int TRACE_SLOTS = 40;
// Phase timestamps of CTA (0, 0), thread 0: [0] start, [1] indices loaded, [2] compaction done,
// [3] end, [20 + j] tile j done (j < 16), [4 + j] rows of tile j arrived; tile 1: [36] S^T done,
// [37] softmax done (P^T written).
__device__ long long g_trace_heads[TRACE_SLOTS];

// DIAG: the diagnostics compiled in (`mode`); the production instantiation carries none of their code.
template <bool DIAG>
__global__ void __launch_bounds__(THREADS_ALL, 1) head_split_kernel(const Dsv41SparseAttentionParams p, int mode) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sbase = smem_addr(smem);
    if ((sbase & 1023u) != 0) __trap();  // the wgmma descriptors assume 1024-byte aligned tiles
    const uint32_t bar_full = sbase + SM_BAR, bar_empty = sbase + SM_BAR + 16;
    // (The warp index through a shuffle: the compiler then knows the role branch is warp-uniform
    // and keeps the wgmma products of the consumer path asynchronous.)
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const bool consumer = warp < CONSUMERS / 32;
    const int t = blockIdx.x, h0 = blockIdx.y * HS;
    const int nh = min(HS, p.num_heads - h0);
    // mode (DIAG only): bit 0 trace, bit 2 skip the gather (bit 1, skip the products, does not
    // apply: the products have no run-time conditions, which keeps them asynchronous).
    const bool skip_gather = DIAG && (mode & 4);
    const bool tracer = DIAG && (mode & 1) && tid == 0 && blockIdx.x == 0 && blockIdx.y == 0;
    auto stamp = [&](int slot) {
        if (tracer) g_trace_heads[slot] = clock64();
    };
    grid_dep_wait();  // everything below may read what the previous kernel wrote
    grid_dep_launch();
    stamp(0);
    init_barriers(bar_full, bar_empty, 2, tid);
    const int count = compact_indices(p, smem, SM_CNT, SM_TOTAL, SM_ENT, t, tid, lane, warp, [&]() {
        if (consumer) load_q_tile<HS, CONSUMERS>(p, t, h0, nh, tid, sbase + SM_Q, sbase + SM_SINK);
    }, [] { __syncthreads(); }, stamp);
    __syncthreads();  // ent_s complete
    const int ntiles = (count + BLK - 1) / BLK;
    if (!consumer) {
        produce_tiles(p, sbase + SM_K, reinterpret_cast<const uint32_t*>(smem + SM_ENT), count, bar_full, bar_empty, tid - CONSUMERS,
                      skip_gather);
        return;
    }
    stamp(2);

    // Consumer warpgroup. Products: thread (g, tq) of warp w holds S^T / O^T fragments of heads
    // 8 i + 2 tq (+1), i = 0..3. Softmax: lane l of warp w owns head hw = 8 w + l / 4 over rows
    // rq = 16 (l % 4) .. +16 of each tile (its 4 lanes agree on m_run and den).
    const int g = lane >> 2, tq = lane & 3, w = warp;
    const int hw = 8 * w + (lane >> 2), rq = 16 * (lane & 3);
    float* s_s = reinterpret_cast<float*>(smem + SM_S);
    float* alpha_s = reinterpret_cast<float*>(smem + SM_ALPHA);
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run = M_FLOOR, den = 0.f;  // running max and denominator of head hw
    // S^T accumulators, zeroed while no product is in flight (ptxas serializes the products
    // when accumulator registers are defined while another product is pending).
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    // Per tile: wait for the rows, S^T, softmax, P.V, hand the stage back. (Measured slower: the
    // previous tile's P.V left in flight while this tile's rows are awaited and its
    // S^T issued; its stage then goes back only after this tile's rows landed, so at most one
    // tile is in flight.)
    for (int j = 0; j < ntiles; ++j) {
        mbar_wait(bar_full + 8 * (j & 1), (j >> 1) & 1);
        if (j == 0) cp_async_wait_all();  // this thread's q copies
        fence_proxy_async();  // q and the row tile (generic-proxy writes) are read by wgmma
        consumer_sync();
        if (j < 16) stamp(4 + j);
        const int nb = min(BLK, count - j * BLK);
        const uint32_t kt = sbase + SM_K + (j & 1) * TILEB;
        // S^T = K . q^T (m64n32k16 over the 512 dims: 8 planes x 4 k-steps of 16).
        wg_fence_regs<16>(s);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const uint32_t sub = (ks & 3) * 32;
            wg_m64n32k16<0, 0>(s, wg_desc(kt + (ks >> 2) * PLANE + sub, 16, 1024), wg_desc(sbase + SM_Q + (ks >> 2) * (HS * 128) + sub, 16, 1024));
        }
        wg_commit();
        wg_wait_all();
        wg_fence_regs<16>(s);
        if (j == 1) stamp(36);
        stage_scores(s, s_s, w, g, tq);
        consumer_sync();
        softmax_tile(s_s, smem + SM_P, alpha_s, p.scale, nb, hw, rq, lane, m_run, den, [&](float) { return m_run; });
        fence_proxy_async();  // the P^T tile is read by wgmma
        consumer_sync();
        // Rescale O by its heads' alpha, then O^T += V^T . P^T over all 4 k-steps (no run-time trip
        // count: ptxas keeps the products asynchronous; rows past the tile's end have p = 0 and
        // zero-filled rows).
        if (j == 1) stamp(37);
        rescale_o(o, alpha_s, tq);
        wg_fence_regs<128>(o);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BLK / 16; ++kk) {
            const uint64_t b = wg_desc(sbase + SM_P + kk * 32, 16, 1024);
#pragma unroll
            for (int mb = 0; mb < 8; ++mb) wg_m64n32k16<1, 0>(o + 16 * mb, wg_desc(kt + mb * PLANE + kk * 16 * 128, PLANE, 1024), b);
        }
        wg_commit();
        wg_wait_all();
        wg_fence_regs<128>(o);
        // This warp is done with the stage (its products completed): hand it back.
        if (lane == 0) mbar_arrive(bar_empty + 8 * (j & 1));
        if (j < 16) stamp(20 + j);
    }
    const float* sink_s = reinterpret_cast<const float*>(smem + SM_SINK);
    epilogue(p, o, m_run, den, [&] { return sink_s[hw]; }, reinterpret_cast<float*>(smem + SM_FAC), smem + SM_K,
             sbase + SM_K, t, h0, nh, count, hw, lane, w, tid);
    stamp(3);
}

// Diagnostics (DIAG instantiation): prints the phase timestamps of CTA (0, 0) (synchronises the stream).
void print_trace(cudaStream_t stream, int dev) {
    long long h[TRACE_SLOTS] = {};
    const int khz = dsv41_launch::read_trace(g_trace_heads, h, sizeof(h), stream, dev);
    if (khz == 0) return;
    const double us = 1e3 / khz;
    fprintf(stderr, "sparse_attention head-split trace (CTA 0): indices %.2f | compaction %.2f us", (h[1] - h[0]) * us, (h[2] - h[0]) * us);
    long long prev = h[2];
    for (int j = 0; j < 16 && h[20 + j] > prev; ++j) {
        fprintf(stderr, " | tile%d %.2f (wait %.2f)", j, (h[20 + j] - prev) * us, (h[4 + j] - prev) * us);
        prev = h[20 + j];
    }
    fprintf(stderr, " | epilogue %.2f | total %.2f us", (h[3] - prev) * us, (h[3] - h[0]) * us);
    if (h[37] > 0)
        fprintf(stderr, " (tile1 after its rows: S^T %.2f, softmax %.2f, P.V %.2f us)", (h[36] - h[5]) * us, (h[37] - h[36]) * us,
                (h[21] - h[37]) * us);
    fprintf(stderr, "\n");
}

}  // namespace heads

int launch_head_split(const Dsv41SparseAttentionParams& p, cudaStream_t stream, int dev, int max_smem) {
    using namespace heads;
    const int ktot = p.kw + p.kc;
    // Else bf16 rows: the ping-pong kernel (forced, or the fallback), unless its slots do not fit;
    // forced HeadSplit and packed rows (its producer expands whole tiles): the two-stage kernel.
    const bool bf16_rows = p.window_format == DSV41_KV_BF16 && p.extra_format == DSV41_KV_BF16;
    // bf16 rows: the dims-split pair (Auto's choice, or forced), unless its slots do not fit.
    if (bf16_rows && (p.kernel == DSV41_SA_KERNEL_DIM_SPLIT_PAIR || p.kernel == DSV41_SA_KERNEL_AUTO)) {
        const int r = launch_dimsplit_pair(p, stream, dev, max_smem);
        if (r != DSV41_ERR_SHAPE) return r;
    }
    if (bf16_rows && p.kernel != DSV41_SA_KERNEL_HEAD_SPLIT) {
        const int r = launch_head_split_pingpong(p, stream, dev, max_smem);
        if (r != DSV41_ERR_SHAPE) return r;
    }
    const size_t smem = SM_ENT + sizeof(uint32_t) * static_cast<size_t>(ktot > 0 ? ktot : 1);
    if (smem > static_cast<size_t>(max_smem)) return DSV41_ERR_SHAPE;
    // Diagnostic bits (0 without the DSV41_SA_DIAG switch): a call with any of this kernel's runs
    // its DIAG instantiation.
    const int mode = diagnostic_mode() & 5;
    const bool diag = mode != 0;
    auto* kernel = diag ? head_split_kernel<DIAG_BUILD> : head_split_kernel<false>;
    static thread_local int configured_dev[2] = {-1, -1};
    cudaError_t e = dsv41_launch::set_max_dynamic_smem(kernel, dev, max_smem, configured_dev[diag]);
    if (e != cudaSuccess) return static_cast<int>(e);
    if (mode & 1) dsv41_launch::clear_trace(g_trace_heads, sizeof(long long) * TRACE_SLOTS, stream);
    e = dsv41_launch::launch_pdl(kernel, dim3(p.num_tokens, (p.num_heads + HS - 1) / HS, 1), dim3(THREADS_ALL, 1, 1), smem,
                                 stream, 1, p, mode);
    if (e == cudaSuccess && (mode & 1)) print_trace(stream, dev);
    return static_cast<int>(e);
}

}  // namespace dsv41_sa
