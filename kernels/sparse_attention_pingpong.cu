// sparse_attention_pingpong: the head-split decode kernel with ping-pong consumers on a slot ring
// (kernels/sparse_attention.cu holds the launcher, the definition and the numerics;
// kernels/sparse_attention_heads.cu the head-split design this kernel shares: 32 heads per CTA
// over all of the token's valid rows, rows as the wgmma M dimension, the same Sᵀ / Oᵀ products,
// softmax and epilogue steps from include/dsv41_sparse_attention_heads.cuh). bf16 rows only.
//
// Design. grid = (T, ceil(H / 32)), 384 threads = 3 warpgroups, 1 CTA per SM (227 KB shared memory
// at 640 indices). Warpgroups 0 and 1 (consumers A and B) compact the token's valid indices and copy
// q (32 heads x 512; the sink goes to registers); warpgroup 2 is the producer (setmaxnreg down to
// 40 registers, the consumers up to 232): it gathers the row tiles into a ring of 8-11 slots of two
// 64-dim planes (16 KB; 11 = 2.75 tiles at 640 indices) behind per-slot full / empty mbarriers
// (TileSlots / produce_ring of the heads header), so that tiles j and j + 1 are resident while the
// next refills. Early window tiles: while the consumers compact, the producer loads the token's
// first 128 window entries itself; if all are valid (the usual decode case) they are the first
// 128 compacted rows, and it gathers tiles 0 and 1 from them at once (ring positions 0-7), then
// waits for the compaction (an mbarrier: consumer thread 0 arrives after the consumers' barrier
// that follows the entries' stores) and continues from position 8; otherwise from position 0.
// Consumer c takes the tiles j = c, c + 2, ... (alternate tiles), with its own Oᵀ accumulator
// (128 f32 registers per thread), denominator, Sᵀ staging and Pᵀ tile; per tile:
//   wait for the tile's four slots | Sᵀ = K . qᵀ (32 x m64n32k16) | stage Sᵀ | softmax with the
//   running max handed over by the other consumer | rescale O | P.V (four groups of two m-blocks,
//   each slot handed back to the producer as its group completes).
// While one consumer runs its softmax the other's products run (different warps issue: within
// one warpgroup a warp's wgmma issue stalls while ~5 are queued, so its softmax could not overlap
// them: issuing the next tile's 24 m64n32k16 before the softmax made it 0.80 us instead of 0.43).
// The chain: tile j's softmax needs the running max after tile j - 1, which the other consumer
// computed; consumer c writes m_j (32 floats, one buffer per tile parity) and arrives on named
// barrier 4 + c (256 threads: its 128 arrive, the other's 128 wait there before reading). A
// consumer reads m_{j-1} before it publishes m_j, so the other cannot overwrite the buffer it
// reads, and no barrier phase is arrived at twice before it is waited on.
// The last tile publishes nothing (nobody waits).
// End: the consumer of the last tile (the receiver) merges: the other (sender, last tile n - 2)
// writes its raw O into the four slots of its last tile (free: no later ring position reuses them
// with >= 8 slots; a conflict-free [m-block][4 floats][thread] layout) and its per-head (m, den),
// arrives on barrier 6; the receiver waits there and adds fl(O_s e^{m_s - M}) to its own O and
// fl(den_s e^{m_s - M}) to its den (M = its running max = the token's), then runs the shared
// epilogue (factor fl(1 / (den + e^{sink - M})), lse, stmatrix .trans into [head][dim] rows over
// the slots, 16-byte stores). With one tile consumer B has nothing and exits; with none consumer A
// writes the zero rows and -inf lse.
// Numerics: p = e^{l - m_j} with m_j the running max after tile j, exactly as the one-split
// kernels (the reference's 64-row blocks, p rounded to bf16 relative to the block's running max);
// only f32 summation orders differ from HeadSplit: each consumer's O and den cover its own tiles
// and are rescaled by e^{m_(its previous tile) - m_j}, and the two are summed once at the end.
// Checked against the CPU reference at the head-split tests' strict tolerance (with at most one
// tile per token the result is bitwise the two-stage kernel's: consumer B then has no tile).
// Launch: programmatic dependent launch as the other kernels (nothing read before
// griddepcontrol.wait). Diagnostics (the DIAG instantiation, compiled only with the DSV41_SA_DIAG
// switch: include/dsv41_sparse_attention_common.cuh): mode bit 0 traces CTA (0, 0) (per tile the
// rows' arrival, Sᵀ, the hand-over wait, softmax, P.V; the early tiles, the merge and the
// epilogue), bit 2 skips the gather (timing only), bit 3 the early window tiles (same results).
// Measured on the H200 when it was built (B = 64, both loops ~25 us standalone): 0.35-0.65 us
// under the two-stage loop standalone, ~7 us under it in-stream behind the top-k. The loop is
// bound by the row supply (each consumer waits 1.2-1.8 us per tile for its rows: the token's two
// CTAs each pull every row from L2), not by the products or the softmax; without the gather the
// kernel takes 21.6 us at B = 64.
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

