// sparse_attention_dimsplit: the dims-split pair decode kernel of the sparse attention with sink
// (kernels/sparse_attention.cu holds the launcher, the definition and the numerics). bf16 rows.
//
// Why. At B = 64 decode the all-heads kernel (one CTA per token) fills only half of the SMs and its
// split-KV merge is expensive; the head-split kernels (two CTAs per token, 32 heads each) fill
// them, but each of a token's two CTAs gathers every row, and the loop is bound by the bytes one SM
// can have in flight (~64 KB per ~1.5 us, measured on the H200). Here the token's two CTAs split
// the 512 dims instead: each gathers only its half of every row (512 B), so a row crosses L2 -> SM
// once per token and an SM moves half the bytes per tile; all 64 heads stay in one CTA, which keeps
// the efficient M = 64 heads shape of the all-heads products (S: m64n64, P.V: m64n256).
//
// Design. grid = (T, 2, ceil(H / 64)), clusters of 2 CTAs along y, 384 threads = 3 warpgroups, 1 CTA
// per SM (~200 KB shared memory at 640 indices). CTA (t, r, z) = rank r of the cluster owns dims
// [256 r, 256 r + 256) of q, of every row and of the output, for heads [64 z, 64 z + 64) of token t,
// and the softmax of half of the heads (the "own" heads: in the m64 fragment thread (w, g, tq) of a
// warpgroup holds heads 16 w + g (lo) and 16 w + g + 8 (hi); rank 0 owns the lo heads, rank 1 the
// hi heads).
//   1. Both CTAs compact the token's valid indices (the shared heads::compact_indices, warpgroups 0
//      and 1) while the q copies (64 heads x the CTA's 256 dims, 32 KB, four 64-dim planes) fly.
//   2. Warpgroup 2 produces (setmaxnreg 40): tile k (64 rows x 256 dims = 32 KB) -> ring slot
//      k % NS (NS = 4 at 640 indices) behind per-slot full / empty mbarriers, 16-byte cp.async;
//      tiles 0 and 1 from the raw window list while the consumers compact, when its first 128
//      entries are valid (as the ping-pong kernel).
//   3. Consumer warpgroups c = 0, 1 (setmaxnreg 232) take alternate tiles j = c, c + 2, ... (the
//      same tiles in both CTAs), each with its own O accumulator (64 heads x 256 dims, 128 f32 per
//      thread) and denominators. Per tile:
//        S partial = q[:, own dims] . K_j[:, own dims]^T (16 x m64n64k16, A = q and B = the slot,
//          both K-major, 128-byte swizzle); the values of the peer's heads go to the peer (4
//          st.async.v4 per thread into its exchange buffer, completing on its mbarrier), the peer's
//          partial of the own heads comes back the same way: s = own + peer (f32, exact sum of the
//          two 256-dim halves).
//        Softmax of the own head (16 rows per thread, the 4 lanes of a quad share a head): scale,
//          mask, max, m_new = max(m after tile j - 1 (from the other warpgroup, named barriers as in
//          the ping-pong kernel), tile max), alpha = e^{m_old - m_new} (m_old: this warpgroup's
//          previous tile), p = e^{l - m_new} summed into the head's denominator and rounded to bf16
//          into the warpgroup's P tile ([64 heads][64 rows], 128-byte swizzle); warp w's own heads
//          (16 w + 8 r .. +8: 1 KB of P rows, 32 B of alphas) go to the peer's P tile and alpha array
//          by two bulk copies from the warp's lane 0, completing on the peer's mbarrier, and the
//          peer's come back.
//        O = alpha O + P . V_j[:, own dims] (4 x m64n256k16, A = the P tile, B = the slot MN-major);
//          then the slot goes back to the producer.
//      Every exchange buffer of a warpgroup is written by the peer only after the peer received this
//      warpgroup's next message, which is sent after this warpgroup consumed the buffer: single
//      buffers, one mbarrier phase per tile, re-armed (arrive.expect_tx) right after each wait.
//   4. Merge and epilogue: O = fl(O_r + fl(O_s e^{m_s - M})) as the ping-pong kernel (O_r: the
//      warpgroup of the last tile, the receiver; O_s: the other, the sender). The receiver
//      publishes the token's running max M and its denominator right after its last softmax; the
//      sender, idle by then, computes for the CTA's own heads the merge scale sc = e^{m_s - M},
//      den = fl(den_r + fl(den_s sc)), the epilogue factor fl(1 / (den + e^{sink - M})) and the
//      lse, sends both factors to the peer (st.async) and hands its O_s chunks 0-15 (dims 0-127 of
//      its fragments) over through a free slot, all while the receiver's last P.V runs; the
//      receiver then hands over its chunks 16-31. Each warpgroup merges its half and stores out =
//      fl(O f) in bf16 straight from the fragments: the 4 lanes of a quad transpose their 4-byte
//      pieces of 4 chunks (quad_transpose) and each stores 16 bytes of two heads' rows.
// Numerics: p = e^{l - m_j} with m_j the running max after tile j (the reference's 64-row blocks),
// exactly as the ping-pong kernel: same p, same per-warpgroup O / den, same merge and factor
// formulas; only the f32 orders of the dot products (two 256-dim halves, each a tensor-core sum)
// and of the P.V sums differ.
// Code size. Straight-line code that runs once per CTA is bound by instruction fetch here (about
// 6 cycles per instruction), and so are branches over unused code: the compaction unrolled for 16
// index rounds cost ~1 us of the prologue at 640 indices (3 rounds), the zeroing of O ~0.3 us, the
// role selects of the epilogue ~0.5 us (measured on the H200 at B = 64). Hence the instantiations: R = 3
// index rounds for the V4.1 shape (R = 16 up to 4096 indices), DIAG for the diagnostics (the
// production kernel carries no trace or diagnostic code), the first P.V of each warpgroup setting O
// (accumulate = 0), one epilogue code path per role.
// Launch: programmatic dependent launch as the other kernels (nothing read before
// griddepcontrol.wait; the mbarriers are initialised and the cluster arrival made before it). A CTA
// leaves only after every remote store into it landed (it waits for all of them), and the peer's
// mbarriers are initialised before any remote store (a cluster barrier). Diagnostics (the DIAG
// instantiation, compiled only with the DSV41_SA_DIAG switch: include/dsv41_sparse_attention_common.cuh):
// mode bit 0 traces CTA (0, 0, 0) and every CTA's globaltimer (mode 32, TRACE=2: the 4th of 4
// back-to-back calls), mode 4 skips the gather, 64 the merge and epilogue (timing only), 8 the
// early window tiles (same results). (A mode 16, no running-max hand-over, measured no faster
// and is gone.)
// Measured (docs/perf.md "Sparse attention", H200, B = 64): 18.8-20.0 us called alone, median 19.0
// (the SM clock at ~1.6-1.75 GHz under this load), and 18.8-19.1 us right behind the indexer's
// top-k, against the ping-pong kernel's 25.9-26.5; B = 1 17.8-17.9 us. Auto's choice for bf16 rows
// and few tokens. Behind a top-k triggering at its start, the clusters launched early cost ~5 us
// (so the top-k triggers late: kernels/indexer_topk.cu). Tried and dropped: S of tile j + 2
// issued before the P.V of tile j (slower in-stream, no faster alone); 4-byte output stores
// without the transpose (+2.2 us).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "include/dsv41_hopper.cuh"
#include "include/dsv41_launch.cuh"
#include "include/dsv41_sparse_attention.h"
#include "include/dsv41_sparse_attention_common.cuh"
#include "include/dsv41_sparse_attention_heads.cuh"

