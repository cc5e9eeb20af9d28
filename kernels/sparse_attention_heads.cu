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
//      ValidIndices) while warpgroup 0 copies q (32 heads x 512, a 32-row swizzled K-major
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
//      Ring kernel (bf16 rows, chosen by the caller: DSV41_SA_KERNEL_HEAD_SPLIT_RING; head_split_ring_kernel
//        below, docs/perf.md "Round 9"): the rows live in a ring of 8-11 slots of two 64-dim
//        planes (16 KB) after the index entries (11 at 640 indices: 2.75 tiles), each slot with
//        its own full / empty mbarrier, so tile j + 1 is resident while tile j is consumed:
//        S^T(j + 1) is issued in chunks inside softmax(j), P.V(j) as four groups of two m-blocks
//        whose slots go back as each group completes. Same products and orders: bitwise the
//        two-stage result. Measured slower standalone (tiles 1.8 vs 1.6 us: the softmax does not
//        overlap the N = 32 products within one warpgroup) but ~4.5 us faster in-stream behind
//        the top-k (not understood; not the shared-memory footprint: the two-stage kernel
//        launched with the ring's 227 KB measured the same in-stream, lead run 3 of session 8).
//   3. Epilogue: per head (one lane) the factor fl(1 / (den + e^{sink - m})) as the all-heads
//      kernel with one split, and lse = m + ln den; out = fl(O f) rounded to bf16 and transposed
//      into [head][dim] rows by stmatrix .trans (in a stage tile, free after the last one), then
//      16-byte stores (the CTA's 32 output rows are contiguous).
// Numerics: those of the all-heads kernel with one split (the reference's 64-row blocks, p
// rounded to bf16 relative to the block's running max); only the f32 orders of the dot
// products, tensor-core sums and denominators differ.
// Launch: programmatic dependent launch as the all-heads kernel (chain contract in
// kernels/sparse_attention.cu: nothing is read before griddepcontrol.wait). Diagnostics: mode
// bit 0 traces CTA (0, 0) (DSV41_SPARSE_ATTENTION_TRACE=1), bit 2 skips the gather (bit 1 does
// not apply).
// Prologue variants measured in round 8 (docs/perf.md, "Round 8"), none kept: the window tiles
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
constexpr int SM_S = SM_P + HS * BLK * 2;      // f32 [32 heads][SP]: S^T of a tile (softmax input)
constexpr int SM_ALPHA = SM_S + HS * SP * 4;   // f32 [32 heads]: e^{m_old - m_new} of the tile
constexpr int SM_FAC = SM_ALPHA + HS * 4;      // f32 [32 heads]: epilogue factors
constexpr int SM_SINK = SM_FAC + HS * 4;       // f32 [32 heads]
constexpr int SM_CNT = SM_SINK + HS * 4;       // i32 [MAX_ROUNDS * 8] per-warp valid counts -> offsets
constexpr int SM_TOTAL = SM_CNT + MAX_ROUNDS * 8 * 4;  // i32 [1]
constexpr int SM_BAR = SM_TOTAL + 16;          // u64 [4]: full[2], empty[2]
constexpr int SM_ENT = SM_BAR + 32;            // u32 [valid rows]
static_assert(SM_K % 1024 == 0 && SM_P % 1024 == 0, "wgmma operand tiles start on 1024-byte boundaries");
static_assert(HS * OUT_STRIDE <= 2 * TILEB, "out rows fit the stages");