constexpr int PP_THREADS = 2 * CONSUMERS + PROD_THREADS;  // consumers A, B, then the producer
static_assert(2 * CONSUMERS == IDX_THREADS, "the consumers compact the indices");
constexpr int PP_PROD_REGS = 40;   // the producer's registers after setmaxnreg
constexpr int PP_MMA_REGS = 232;   // the consumers'
static_assert(2 * CONSUMERS * PP_MMA_REGS + PROD_THREADS * PP_PROD_REGS <= 65536, "register file");

// Shared memory map (bytes); the slot ring follows the index entries. Tight enough for 11 slots
// (2.75 tiles) at 640 indices: each consumer's block holds its Sᵀ staging tile (8 KB, s_swz), and
// in it, once the softmax has read the scores (a barrier of the warpgroup), its Pᵀ tile (first
// 4 KB) and per-head floats (alpha; after the loop the sender's m / den and the epilogue's factors);
// the index counts of the compaction live in consumer A's block, the sink in registers, the raw
// window entries of the early tiles in the last slot (first filled at position nslot - 1 >= 8).
constexpr int PP_Q = 0;                           // bf16 [8 planes][32 heads][128 B]
constexpr int PP_CB = PP_Q + HS * D * 2;          // [2 consumers] 8 KB blocks:
constexpr int CB_P = 0;                           //   bf16 [32 heads][64 rows], 128-byte swizzle (over Sᵀ heads 0-15)
constexpr int CB_ALPHA = HS * BLK * 2;            //   f32 [32 heads]: O rescale (merge: the sender's scale)
constexpr int CB_FIN = CB_ALPHA + HS * 4;         //   f32 [2][32 heads]: the sender's m, den (after its loop)
constexpr int CB_FAC = CB_FIN + 2 * HS * 4;       //   f32 [32 heads]: epilogue factors (the receiver's)
constexpr int PP_CNT = PP_CB;                     // i32 [MAX_ROUNDS * 8] (prologue, over consumer A's block)
constexpr int PP_MX = PP_CB + 2 * S_BYTES;        // f32 [2 tile parities][32 heads]: running max handed over
constexpr int PP_TOTAL = PP_MX + 2 * HS * 4;      // i32 [1]
constexpr int PP_MAX_SLOTS = 11;
constexpr int PP_MIN_SLOTS = 8;                   // two tiles; tile n - 2's slots stay free after its use
constexpr int PP_BAR = PP_TOTAL + 16;             // u64 [PP_MAX_SLOTS] full, u64 [PP_MAX_SLOTS] empty, u64 compaction done
constexpr int PP_ENT = PP_BAR + 16 * PP_MAX_SLOTS + 8;  // u32 [valid rows]
constexpr int PP_SLOTB = 2 * PLANE;
static_assert(PP_CB % 1024 == 0 && S_BYTES % 1024 == 0, "wgmma operand tiles start on 1024-byte boundaries");
static_assert(CB_FAC + HS * 4 <= S_BYTES && MAX_ROUNDS * 8 * 4 <= S_BYTES, "consumer block");
static_assert(HS * OUT_STRIDE <= PP_MIN_SLOTS * PP_SLOTB, "out rows fit the slots");
static_assert(16 * 4 * CONSUMERS == PLANE, "one m-block of a consumer's O fills one plane");
static_assert(2 * BLK * 4 <= PP_SLOTB, "the early window entries fit a slot");
__host__ __device__ constexpr int pp_ring_offset(int ktot) { return (PP_ENT + 4 * (ktot > 0 ? ktot : 1) + 1023) / 1024 * 1024; }
static_assert(pp_ring_offset(640) + PP_MAX_SLOTS * PP_SLOTB <= 227 * 1024, "11 slots at V4.1-Flash's 640 indices");