namespace dsv41_sa {
namespace dsplit {

using namespace dsv41_ptx;
using heads::bar_arrive;
using heads::bar_sync;

constexpr int HH = 64;                  // heads per CTA
constexpr int DH = D / 2;               // dims per CTA
constexpr int NPL = DH / 64;            // 64-dim planes per CTA
constexpr int WGT = 128;                // threads of a warpgroup
constexpr int DS_THREADS = 2 * WGT + PROD_THREADS;
static_assert(2 * WGT == IDX_THREADS, "the consumers compact the indices");
constexpr int PROD_REGS = 40, MMA_REGS = 232;
static_assert(2 * WGT * MMA_REGS + PROD_THREADS * PROD_REGS <= 65536, "register file");
constexpr int SLOTB = NPL * PLANE;      // one half-row tile: 64 rows x 256 dims (32 KB)
constexpr int PTB = HH * 128;           // a P tile: bf16 [64 heads][64 rows]
constexpr int XSB = 4 * WGT * 16;       // a partial-score exchange buffer: float4 [4][128 threads]
constexpr int P_TX = 4 * 1024 + 32 * 4; // bytes the peer sends per tile into a P tile + alpha
constexpr int FIN_TX = 2 * 32 * 4;      // bytes of the peer's final factors

// Shared memory map (bytes); the slot ring follows the index entries.
constexpr int DS_Q = 0;                           // bf16 [4 planes][64 heads][128 B]
constexpr int DS_P = DS_Q + NPL * PLANE;          // [2 warpgroups] P tiles
constexpr int DS_XS = DS_P + 2 * PTB;             // [2 warpgroups] partial scores received
constexpr int DS_AL = DS_XS + 2 * XSB;            // f32 [2 warpgroups][64 heads]: alpha of the current tile
constexpr int DS_MX = DS_AL + 2 * HH * 4;         // f32 [2 tile parities][64 heads]: running max handed over
constexpr int DS_FIN = DS_MX + 2 * HH * 4;        // f32 [2][64 heads]: the sender's m, den (own heads)
constexpr int DS_FAC = DS_FIN + 2 * HH * 4;       // f32 [2][64 heads]: merge scale, epilogue factor (all heads)
constexpr int DS_CNT = DS_FAC + 2 * HH * 4;       // i32 [MAX_ROUNDS * 8]
constexpr int DS_TOTAL = DS_CNT + MAX_ROUNDS * 8 * 4;  // i32 [1]
constexpr int NS_MAX = 5, NS_MIN = 4;
// u64 mbarriers: full[NS_MAX], empty[NS_MAX], compaction done, xs[2], px[2], fin.
constexpr int DS_BAR = DS_TOTAL + 16;
constexpr int BAR_FULL = 0, BAR_EMPTY = 8 * NS_MAX, BAR_COUNT = 16 * NS_MAX, BAR_XS = BAR_COUNT + 8, BAR_PX = BAR_XS + 16,
              BAR_FIN = BAR_PX + 16;
constexpr int DS_ENT = DS_BAR + BAR_FIN + 8;      // u32 [valid rows]
static_assert(DS_P % 1024 == 0 && DS_XS % 1024 == 0, "wgmma operand tiles start on 1024-byte boundaries");
__host__ __device__ constexpr int ring_offset(int ktot) { return (DS_ENT + 4 * (ktot > 0 ? ktot : 1) + 1023) / 1024 * 1024; }
static_assert(ring_offset(640) + NS_MIN * SLOTB <= 227 * 1024, "four slots at V4.1-Flash's 640 indices");
static_assert(HH * DH * 2 == SLOTB, "the bf16 out rows fit a slot");
static_assert(HH * DH * 4 == 2 * SLOTB, "a warpgroup's raw O fits two slots");

// Named barriers (0: __syncthreads): 1 + c warpgroup c, BAR_BOTH the two consumers, BAR_MAX + c
// the running max handed over by warpgroup c, BAR_MERGE both halves of O handed over, BAR_PROD the
// producer warpgroup, BAR_FINL the receiver's running max and denominator for the sender.
constexpr int BAR_BOTH = 3, BAR_MAX = 4, BAR_MERGE = 6, BAR_PROD = 7, BAR_FINL = 8;

// The 4 x 4 transpose of 4-byte pieces within a quad (lanes 4 g + tq): lane tq holds v[i] = its
// piece of chunk i and gets back chunk tq's pieces of lanes 0-3, in lane order (two exchange
// rounds: 2 x 2 blocks between lanes tq, tq ^ 2, then single pieces between tq, tq ^ 1).
__device__ __forceinline__ uint4 quad_transpose(const uint32_t (&v)[4], int tq) {
    const bool b = tq & 2, a = tq & 1;
    // Round 1: keep chunks 2b, 2b + 1; the partner (tq ^ 2) sends its pieces of the same chunks.
    const uint32_t k0 = b ? v[2] : v[0], k1 = b ? v[3] : v[1];
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, b ? v[0] : v[2], 2), r1 = __shfl_xor_sync(0xffffffffu, b ? v[1] : v[3], 2);
    // Now chunk 2b: lanes tq (k0), tq ^ 2 (r0); chunk 2b + 1: k1, r1. Round 2: keep chunk 2b + a.
    const uint32_t own = a ? k1 : k0, own2 = a ? r1 : r0;
    const uint32_t q0 = __shfl_xor_sync(0xffffffffu, a ? k0 : k1, 1), q1 = __shfl_xor_sync(0xffffffffu, a ? r0 : r1, 1);
    // Chunk tq's pieces: lane tq -> own, tq ^ 1 -> q0, tq ^ 2 -> own2, tq ^ 3 -> q1; in lane order:
    // swap within the pairs when tq is odd, then the pairs when tq >= 2.
    const uint32_t p0 = a ? q0 : own, p1 = a ? own : q0, p2 = a ? q1 : own2, p3 = a ? own2 : q1;
    return b ? make_uint4(p2, p3, p0, p1) : make_uint4(p0, p1, p2, p3);
}

constexpr int DS_TRACE = 160;
// Phase timestamps of CTA (0, 0, 0), thread 0 of each consumer warpgroup (the later one where both
// write): [0] start (after griddepcontrol.wait), [155] index loads issued, [156] q copies issued,
// [1] indices loaded, [2] compaction done, [3] end, [4] halves handed over, [5] peer's factors
// received; tile j < 16: [8 + j] rows arrived, [24 + j] S done, [88 + j] partial sent, [40 + j]
// peer's partial received, [104 + j] running max received, [56 + j] P rows written and sent,
// [120 + j] warpgroup barrier, [136 + j] peer's P rows received, [72 + j] P.V done. Clock cycles,
// printed in us at the 1.98 GHz clock attribute; under load the SM clock is ~1.6-1.75 GHz (the
// print also gives the measured rate, from [152] / [153]).
__device__ long long g_trace_ds[DS_TRACE];
// Every CTA's globaltimer (ns) in a trace: [3 c] entry, [3 c + 1] after griddepcontrol.wait,
// [3 c + 2] end (thread 0), c = the CTA's linear index (< DS_CTA_TRACE); [152] / [153] of
// g_trace_ds hold CTA 0's globaltimer at stamps 0 / 3 (the clock calibration).
constexpr int DS_CTA_TRACE = 1024;
__device__ unsigned long long g_cta_ds[3 * DS_CTA_TRACE];
__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long v;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
    return v;
}