// Shared memory map of the ring kernel (bytes): the same pieces without the stages, then the
// slot ring after the index entries (its offset and slot count depend on the index count).
constexpr int RG_P = SM_Q + HS * D * 2;        // bf16 [32 heads][64 rows], 128-byte swizzle
constexpr int RG_S = RG_P + HS * BLK * 2;      // f32 [32 heads][SP]
constexpr int RG_ALPHA = RG_S + HS * SP * 4;   // f32 [32 heads]
constexpr int RG_FAC = RG_ALPHA + HS * 4;      // f32 [32 heads]
constexpr int RG_SINK = RG_FAC + HS * 4;       // f32 [32 heads]
constexpr int RG_CNT = RG_SINK + HS * 4;       // i32 [MAX_ROUNDS * 8]
constexpr int RG_TOTAL = RG_CNT + MAX_ROUNDS * 8 * 4;  // i32 [1]
constexpr int MAX_SLOTS = 11;                  // 22 planes = 2.75 tiles
constexpr int MIN_SLOTS = 8;                   // two whole tiles (tile j + 1 while tile j is consumed)
constexpr int RG_BAR = RG_TOTAL + 16;          // u64 [MAX_SLOTS] full, then u64 [MAX_SLOTS] empty
constexpr int RG_ENT = RG_BAR + 16 * MAX_SLOTS;  // u32 [valid rows]
constexpr int SLOTB = 2 * PLANE;               // bytes per slot
static_assert(RG_P % 1024 == 0, "wgmma operand tiles start on 1024-byte boundaries");
static_assert(HS * OUT_STRIDE <= MIN_SLOTS * SLOTB, "out rows fit the slots");
// Offset of the slot ring for ktot index entries (1024-byte aligned).
__host__ __device__ constexpr int ring_offset(int ktot) { return (RG_ENT + 4 * (ktot > 0 ? ktot : 1) + 1023) / 1024 * 1024; }

constexpr int TRACE_SLOTS = 40;
// Phase timestamps of CTA (0, 0), thread 0: [0] start, [1] indices loaded, [2] compaction done,
// [3] end, [20 + j] tile j done (j < 16); two-stage kernel: [4 + j] rows of tile j arrived, tile
// 1: [36] S^T done, [37] softmax done (P^T written); ring kernel: [4 + j] tile j's scores staged
// and the next tile's first six planes in, tile 1: [36] softmax done, [37] products issued.
__device__ long long g_trace_heads[TRACE_SLOTS];

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
    // mode: bit 0 trace, bit 2 skip the gather (diagnostic; bit 1, skip the products, does not
    // apply: the products have no run-time conditions, which keeps them asynchronous).
    const bool skip_gather = mode & 4;
    const bool tracer = (mode & 1) && tid == 0 && blockIdx.x == 0 && blockIdx.y == 0;
    auto stamp = [&](int slot) {
        if (tracer) g_trace_heads[slot] = clock64();
    };
    grid_dep_wait();  // everything below may read what the previous kernel wrote
    grid_dep_launch();
    stamp(0);
    const int count = prologue(p, smem, SM_CNT, SM_TOTAL, SM_ENT, bar_full, bar_empty, 2, t, tid, lane, warp, [&]() {
        if (consumer) load_q_tile<HS, CONSUMERS>(p, t, h0, nh, tid, sbase + SM_Q, sbase + SM_SINK);
    }, stamp);
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
    // Per tile: wait for the rows, S^T, softmax, P.V, hand the stage back. (Measured slower,
    // round 6: the previous tile's P.V left in flight while this tile's rows are awaited and its
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
        softmax_tile(s_s, smem + SM_P, alpha_s, p.scale, nb, hw, rq, lane, m_run, den, [&](float) { return m_run; }, [](int, float) {});
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
    epilogue(p, o, m_run, den, reinterpret_cast<const float*>(smem + SM_SINK), reinterpret_cast<float*>(smem + SM_FAC), smem + SM_K,
             sbase + SM_K, t, h0, nh, count, hw, lane, w, tid);
    stamp(3);
}