// Named barriers (0: __syncthreads): 1 + c consumer c's warpgroup, BAR_BOTH the two consumers,
// BAR_MAX + c the running max handed over by consumer c, BAR_MERGE the sender's O in place,
// BAR_PROD the producer warpgroup. (The compaction reaches the producer through an mbarrier.)
constexpr int BAR_BOTH = 3, BAR_MAX = 4, BAR_MERGE = 6, BAR_PROD = 7;

constexpr int PP_TRACE = 96;
// Phase timestamps of CTA (0, 0), thread 0 of each warpgroup: [0] start, [1] indices loaded,
// [2] compaction done, [3] end, [4] merge done, [5] early window tiles issued, [6] the producer
// got the compaction; tile j < 16: [8 + j] rows arrived, [24 + j] Sᵀ
// staged, [40 + j] running max received, [56 + j] softmax done, [72 + j] P.V done.
__device__ long long g_trace_pp[PP_TRACE];

// DIAG: the diagnostics compiled in (`mode`); the production instantiation carries none of their code.
template <bool DIAG>
__global__ void __launch_bounds__(PP_THREADS, 1) head_split_pingpong_kernel(const Dsv41SparseAttentionParams p, int mode, int nslot) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sbase = smem_addr(smem);
    if ((sbase & 1023u) != 0) __trap();  // the wgmma descriptors assume 1024-byte aligned tiles
    const uint32_t bar_full = sbase + PP_BAR, bar_empty = sbase + PP_BAR + 8 * PP_MAX_SLOTS;
    const uint32_t bar_count = sbase + PP_BAR + 16 * PP_MAX_SLOTS;  // the compaction is done (one arrival)
    // (The warp index through a shuffle: the role branches are provably warp-uniform, which keeps
    // the wgmma products asynchronous.)
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int wg = warp >> 2;  // 0, 1: consumers; 2: producer
    const int t = blockIdx.x, h0 = blockIdx.y * HS;
    const int nh = min(HS, p.num_heads - h0);
    const bool skip_gather = DIAG && (mode & 4);
    const bool tracer = DIAG && (mode & 1) && (tid & 127) == 0 && blockIdx.x == 0 && blockIdx.y == 0;
    auto stamp = [&](int slot) {
        if (tracer) g_trace_pp[slot] = clock64();
    };
    const uint32_t slots = sbase + pp_ring_offset(p.kw + p.kc);
    grid_dep_wait();  // everything below may read what the previous kernel wrote
    grid_dep_launch();
    stamp(0);
    init_barriers(bar_full, bar_empty, nslot, tid);
    if (tid == 0) mbar_init(bar_count, 1);
    __syncthreads();  // the mbarriers are initialised (the producer starts before the compaction ends)
    if (wg == 2) {
        // Producer. Early window tiles: when the token's first 128 window entries are all valid
        // (the usual decode case), they are its first 128 compacted rows = tiles 0 and 1, gathered
        // from the raw list while the consumers compact (ring positions 0-7: first uses, no
        // waiting). Then the compacted list from the first position not yet produced.
        setmaxnreg_dec<PP_PROD_REGS>();
        const int ptid = tid - 2 * CONSUMERS;
        uint32_t* win_s = reinterpret_cast<uint32_t*>(smem + (slots - sbase) + (nslot - 1) * PP_SLOTB);
        int pos0 = 0;
        if (!(DIAG && (mode & 8)) && p.kw >= 2 * BLK && nslot >= 9) {
            if (early_window_entries(p, t, ptid, win_s, BAR_PROD)) {
                produce_ring(p, slots, nslot, win_s, 2 * BLK, bar_full, bar_empty, ptid, skip_gather, 0, 8);
                pos0 = 8;
                stamp(5);
            }
            bar_sync(BAR_PROD, PROD_THREADS);  // win_s read: its slot may be filled from position 8 on
        }
        mbar_wait(bar_count, 0);  // the consumers' compaction: count and ent_s
        stamp(6);
        const int n = *reinterpret_cast<const int*>(smem + PP_TOTAL);
        produce_ring(p, slots, nslot, reinterpret_cast<const uint32_t*>(smem + PP_ENT), n, bar_full, bar_empty, ptid, skip_gather, pos0,
                     4 * ((n + BLK - 1) / BLK));
        return;
    }
    // Consumers: the compaction (both warpgroups) while their q and sink copies are in flight.
    const int count = compact_indices(p, smem, PP_CNT, PP_TOTAL, PP_ENT, t, tid, lane, warp, [&]() {
        load_q_tile<HS, 2 * CONSUMERS, false>(p, t, h0, nh, tid, sbase + PP_Q, 0);
    }, [] { bar_sync(BAR_BOTH, 2 * CONSUMERS); }, stamp);
    bar_sync(BAR_BOTH, 2 * CONSUMERS);  // ent_s complete
    if (tid == 0) mbar_arrive(bar_count);  // (release) to the producer
    const int ntiles = (count + BLK - 1) / BLK;
    setmaxnreg_inc<PP_MMA_REGS>();
    stamp(2);
    // Consumer c. Products: thread (g, tq) of warp w holds Sᵀ / Oᵀ fragments of heads 8 i + 2 tq
    // (+1); softmax: lane l of warp w owns head hw = 8 w + l / 4 over rows rq .. +16 of a tile.
    const int c = wg, ctid = tid & 127, w = warp & 3, g = lane >> 2, tq = lane & 3;
    const int hw = 8 * w + (lane >> 2), rq = 16 * (lane & 3);
    const int bar_wg = 1 + c;
    auto block = [&](int cc) { return smem + PP_CB + cc * S_BYTES; };  // consumer cc's block
    float* s_s = reinterpret_cast<float*>(block(c));
    float* alpha_s = reinterpret_cast<float*>(block(c) + CB_ALPHA);
    float* mx_s = reinterpret_cast<float*>(smem + PP_MX);
    const int p_off = PP_CB + c * S_BYTES + CB_P;
    const float sink_h = __ldg(p.sink + h0 + min(hw, nh - 1));  // head hw's sink (epilogue)
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run = M_FLOOR, den = 0.f;  // running max after this consumer's last tile, its denominator (head hw)
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    // q and the sink (copied by both consumers) landed and are visible to wgmma.
    cp_async_wait_all();
    fence_proxy_async();
    bar_sync(BAR_BOTH, 2 * CONSUMERS);
    TileSlots cur;
    cur.slots = slots, cur.bar_full = bar_full, cur.nslot = nslot;
    cur.locate(c);
    for (int j = c; j < ntiles; j += 2) {
#pragma unroll
        for (int pr = 0; pr < 4; ++pr) mbar_wait(cur.full(pr), cur.parity(pr));
        fence_proxy_async();  // the row tile (cp.async writes) is read by wgmma
        bar_sync(bar_wg, CONSUMERS);
        if (j < 16) stamp(8 + j);
        const int nb = min(BLK, count - j * BLK);
        // Sᵀ = K . qᵀ (m64n32k16 over the 512 dims: 8 planes x 4 k-steps of 16).
        wg_fence_regs<16>(s);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const uint32_t sub = (ks & 3) * 32, pl = ks >> 2;
            wg_m64n32k16<0, 0>(s, wg_desc(cur.addr(pl >> 1) + (pl & 1) * PLANE + sub, 16, 1024),
                               wg_desc(sbase + PP_Q + pl * (HS * 128) + sub, 16, 1024));
        }
        wg_commit();
        wg_wait_all();
        wg_fence_regs<16>(s);
        stage_scores(s, s_s, w, g, tq);
        bar_sync(bar_wg, CONSUMERS);
        if (j < 16) stamp(24 + j);
        // Softmax; the running max after tile j - 1 comes from the other consumer (read before
        // this tile's is published: see the header comment).
        softmax_tile(s_s, smem + p_off, alpha_s, p.scale, nb, hw, rq, lane, m_run, den, [&](float mx) {
            // (Either barrier also orders this warpgroup's score reads before its Pᵀ / alpha
            // stores over them.)
            float prev = M_FLOOR;
            if (j > 0) {
                bar_sync(BAR_MAX + (c ^ 1), 2 * CONSUMERS);
                prev = mx_s[((j - 1) & 1) * HS + hw];
            } else {
                bar_sync(bar_wg, CONSUMERS);
            }
            if (j + 1 < ntiles) {
                if ((lane & 3) == 0) mx_s[(j & 1) * HS + hw] = fmaxf(prev, mx);
                bar_arrive(BAR_MAX + c, 2 * CONSUMERS);
            }
            if (j < 16) stamp(40 + j);
            return prev;
        });
        fence_proxy_async();  // the Pᵀ tile is read by wgmma
        bar_sync(bar_wg, CONSUMERS);
        if (j < 16) stamp(56 + j);
        rescale_o(o, alpha_s, tq);
        wg_fence_regs<128>(o);
        wg_fence();
        // P.V: four groups of two m-blocks (m-block mb reads plane mb only); each slot goes back
        // as its group completes (one arrival per warp). No run-time trip counts: rows past the
        // tile's end have p = 0 and zero-filled rows.
        auto pv_group = [&](int pr) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int kk = 0; kk < BLK / 16; ++kk)
                    wg_m64n32k16<1, 0>(o + 16 * (2 * pr + h), wg_desc(cur.addr(pr) + h * PLANE + kk * 16 * 128, PLANE, 1024),
                                       wg_desc(sbase + p_off + kk * 32, 16, 1024));
            wg_commit();
        };
        auto hand_back = [&](int pr) {
            if (lane == 0) mbar_arrive(cur.full(pr) + 8 * PP_MAX_SLOTS);
        };
        pv_group(0);
        pv_group(1);
        wg_wait<1>();
        hand_back(0);
        pv_group(2);
        wg_wait<1>();
        hand_back(1);
        pv_group(3);
        wg_wait<1>();
        hand_back(2);
        wg_wait<0>();
        hand_back(3);
        wg_fence_regs<128>(o);
        cur.advance();
        cur.advance();
        if (j < 16) stamp(72 + j);
    }
    // Merge: the consumer of the last tile receives the other's O.
    const int recv = ntiles > 0 ? (ntiles - 1) & 1 : 0;
    TileSlots last = cur;  // the sender's last tile, n - 2
    last.locate(ntiles >= 2 ? ntiles - 2 : 0);
    auto o_chunk = [&](int mb, int c4) {
        return reinterpret_cast<float4*>(smem + (last.addr(mb >> 1) - sbase) + (mb & 1) * PLANE + (c4 * CONSUMERS + ctid) * 16);
    };
    if (c != recv) {
        if (ntiles >= 2) {  // (ntiles <= 1: consumer B had no tile)
#pragma unroll
            for (int mb = 0; mb < 8; ++mb)
#pragma unroll
                for (int c4 = 0; c4 < 4; ++c4) {
                    const float* v = o + 16 * mb + 4 * c4;
                    *o_chunk(mb, c4) = make_float4(v[0], v[1], v[2], v[3]);
                }
            float* fin_s = reinterpret_cast<float*>(block(c) + CB_FIN);
            if ((lane & 3) == 0) fin_s[hw] = m_run, fin_s[HS + hw] = den;
            bar_arrive(BAR_MERGE, 2 * CONSUMERS);
        }
        return;
    }
    if (ntiles >= 2) {
        bar_sync(BAR_MERGE, 2 * CONSUMERS);
        const float* fin_s = reinterpret_cast<const float*>(block(c ^ 1) + CB_FIN);
        const float sc = expf(fin_s[hw] - m_run);  // e^{m_s - M}, M = m_run (the last tile's running max)
        den = __fadd_rn(den, __fmul_rn(fin_s[HS + hw], sc));
        if ((lane & 3) == 0) alpha_s[hw] = sc;
        bar_sync(bar_wg, CONSUMERS);
        float al[8];
        load_head_factors(al, alpha_s, tq);
        // o[16 mb + 4 i + c] belongs to head 8 i + 2 tq + c % 2.
#pragma unroll
        for (int mb = 0; mb < 8; ++mb)
#pragma unroll
            for (int c4 = 0; c4 < 4; ++c4) {
                const float4 v = *o_chunk(mb, c4);
                float* d = o + 16 * mb + 4 * c4;
                d[0] = __fadd_rn(d[0], __fmul_rn(v.x, al[2 * c4]));
                d[1] = __fadd_rn(d[1], __fmul_rn(v.y, al[2 * c4 + 1]));
                d[2] = __fadd_rn(d[2], __fmul_rn(v.z, al[2 * c4]));
                d[3] = __fadd_rn(d[3], __fmul_rn(v.w, al[2 * c4 + 1]));
            }
    }
    stamp(4);
    epilogue(p, o, m_run, den, [&] { return sink_h; }, reinterpret_cast<float*>(block(c) + CB_FAC),
             smem + (slots - sbase), slots, t, h0, nh, count, hw, lane, w, ctid, bar_wg);
    stamp(3);
}