// R: the index rounds the compaction is unrolled for (Kw + Kc <= 256 R; see ValidIndicesR).
// DIAG: the diagnostics compiled in (the phase trace, mode bit 0, and the timing-only mode bits);
// the production instantiation carries none of their code (code size matters here: see the header).
template <int R, bool DIAG>
__global__ void __launch_bounds__(DS_THREADS, 1) dimsplit_kernel(const Dsv41SparseAttentionParams p, int mode, int nslot) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sbase = smem_addr(smem);
    if ((sbase & 1023u) != 0) __trap();  // the wgmma descriptors assume 1024-byte aligned tiles
    const uint32_t bars = sbase + DS_BAR;
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int wg = warp >> 2;  // 0, 1: consumers; 2: producer
    const int t = blockIdx.x, r = blockIdx.y, h0 = blockIdx.z * HH;
    const uint32_t peer = r ^ 1;
    const int nh = min(HH, p.num_heads - h0);
    const bool skip_gather = DIAG && (mode & 4);
    const bool tracer = DIAG && (mode & 1) && (tid & 127) == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
    auto stamp = [&](int s) {
        if (tracer) g_trace_ds[s] = clock64();
    };
    const uint32_t slots = sbase + ring_offset(p.kw + p.kc);
    const int cta = (blockIdx.z * 2 + blockIdx.y) * gridDim.x + blockIdx.x;
    const bool cta_tracer = DIAG && (mode & 1) && tid == 0 && cta < DS_CTA_TRACE;
    // The mbarriers and the cluster arrival before griddepcontrol.wait (shared memory only: under
    // programmatic dependent launch this overlaps the previous kernel's tail).
    if (tid == 0) {
        for (int k = 0; k < nslot; ++k) {
            mbar_init(bars + BAR_FULL + 8 * k, PROD_THREADS);  // one asynchronous arrival per producer thread
            mbar_init(bars + BAR_EMPTY + 8 * k, 4);           // one arrival per consumer warp
        }
        mbar_init(bars + BAR_COUNT, 1);
        for (int c = 0; c < 2; ++c) {  // one arrival (the arming) + the peer's bytes per phase
            mbar_init(bars + BAR_XS + 8 * c, 1);
            mbar_init(bars + BAR_PX + 8 * c, 1);
            mbar_arrive_expect_tx(bars + BAR_XS + 8 * c, XSB);
            mbar_arrive_expect_tx(bars + BAR_PX + 8 * c, P_TX);
        }
        mbar_init(bars + BAR_FIN, 1);
        mbar_arrive_expect_tx(bars + BAR_FIN, FIN_TX);
        fence_mbar_init_cluster();
    }
    cluster_arrive();  // (release) the mbarriers are initialised; waited for before the first remote store
    if (cta_tracer) g_cta_ds[3 * cta] = globaltimer();
    grid_dep_wait();  // everything below may read what the previous kernel wrote
    grid_dep_launch();
    if (cta_tracer) g_cta_ds[3 * cta + 1] = globaltimer();
    stamp(0);
    if (tracer && tid == 0) g_trace_ds[152] = static_cast<long long>(globaltimer());
    if (wg == 2) {
        // Producer: tile k -> slot k % nslot once its previous use was consumed.
        setmaxnreg_dec<PROD_REGS>();
        cluster_wait();
        const int ptid = tid - 2 * WGT, gr = ptid >> 3, q = ptid & 7;
        // Tile k (rows 64 k .. of the n entries ent) -> slot k % nslot, after its previous use.
        auto produce = [&](int k, const uint32_t* ent, int n) {
            const int s = k % nslot, u = k / nslot;
            if (u > 0) mbar_wait(bars + BAR_EMPTY + 8 * s, (u - 1) & 1);
            const int nb = min(BLK, n - k * BLK);
            const uint32_t dst = slots + static_cast<uint32_t>(s) * SLOTB;
#pragma unroll
            for (int lr = 0; lr < 4; ++lr) {
                const int row = lr * 16 + gr;
                const bool ok = row < nb;
                const __nv_bfloat16* src = ok ? row_ptr(p, ent[k * BLK + row]) + DH * r + q * 8 : static_cast<const __nv_bfloat16*>(p.q);
#pragma unroll
                for (int pl = 0; pl < NPL; ++pl)
                    if (!skip_gather) cp_async16_l2(dst + pl * PLANE + row * 128 + ((q ^ (row & 7)) << 4), src + (ok ? pl * 64 : 0), ok);
            }
            cp_async_mbar_arrive(bars + BAR_FULL + 8 * s);
        };
        // Early window tiles (as the ping-pong kernel): when the token's first 128 window entries
        // are all valid (the usual decode case) they are its first 128 compacted rows = tiles 0 and
        // 1, gathered from the raw list (kept in the last slot, first filled by tile nslot - 1 >= 3)
        // while the consumers compact.
        int k0 = 0;
        if (!(DIAG && (mode & 8)) && p.kw >= 2 * BLK) {
            uint32_t* win_s = reinterpret_cast<uint32_t*>(smem + (slots - sbase) + (nslot - 1) * SLOTB);
            if (heads::early_window_entries(p, t, ptid, win_s, BAR_PROD)) {
                produce(0, win_s, 2 * BLK);
                produce(1, win_s, 2 * BLK);
                k0 = 2;
            }
            bar_sync(BAR_PROD, PROD_THREADS);  // win_s read: its slot may be filled
        }
        mbar_wait(bars + BAR_COUNT, 0);  // the consumers' compaction: count and entries
        const int n = *reinterpret_cast<const int*>(smem + DS_TOTAL);
        const uint32_t* ent_s = reinterpret_cast<const uint32_t*>(smem + DS_ENT);
        const int ntiles = (n + BLK - 1) / BLK;
        for (int k = k0; k < ntiles; ++k) produce(k, ent_s, n);
        return;
    }
    // Consumers: the compaction while the q copies (this CTA's 256 dims of 64 heads) are in flight.
    const int count = heads::compact_indices<R>(p, smem, DS_CNT, DS_TOTAL, DS_ENT, t, tid, lane, warp, [&]() {
        stamp(155);
        const __nv_bfloat16* qt = static_cast<const __nv_bfloat16*>(p.q) + static_cast<int64_t>(t) * p.q_token_stride + DH * r;
#pragma unroll 1
        for (int i = 0; i < HH * 32 / (2 * WGT); ++i) {  // (a loop: run-once code is fetch bound)
            const int c = tid + 2 * WGT * i, h = c >> 5, ch = c & 31;  // chunk ch (8 dims) of head h
            const bool ok = h < nh;
            cp_async16(sbase + DS_Q + (ch >> 3) * PLANE + h * 128 + (((ch & 7) ^ (h & 7)) << 4),
                       qt + (ok ? static_cast<int64_t>(h0 + h) * p.q_head_stride + ch * 8 : 0), ok);
        }
        cp_async_commit();
        stamp(156);
    }, [] { bar_sync(BAR_BOTH, 2 * WGT); }, stamp);
    bar_sync(BAR_BOTH, 2 * WGT);  // ent_s complete
    if (tid == 0) mbar_arrive(bars + BAR_COUNT);  // (release) to the producer
    const int ntiles = (count + BLK - 1) / BLK;
    setmaxnreg_inc<MMA_REGS>();
    stamp(2);
    const int c = wg, ctid = tid & 127, w = warp & 3, g = lane >> 2, tq = lane & 3;
    const int hlo = 16 * w + g, hd = hlo + 8 * r, hp = hlo + 8 * (r ^ 1);  // fragment heads: own, peer's
    const float sink_h = __ldg(p.sink + h0 + min(hd, nh - 1));
    const uint32_t p_tile = sbase + DS_P + c * PTB;
    unsigned char* p_s = smem + DS_P + c * PTB;
    const float4* xs_s = reinterpret_cast<const float4*>(smem + DS_XS + c * XSB);
    float* al_s = reinterpret_cast<float*>(smem + DS_AL) + c * HH;
    float* mx_s = reinterpret_cast<float*>(smem + DS_MX);
    float* fin_s = reinterpret_cast<float*>(smem + DS_FIN);
    float* fac_s = reinterpret_cast<float*>(smem + DS_FAC);
    const uint32_t bar_xs = bars + BAR_XS + 8 * c, bar_px = bars + BAR_PX + 8 * c, bar_fin = bars + BAR_FIN;
    // The peer's copies of this warpgroup's exchange buffers and barriers.
    const uint32_t xs_peer = mapa_shared(sbase + DS_XS + c * XSB, peer), bar_xs_peer = mapa_shared(bar_xs, peer);
    const uint32_t p_peer = mapa_shared(p_tile, peer), bar_px_peer = mapa_shared(bar_px, peer);
    const uint32_t al_peer = mapa_shared(sbase + DS_AL + 4 * c * HH, peer);
    // O: set by the first P.V of this warpgroup (accumulate = 0: no zeroing in the prologue's
    // straight-line code), zero when the token has no tile at all.
    float acc[128];
    if (ntiles == 0) {
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    }
    float m_run = M_FLOOR, den = 0.f;  // running max after this warpgroup's last tile, its denominator (own head)
    cp_async_wait_all();  // this thread's q copies
    fence_proxy_async();  // q is read by wgmma
    bar_sync(BAR_BOTH, 2 * WGT);  // all of q
    cluster_wait();  // the peer's mbarriers are initialised
    const float scale = p.scale;
    int it = 0;  // this warpgroup's tile count (exchange barrier phases)
    for (int j = c; j < ntiles; j += 2, ++it) {
        const int s_idx = j % nslot;
        const uint32_t slot = slots + static_cast<uint32_t>(s_idx) * SLOTB;
        mbar_wait(bars + BAR_FULL + 8 * s_idx, (j / nslot) & 1);
        fence_proxy_async();  // the row tile (cp.async writes) is read by wgmma
        bar_sync(1 + c, WGT);
        if (j < 16) stamp(8 + j);
        // S partial over this CTA's 256 dims (A = q, B = the slot, both K-major).
        float s[32];
#pragma unroll
        for (int ks = 0; ks < DH / 16; ++ks) {
            const uint32_t off = (ks >> 2) * PLANE + (ks & 3) * 32;
            wg_m64n64k16(s, wg_desc(sbase + DS_Q + off, 16, 1024), wg_desc(slot + off, 16, 1024), ks > 0);
        }
        wg_commit();
        wg_wait<0>();
        wg_fence_regs<32>(s);
        if (j < 16) stamp(24 + j);
        // The peer's heads' partials to the peer; the peer's partials of the own heads back.
        // (Values by static index and a select on the rank: a run-time index would put s in local
        // memory.) x[2 i + e] = row 8 i + 2 tq + e of head hd.
        float x[16], y[16];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                x[2 * i + e] = r == 0 ? s[4 * i + e] : s[4 * i + 2 + e];
                y[2 * i + e] = r == 0 ? s[4 * i + 2 + e] : s[4 * i + e];
            }