// The ring kernel (bf16 rows, DSV41_SA_KERNEL_HEAD_SPLIT_RING): the row tiles in a ring
// of nslot (MIN_SLOTS .. MAX_SLOTS) slots of two planes (include/dsv41_sparse_attention_heads.cuh:
// TileSlots, produce_ring), so that tile j + 1 is resident while tile j is consumed and the
// producer still has 3 / 4 of a tile in flight. Per tile j (S^T of tile j complete on entry):
//   [wait for planes 0-5 of tile j + 1] stage S^T(j), barrier | S^T(j + 1) over planes 0-5 in
//   four chunks of 6 k-steps, one before and three inside softmax(j) (a wgmma issue stalls while
//   ~5 are queued; a zero that ptxas cannot prove carries a data dependency on the softmax into
//   each chunk, or ptxas hoists them) | barrier | [wait for planes 6-7 of tile j + 1] S^T(j + 1)
//   over them | rescale O, P.V(j) as four groups of two m-blocks (m-block mb reads only plane mb
//   of tile j), each slot of tile j handed back as its group completes.
// The last tile issues its "next" S^T on its own slots (results unused), so no product is
// conditional (ptxas would serialize them). Same products, same orders and the same softmax as
// the two-stage kernel: the outputs are bitwise the same (test
// head_split_ring_and_two_stage_loops_agree_bitwise). Measured: docs/perf.md "Round 9".
__global__ void __launch_bounds__(THREADS_ALL, 1) head_split_ring_kernel(const Dsv41SparseAttentionParams p, int mode, int nslot) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sbase = smem_addr(smem);
    if ((sbase & 1023u) != 0) __trap();  // the wgmma descriptors assume 1024-byte aligned tiles
    const uint32_t bar_full = sbase + RG_BAR, bar_empty = sbase + RG_BAR + 8 * MAX_SLOTS;
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const bool consumer = warp < CONSUMERS / 32;
    const int t = blockIdx.x, h0 = blockIdx.y * HS;
    const int nh = min(HS, p.num_heads - h0);
    const bool skip_gather = mode & 4;
    const bool tracer = (mode & 1) && tid == 0 && blockIdx.x == 0 && blockIdx.y == 0;
    auto stamp = [&](int slot) {
        if (tracer) g_trace_heads[slot] = clock64();
    };
    const uint32_t slots = sbase + ring_offset(p.kw + p.kc);
    grid_dep_wait();  // everything below may read what the previous kernel wrote
    grid_dep_launch();
    stamp(0);
    const int count = prologue(p, smem, RG_CNT, RG_TOTAL, RG_ENT, bar_full, bar_empty, nslot, t, tid, lane, warp, [&]() {
        if (consumer) load_q_tile<HS, CONSUMERS>(p, t, h0, nh, tid, sbase + SM_Q, sbase + RG_SINK);
    }, stamp);
    const int ntiles = (count + BLK - 1) / BLK;
    if (!consumer) {
        produce_ring(p, slots, nslot, reinterpret_cast<const uint32_t*>(smem + RG_ENT), count, bar_full, bar_empty, tid - CONSUMERS,
                     skip_gather);
        return;
    }
    stamp(2);
    const int g = lane >> 2, tq = lane & 3, w = warp;
    const int hw = 8 * w + (lane >> 2), rq = 16 * (lane & 3);
    float* s_s = reinterpret_cast<float*>(smem + RG_S);
    float* alpha_s = reinterpret_cast<float*>(smem + RG_ALPHA);
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run = M_FLOOR, den = 0.f;
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    // S^T k-step ks (plane ks / 4) of the tile at `ts`; `z` (0 at run time) carries a data
    // dependency on the softmax into the chunks issued inside it (ptxas would hoist them).
    auto s_step = [&](const TileSlots& ts, int ks, uint32_t z) {
        const uint32_t sub = (ks & 3) * 32, pl = ks >> 2;
        wg_m64n32k16<0, 0>(s, wg_desc(ts.addr(pl >> 1) + (pl & 1) * PLANE + sub + z, 16, 1024),
                           wg_desc(sbase + SM_Q + pl * (HS * 128) + sub, 16, 1024));
    };
    const uint32_t zmask = static_cast<uint32_t>(mode) & 256u;  // never set: 0, unknown to ptxas
    TileSlots cur;
    cur.slots = slots, cur.bar_full = bar_full, cur.nslot = nslot;
    cur.locate(0);
    if (ntiles > 0) {
#pragma unroll
        for (int pr = 0; pr < 4; ++pr) mbar_wait(cur.full(pr), cur.parity(pr));
    }
    cp_async_wait_all();  // this thread's q copies
    fence_proxy_async();  // q and the row tile (generic-proxy writes) are read by wgmma
    consumer_sync();
    // S^T of tile 0 (on uninitialised slots when there is no row: results unused).
    wg_fence_regs<16>(s);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) s_step(cur, ks, 0);
    wg_commit();
    wg_wait_all();
    wg_fence_regs<16>(s);
    for (int j = 0; j < ntiles; ++j) {
        const int nb = min(BLK, count - j * BLK);
        const bool more = j + 1 < ntiles;
        TileSlots nxt = cur;  // the last tile's "next" products read its own slots
        if (more) {
            nxt.advance();
#pragma unroll
            for (int pr = 0; pr < 3; ++pr) mbar_wait(nxt.full(pr), nxt.parity(pr));
        }
        fence_proxy_async();  // planes 0-5 of tile j + 1 are read by wgmma
        stage_scores(s, s_s, w, g, tq);
        consumer_sync();
        if (j < 16) stamp(4 + j);
        // S^T(j + 1) over planes 0-5 in four chunks of 6 k-steps: one now, three inside the
        // softmax (the issue of a wgmma stalls while ~5 are queued, so a chunk at a time).
        wg_fence_regs<16>(s);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 6; ++ks) s_step(nxt, ks, 0);
        softmax_tile(s_s, smem + RG_P, alpha_s, p.scale, nb, hw, rq, lane, m_run, den, [&](float) { return m_run; }, [&](int c, float v) {
            const uint32_t z = __float_as_uint(v) & zmask;  // the softmax work so far precedes the chunk
#pragma unroll
            for (int ks = 6 * c; ks < 6 * c + 6; ++ks) s_step(nxt, ks, z);
        });
        fence_proxy_async();  // the P^T tile is read by wgmma
        consumer_sync();
        if (j == 1) stamp(36);
        // S^T(j + 1), planes 6-7, then one group for all of S^T(j + 1).
        if (more) mbar_wait(nxt.full(3), nxt.parity(3));
        fence_proxy_async();