// Diagnostics (DIAG instantiation): prints the phase timestamps of CTA (0, 0) (synchronises the stream).
void print_trace_pingpong(cudaStream_t stream, int dev) {
    long long h[PP_TRACE] = {};
    const int khz = dsv41_launch::read_trace(g_trace_pp, h, sizeof(h), stream, dev);
    if (khz == 0) return;
    const double us = 1e3 / khz;
    auto at = [&](int i) { return (h[i] - h[0]) * us; };
    fprintf(stderr, "sparse_attention head-split ping-pong trace (CTA 0): indices %.2f | compaction %.2f us", at(1), at(2));
    if (h[5] > 0) fprintf(stderr, " | early window tiles issued @%.2f", at(5));
    fprintf(stderr, " | producer got the compaction @%.2f", at(6));
    int n = 0;
    while (n < 16 && h[72 + n] > 0) ++n;
    for (int j = 0; j < n; ++j)
        fprintf(stderr, " | tile%d rows@%.2f (waited %.2f) S^T %.2f, max wait %.2f, softmax %.2f, P.V %.2f", j, at(8 + j),
                at(8 + j) - (j >= 2 ? at(72 + j - 2) : at(2)), at(24 + j) - at(8 + j), at(40 + j) - at(24 + j), at(56 + j) - at(40 + j),
                at(72 + j) - at(56 + j));
    if (n > 0) fprintf(stderr, " | loop %.2f us (%.2f per tile)", at(72 + n - 1) - at(2), (at(72 + n - 1) - at(2)) / n);
    fprintf(stderr, " | merge done @%.2f | epilogue %.2f | total %.2f us\n", at(4), at(3) - at(4), at(3));
}

}  // namespace heads