#pragma unroll
        for (int k = 0; k < 4; ++k)
            st_async_v4(xs_peer + (k * WGT + ctid) * 16, make_float4(y[4 * k], y[4 * k + 1], y[4 * k + 2], y[4 * k + 3]), bar_xs_peer);
        if (j < 16) stamp(88 + j);
        mbar_wait_cluster(bar_xs, it & 1);
        if (ctid == 0) mbar_arrive_expect_tx(bar_xs, XSB);  // the next phase (the peer sends after this warpgroup's next P)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float4 v = xs_s[k * WGT + ctid];
            x[4 * k] += v.x;
            x[4 * k + 1] += v.y;
            x[4 * k + 2] += v.z;
            x[4 * k + 3] += v.w;
        }
        if (j < 16) stamp(40 + j);
        // Softmax of the own head hd: x[2 i + e] = row 8 i + 2 tq + e.
        const int nb = min(BLK, count - j * BLK);
        if (nb == BLK && hd < nh) {  // a full tile (the usual case): no mask
#pragma unroll
            for (int k = 0; k < 16; ++k) x[k] = __fmul_rn(scale, x[k]);
        } else {
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                const bool ok = hd < nh && 8 * (k >> 1) + 2 * tq + (k & 1) < nb;
                x[k] = ok ? __fmul_rn(scale, x[k]) : -INFINITY;
            }
        }
        // The tile max as a tree (exact in any order; depth 4 instead of a chain of 16).
        float m8[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) m8[k] = fmaxf(x[2 * k], x[2 * k + 1]);