#pragma unroll
        for (int ks = 24; ks < 32; ++ks) s_step(nxt, ks, 0);
        wg_commit();
        rescale_o(o, alpha_s, tq);
        wg_fence_regs<128>(o);
        wg_fence();
        // P.V(j): four groups of two m-blocks (m-block mb reads plane mb only); each slot of tile
        // j goes back as its group completes (this warp's products; one arrival per warp). Pending
        // groups, oldest first: S^T(j + 1), PV 0, PV 1, ...
        auto pv_group = [&](int pr) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int kk = 0; kk < BLK / 16; ++kk)
                    wg_m64n32k16<1, 0>(o + 16 * (2 * pr + h), wg_desc(cur.addr(pr) + h * PLANE + kk * 16 * 128, PLANE, 1024),
                                       wg_desc(sbase + RG_P + kk * 32, 16, 1024));
            wg_commit();
        };
        auto hand_back = [&](int pr) {
            if (lane == 0) mbar_arrive(cur.full(pr) + 8 * MAX_SLOTS);
        };
        pv_group(0);
        pv_group(1);
        wg_wait<1>();
        hand_back(0);
        pv_group(2);
        wg_wait<1>();
        hand_back(1);
        pv_group(3);
        if (j == 1) stamp(37);
        wg_wait<1>();
        hand_back(2);
        wg_wait<0>();
        hand_back(3);
        wg_fence_regs<128>(o);
        wg_fence_regs<16>(s);
        cur = nxt;
        if (j < 16) stamp(20 + j);
    }
    epilogue(p, o, m_run, den, reinterpret_cast<const float*>(smem + RG_SINK), reinterpret_cast<float*>(smem + RG_FAC),
             smem + (slots - sbase), slots, t, h0, nh, count, hw, lane, w, tid);
    stamp(3);
}