int launch_head_split_pingpong(const Dsv41SparseAttentionParams& p, cudaStream_t stream, int dev, int max_smem) {
    using namespace heads;
    const int ktot = p.kw + p.kc;
    const int nslot = min(PP_MAX_SLOTS, (max_smem - pp_ring_offset(ktot)) / PP_SLOTB);
    if (nslot < PP_MIN_SLOTS) return DSV41_ERR_SHAPE;
    const size_t smem = static_cast<size_t>(pp_ring_offset(ktot)) + static_cast<size_t>(nslot) * PP_SLOTB;
    // Diagnostic bits (0 without the DSV41_SA_DIAG switch): a call with any of this kernel's runs
    // its DIAG instantiation.
    const int mode = diagnostic_mode() & 13;
    const bool diag = mode != 0;
    auto* kernel = diag ? head_split_pingpong_kernel<DIAG_BUILD> : head_split_pingpong_kernel<false>;
    static thread_local int configured_dev[2] = {-1, -1};
    cudaError_t e = dsv41_launch::set_max_dynamic_smem(kernel, dev, max_smem, configured_dev[diag]);
    if (e != cudaSuccess) return static_cast<int>(e);
    if (mode & 1) dsv41_launch::clear_trace(g_trace_pp, sizeof(long long) * PP_TRACE, stream);
    e = dsv41_launch::launch_pdl(kernel, dim3(p.num_tokens, (p.num_heads + HS - 1) / HS, 1), dim3(PP_THREADS, 1, 1),
                                 smem, stream, 1, p, mode, nslot);
    if (e == cudaSuccess && (mode & 1)) print_trace_pingpong(stream, dev);
    return static_cast<int>(e);
}

}  // namespace dsv41_sa