#pragma unroll
        for (int k = 0; k < 4; ++k) m8[k] = fmaxf(m8[k], m8[k + 4]);
        float mx = fmaxf(fmaxf(m8[0], m8[2]), fmaxf(m8[1], m8[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // The running max after tile j - 1 (the other warpgroup's), read before this tile's is
        // published (as the ping-pong kernel: no buffer is overwritten before it was read).
        float prev = M_FLOOR;
        if (j > 0) {
            bar_sync(BAR_MAX + (c ^ 1), 2 * WGT);
            prev = mx_s[((j - 1) & 1) * HH + hd];
        }
        if (j + 1 < ntiles) {
            if (tq == 0) mx_s[(j & 1) * HH + hd] = fmaxf(prev, mx);
            bar_arrive(BAR_MAX + c, 2 * WGT);
        }
        if (j < 16) stamp(104 + j);
        const float mn = fmaxf(prev, mx);
        const float alpha = expf(m_run - mn);
        m_run = mn;
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float e0 = expf(x[2 * i] - mn), e1 = expf(x[2 * i + 1] - mn);
            sum += e0;
            sum += e1;
            // rows 8 i + 2 tq, + 1 of head hd: chunk i of its 128-byte row
            *reinterpret_cast<uint32_t*>(p_s + sw128(hd, i) + tq * 4) = pack_bf16x2_rn(e0, e1);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        den = __fadd_rn(__fmul_rn(den, alpha), sum);
        if (tq == 0) al_s[hd] = alpha;
        if (j >= 1 && j == ntiles - 1) {
            // The last tile (this warpgroup receives the merge): the token's running max and this
            // warpgroup's denominator of the own head, for the other warpgroup's factors (computed
            // while this tile's P.V runs).
            if (tq == 0) fin_s[hd] = m_run, fin_s[HH + hd] = den;
            bar_arrive(BAR_FINL, 2 * WGT);
        }
        // Warp w wrote the P rows and alphas of its own heads 16 w + 8 r .. +8: its lane 0 copies
        // them (1 KB, 32 B) to the peer at once; the warpgroup barrier below only guards the P.V.
        fence_proxy_async();  // the P tile is read by wgmma and by the bulk copies
        __syncwarp();
        if (lane == 0) {
            const uint32_t off = (16 * w + 8 * r) * 128, aoff = 4 * (16 * w + 8 * r);
            bulk_copy_to_cluster(p_peer + off, p_tile + off, 1024, bar_px_peer);
            bulk_copy_to_cluster(al_peer + aoff, sbase + DS_AL + 4 * c * HH + aoff, 32, bar_px_peer);
        }
        if (j < 16) stamp(56 + j);
        bar_sync(1 + c, WGT);
        if (j < 16) stamp(120 + j);
        mbar_wait_cluster(bar_px, it & 1);  // the peer's rows of the P tile and its alpha
        if (ctid == 0) mbar_arrive_expect_tx(bar_px, P_TX);
        if (j < 16) stamp(136 + j);
        if (it > 0) {
            // O rescale (acc[4 i + e]: head hlo + 8 (e / 2); the own head is hlo + 8 r), skipped where
            // the warp's alphas are all 1 (exact).
            const float a_peer = al_s[hp];
            const float alo = r == 0 ? alpha : a_peer, ahi = r == 0 ? a_peer : alpha;
            if (!__all_sync(0xffffffffu, alo == 1.f && ahi == 1.f)) {
#pragma unroll
                for (int i = 0; i < 32; ++i) acc[4 * i] *= alo, acc[4 * i + 1] *= alo, acc[4 * i + 2] *= ahi, acc[4 * i + 3] *= ahi;
            }
        }
        wg_fence_regs<128>(acc);
        wg_fence();
        // O += P . V (rows past the tile's end: p = 0 and zero-filled rows).
#pragma unroll
        for (int kk = 0; kk < BLK / 16; ++kk)
            wg_m64n256k16_kmn(acc, wg_desc(p_tile + kk * 32, 16, 1024), wg_desc(slot + kk * 16 * 128, PLANE, 1024), it > 0 || kk > 0);
        wg_commit();
        wg_wait<0>();
        wg_fence_regs<128>(acc);
        if (lane == 0) mbar_arrive(bars + BAR_EMPTY + 8 * s_idx);
        if (j < 16) stamp(72 + j);
    }
    if (DIAG && (mode & 64)) {  // diagnostic: no merge / epilogue (timing only, out and lse not written)
        if (cta_tracer) g_cta_ds[3 * cta + 2] = globaltimer();
        return;
    }
    // Merge. The warpgroup of the last tile (receiver) holds O_r, the other (sender) O_s, each over
    // all 64 heads x 256 dims; the sums fl(O_r + fl(O_s sc)) are split between them by dims: the
    // sender writes its chunks 0-15 (dims 0-127 of its fragments) into slot sa, the receiver its
    // chunks 16-31 into slot sb, each then merges the other half. sa, sb: the sender's own slots of
    // tiles n - 2 and n - 4 (or the never-used last slot): no later tile reuses them.
    // The factors go first (their cluster round trip then overlaps the O hand-over): the sender
    // publishes its (m, den) of the own heads, the receiver computes the own heads' merge scale and
    // epilogue factor and sends them to the peer before it writes its half of O.
    const int recv = ntiles > 0 ? (ntiles - 1) & 1 : 0;
    const bool pair = ntiles >= 2;  // both warpgroups had tiles
    if (c != recv && !pair) return;  // (ntiles <= 1: warpgroup 1 had no tile)
    const int sa = pair ? (ntiles - 2) % nslot : 0, sb = ntiles >= 4 ? (ntiles - 4) % nslot : nslot - 1;
    auto o_chunk = [&](int slot, int k) {  // float4 k % 16 (acc[4 k .. +4]) of thread ctid in a slot
        return reinterpret_cast<float4*>(smem + (slots - sbase) + slot * SLOTB + ((k & 15) * WGT + ctid) * 16);
    };
    // The own head's epilogue factor (as the head-split epilogue) and lse from the token's running
    // max M and denominator; both factors of the own heads (merge scale, epilogue factor) to fac_s
    // and to the peer's (st.async).
    auto factors = [&](float M, float den_t, float sc) {
        if (tq == 0) {
            const heads::HeadFactor f = heads::head_factor(M, den_t, sink_h);
            if (hd < nh) p.lse[static_cast<int64_t>(t) * p.num_heads + h0 + hd] = heads::head_lse(f, count > 0);
            fac_s[hd] = sc;
            fac_s[HH + hd] = f.fac;
            const uint32_t fp = mapa_shared(sbase + DS_FAC + 4 * hd, peer), bp = mapa_shared(bar_fin, peer);
            st_async_b32(fp, __float_as_uint(sc), bp);
            st_async_b32(fp + 4 * HH, __float_as_uint(f.fac), bp);
        }
    };
    if (!pair) {
        factors(m_run, den, 0.f);
        bar_sync(1 + c, WGT);  // the factors of the own heads (local stores)
    } else if (c != recv) {
        // The sender, while the receiver's last P.V runs: the merge scale sc = e^{m_s - M} of the own
        // head, den = fl(den_r + fl(den_s sc)), the factors (to the peer as well); its chunks 0-15 of
        // O_s to slot sa for the receiver.
        bar_sync(BAR_FINL, 2 * WGT);  // M and den_r of the own head
        const float sc = expf(m_run - fin_s[hd]);
        factors(fin_s[hd], __fadd_rn(fin_s[HH + hd], __fmul_rn(den, sc)), sc);
#pragma unroll
        for (int k = 0; k < 16; ++k) *o_chunk(sa, k) = make_float4(acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]);
        bar_sync(BAR_MERGE, 2 * WGT);  // the receiver's chunks 16-31 in slot sb
    } else {
        // The receiver: its chunks 16-31 to slot sb for the sender.
#pragma unroll
        for (int k = 0; k < 16; ++k) *o_chunk(sb, k) = make_float4(acc[4 * (16 + k)], acc[4 * (16 + k) + 1], acc[4 * (16 + k) + 2], acc[4 * (16 + k) + 3]);
        bar_sync(BAR_MERGE, 2 * WGT);  // the sender's chunks 0-15 in slot sa, both factors of the own heads in fac_s
    }
    stamp(4);
    mbar_wait_cluster(bar_fin, 0);  // the peer's factors of its own heads
    stamp(5);
    const float sc_lo = fac_s[hlo], sc_hi = fac_s[hlo + 8], f_lo = fac_s[HH + hlo], f_hi = fac_s[HH + hlo + 8];
    // out = fl(fl(O_r + fl(O_s sc)) f) in bf16, stored from the fragments: per 4 chunks, the 4 lanes of
    // a quad transpose their 4-byte pieces (quad_transpose) so that each stores one 16-byte chunk of
    // head hlo and one of head hlo + 8.
    __nv_bfloat16* orow = static_cast<__nv_bfloat16*>(p.out) + (static_cast<int64_t>(t) * p.num_heads + h0) * D + DH * r;
    // Chunks [K0, K0 + 16) with compile-time indices (a run-time range would issue all 32 chunks'
    // instructions, predicated); ROLE 0: no merge (one warpgroup had all tiles), 1: the receiver
    // (own values O_r, the sender's O_s in slot sa), 2: the sender (own O_s, the receiver's O_r in sb).
    auto store = [&](auto k0c, auto rolec) {
        constexpr int K0 = decltype(k0c)::value, ROLE = decltype(rolec)::value;
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            uint32_t lo[4], hi[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int k = K0 + 4 * a + i;
                float v[4] = {acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]};
                if (ROLE != 0) {  // fl(O_r + fl(O_s sc))
                    const float4 o2 = *o_chunk(ROLE == 1 ? sa : sb, k);
                    const float w[4] = {o2.x, o2.y, o2.z, o2.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float sce = e < 2 ? sc_lo : sc_hi;
                        v[e] = ROLE == 1 ? __fadd_rn(v[e], __fmul_rn(w[e], sce)) : __fadd_rn(w[e], __fmul_rn(v[e], sce));
                    }
                }
                // acc[4 k + e]: head hlo + 8 (e / 2), dims 8 k + 2 tq + e % 2 (chunk k of the 256 dims)
                lo[i] = pack_bf16x2_rn(__fadd_rn(0.f, __fmul_rn(v[0], f_lo)), __fadd_rn(0.f, __fmul_rn(v[1], f_lo)));
                hi[i] = pack_bf16x2_rn(__fadd_rn(0.f, __fmul_rn(v[2], f_hi)), __fadd_rn(0.f, __fmul_rn(v[3], f_hi)));
            }
            const uint4 wlo = quad_transpose(lo, tq), whi = quad_transpose(hi, tq);
            const int ch = K0 + 4 * a + tq;  // the chunk this lane stores
            if (hlo < nh) *reinterpret_cast<uint4*>(orow + static_cast<int64_t>(hlo) * D + ch * 8) = wlo;
            if (hlo + 8 < nh) *reinterpret_cast<uint4*>(orow + static_cast<int64_t>(hlo + 8) * D + ch * 8) = whi;
        }
    };
    using I0 = std::integral_constant<int, 0>;
    using I16 = std::integral_constant<int, 16>;
    if (!pair) {
        store(I0{}, I0{});
        store(I16{}, I0{});
    } else if (c == recv) {
        store(I0{}, std::integral_constant<int, 1>{});
    } else {
        store(I16{}, std::integral_constant<int, 2>{});
    }
    stamp(3);
    if (tracer && tid == 0) g_trace_ds[153] = static_cast<long long>(globaltimer());
    if (cta_tracer) g_cta_ds[3 * cta + 2] = globaltimer();
}