// Prints the phase timestamps of CTA (0, 0) (synchronises the stream).
void print_trace(cudaStream_t stream, int dev, bool ring) {
    long long h[TRACE_SLOTS] = {};
    int khz = 0;
    if (cudaStreamSynchronize(stream) != cudaSuccess || cudaMemcpyFromSymbol(h, g_trace_heads, sizeof(h)) != cudaSuccess ||
        cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) != cudaSuccess || khz <= 0)
        return;
    const double us = 1e3 / khz;
    fprintf(stderr, "sparse_attention head-split%s trace (CTA 0): indices %.2f | compaction %.2f us", ring ? " ring" : "", (h[1] - h[0]) * us,
            (h[2] - h[0]) * us);
    long long prev = h[2];
    for (int j = 0; j < 16 && h[20 + j] > prev; ++j) {
        fprintf(stderr, " | tile%d %.2f (%s %.2f)", j, (h[20 + j] - prev) * us, ring ? "staged" : "wait", (h[4 + j] - prev) * us);
        prev = h[20 + j];
    }
    fprintf(stderr, " | epilogue %.2f | total %.2f us", (h[3] - prev) * us, (h[3] - h[0]) * us);
    if (h[37] > 0 && !ring)
        fprintf(stderr, " (tile1 after its rows: S^T %.2f, softmax %.2f, P.V %.2f us)", (h[36] - h[5]) * us, (h[37] - h[36]) * us,
                (h[21] - h[37]) * us);
    if (h[37] > 0 && ring)
        fprintf(stderr, " (tile1 after staged: softmax %.2f, issue %.2f, products+hand-back %.2f us)", (h[36] - h[5]) * us,
                (h[37] - h[36]) * us, (h[21] - h[37]) * us);
    fprintf(stderr, "\n");
}

}  // namespace heads

int launch_head_split(const Dsv41SparseAttentionParams& p, cudaStream_t stream, int mode, int dev, int max_smem) {
    using namespace heads;
    const int ktot = p.kw + p.kc;
    const bool bf16_src = p.window_format == DSV41_KV_BF16 && p.extra_format == DSV41_KV_BF16;
    if (bf16_src && p.kernel == DSV41_SA_KERNEL_HEAD_SPLIT_PINGPONG) {
        const int r = launch_head_split_pingpong(p, stream, mode, dev, max_smem);
        if (r != DSV41_ERR_SHAPE) return r;  // else too little shared memory for its slots: the two-stage kernel
    }
    // The ring kernel (the caller's choice, DSV41_SA_KERNEL_HEAD_SPLIT_RING) for bf16 rows where
    // at least MIN_SLOTS slots fit; otherwise the two-stage kernel (packed rows always: its producer
    // expands whole tiles).
    const bool bf16_rows = p.window_format == DSV41_KV_BF16 && p.extra_format == DSV41_KV_BF16;
    const int nslot = min(MAX_SLOTS, (max_smem - ring_offset(ktot)) / SLOTB);
    const bool ring = bf16_rows && p.kernel == DSV41_SA_KERNEL_HEAD_SPLIT_RING && nslot >= MIN_SLOTS;
    const size_t smem = ring ? static_cast<size_t>(ring_offset(ktot)) + static_cast<size_t>(nslot) * SLOTB
                             : SM_ENT + sizeof(uint32_t) * static_cast<size_t>(ktot > 0 ? ktot : 1);
    if (smem > static_cast<size_t>(max_smem)) return DSV41_ERR_SHAPE;
    static thread_local int configured_dev = -1;
    if (configured_dev != dev) {
        cudaError_t e = cudaFuncSetAttribute(head_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
        if (e == cudaSuccess) e = cudaFuncSetAttribute(head_split_ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
        if (e != cudaSuccess) return static_cast<int>(e);
        configured_dev = dev;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(p.num_tokens, (p.num_heads + HS - 1) / HS, 1);
    cfg.blockDim = dim3(THREADS_ALL, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (mode & 1) {
        void* buf = nullptr;
        if (cudaGetSymbolAddress(&buf, g_trace_heads) == cudaSuccess) cudaMemsetAsync(buf, 0, sizeof(long long) * TRACE_SLOTS, stream);
    }
    cudaError_t e = ring ? cudaLaunchKernelEx(&cfg, head_split_ring_kernel, p, mode & 7, nslot) : cudaLaunchKernelEx(&cfg, head_split_kernel, p, mode & 7);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e == cudaSuccess && (mode & 1)) print_trace(stream, dev, ring);
    return static_cast<int>(e);
}

}  // namespace dsv41_sa