// Diagnostics (DIAG instantiation): prints the phase timestamps of CTA (0, 0, 0) (synchronises the stream).
void print_trace_dimsplit(cudaStream_t stream, int dev) {
    long long h[DS_TRACE] = {};
    const int khz = dsv41_launch::read_trace(g_trace_ds, h, sizeof(h), stream, dev);
    if (khz == 0) return;
    const double us = 1e3 / khz;
    auto at = [&](int i) { return (h[i] - h[0]) * us; };
    fprintf(stderr, "sparse_attention dims-split pair trace (CTA 0): indices %.2f | compaction %.2f us", at(1), at(2));
    int n = 0;
    while (n < 16 && h[72 + n] > 0) ++n;
    for (int j = 0; j < n; ++j)
        fprintf(stderr, " | t%d rows@%.2f S %.2f send %.2f xs %.2f max %.2f P+send %.2f bar %.2f px %.2f PV %.2f", j, at(8 + j), at(24 + j) - at(8 + j),
                at(88 + j) - at(24 + j), at(40 + j) - at(88 + j), at(104 + j) - at(40 + j), at(56 + j) - at(104 + j), at(120 + j) - at(56 + j),
                at(136 + j) - at(120 + j), at(72 + j) - at(136 + j));
    if (n > 0) fprintf(stderr, " | loop %.2f us (%.2f per tile)", at(72 + n - 1) - at(2), (at(72 + n - 1) - at(2)) / n);
    fprintf(stderr, " | merge @%.2f | factors @%.2f | end %.2f us", at(4), at(5), at(3));
    fprintf(stderr, " | prologue: loads issued %.2f, q issued %.2f", at(155), at(156));
    if (h[153] > h[152] && h[3] > h[0])
        fprintf(stderr, " | CTA 0 SM clock %.0f MHz (span %.2f us by globaltimer)", (h[3] - h[0]) * 1e3 / static_cast<double>(h[153] - h[152]),
                (h[153] - h[152]) * 1e-3);
    fprintf(stderr, "\n");
}

// Prints every CTA's globaltimer spread (ns relative to the earliest entry): entry, wait exit, end.
void print_cta_trace_dimsplit(int ctas) {
    const int n = ctas < DS_CTA_TRACE ? ctas : DS_CTA_TRACE;
    if (n <= 0) return;
    std::vector<unsigned long long> h(3 * static_cast<size_t>(n));
    if (cudaMemcpyFromSymbol(h.data(), g_cta_ds, sizeof(unsigned long long) * h.size()) != cudaSuccess) return;
    unsigned long long e0 = ~0ull;
    for (int c = 0; c < n; ++c) e0 = h[3 * c] < e0 ? h[3 * c] : e0;
    // Columns: entry, wait exit, end, span (end - wait exit), us from the earliest entry.
    std::vector<double> v[4];
    for (int c = 0; c < n; ++c) {
        for (int k = 0; k < 3; ++k) v[k].push_back(static_cast<double>(h[3 * c + k] - e0) * 1e-3);
        v[3].push_back(v[2][c] - v[1][c]);
    }
    fprintf(stderr, "  dims-split CTAs (%d, us from the first entry):", n);
    const char* what[4] = {"entry", "wait exit", "end", "span"};
    for (int k = 0; k < 4; ++k) {
        std::vector<double>& a = v[k];
        std::sort(a.begin(), a.end());
        fprintf(stderr, " | %s min %.2f med %.2f p90 %.2f max %.2f", what[k], a[0], a[n / 2], a[(9 * n) / 10], a[n - 1]);
    }
    fprintf(stderr, "\n");
}

}  // namespace dsplit

int launch_dimsplit_pair(const Dsv41SparseAttentionParams& p, cudaStream_t stream, int dev, int max_smem) {
    using namespace dsplit;
    const int ktot = p.kw + p.kc;
    const int nslot = min(NS_MAX, (max_smem - ring_offset(ktot)) / SLOTB);
    if (nslot < NS_MIN) return DSV41_ERR_SHAPE;
    const size_t smem = static_cast<size_t>(ring_offset(ktot)) + static_cast<size_t>(nslot) * SLOTB;
    const bool few = fits_few_rounds(ktot);
    // Diagnostic bits (0 without the DSV41_SA_DIAG switch). Mode 32 (DSV41_SPARSE_ATTENTION_TRACE=2):
    // record the trace without clearing or synchronising, and print it after every 4th such launch
    // (back-to-back calls).
    int mode = diagnostic_mode();
    static thread_local int b2b_calls = 0;
    const bool b2b = mode & 32, b2b_print = b2b && ++b2b_calls % 4 == 0;
    if (b2b) mode |= 1;
    // A call with diagnostic bits runs the DIAG instantiation.
    const bool diag = (mode & 77) != 0;
    auto* kernel = few ? (diag ? dimsplit_kernel<FEW_ROUNDS, DIAG_BUILD> : dimsplit_kernel<FEW_ROUNDS, false>)
                       : (diag ? dimsplit_kernel<MAX_ROUNDS, DIAG_BUILD> : dimsplit_kernel<MAX_ROUNDS, false>);
    static thread_local int configured_dev[4] = {-1, -1, -1, -1};
    cudaError_t e = dsv41_launch::set_max_dynamic_smem(kernel, dev, max_smem, configured_dev[2 * diag + few]);
    if (e != cudaSuccess) return static_cast<int>(e);
    if ((mode & 1) && !b2b) dsv41_launch::clear_trace(g_trace_ds, sizeof(long long) * DS_TRACE, stream);
    // Programmatic dependent launch as the other kernels (measured: behind a top-k that triggered its
    // dependents at its start the early-launched clusters cost ~5 us, so the top-k now triggers late).
    e = dsv41_launch::launch_pdl(kernel, dim3(p.num_tokens, 2, (p.num_heads + HH - 1) / HH), dim3(DS_THREADS, 1, 1), smem, stream,
                                 2, p, mode & 77, nslot);
    if (e == cudaSuccess && (mode & 1) && (!b2b || b2b_print)) {
        print_trace_dimsplit(stream, dev);
        print_cta_trace_dimsplit(p.num_tokens * 2 * ((p.num_heads + HH - 1) / HH));
    }
    return static_cast<int>(e);
}

}  // namespace dsv41_sa
