// sparse_attention: sparse attention with a per-head sink over two gathered KV sources (spec
// §4.6-§4.7, §0.1b.6), bf16 rows, Hopper tensor cores (wgmma m64nNk16 bf16 -> f32, sm_90a),
// split-KV over a thread-block cluster: the all-heads kernel, for prefill (many tokens: one CTA
// per token) and decode (few tokens: several splits per token). The launcher at the end of this
// file also runs the head-split decode kernel (kernels/sparse_attention_heads.cu: 32 heads per CTA
// over all of the token's rows, no merge) where this kernel would run 2 splits (`use_head_split`),
// or as the caller forces (params.kernel): for bf16 rows the dims-split pair
// (kernels/sparse_attention_dimsplit.cu: all heads, the dims split over a 2-CTA cluster).
//
// For token t, head h and the valid rows s of [kv_window[idx_window[t]] ; kv_extra[idx_extra[t]]]
// (in that order, duplicates kept):
//
//   l_s = scale * (q[t,h] . kv[s])                       f32
//   out = sum_s e^{l_s - m} kv[s] / (sum_s e^{l_s - m} + e^{sink[h] - m})      -> bf16
//   lse = m + ln sum_s e^{l_s - m}                        (sink excluded; -inf for an empty row)
//
// Numerics (crate reference `attention::sparse_attention_ref`): the valid indices are compacted
// (holes removed) and processed in blocks of 64 valid rows; per block the running max starts at
// the -1e30 floor and takes the block's max, the accumulators and the f32 denominator are
// rescaled by e^{m_old - m_new}, p = e^{l - m_new} is summed unrounded (f32) into the
// denominator and rounded to bf16 for P.V (the bf16 A operand of the tensor-core product), out
// = acc / (den + e^{sink - m}), zero when that is 0 or not finite. Differences to the CPU, all
// at rounding level: the f32 order of the 512-term dot products, of the P.V sums (tensor-core
// accumulation) and of the denominators (each compute warpgroup sums the row sums of its own
// tiles, rescaled by every tile's alpha in order; the two shares are added at the end); with S > 1 splits, each split runs its own running max
// from the floor (so p is rounded relative to the split's max) and the splits are merged as
// out = sum_r (e^{m_r - M} / (sum_r e^{m_r - M} den_r + e^{sink - M})) acc_r, M = max_r m_r
// (each term rounded to f32, summed in split order).
//
// Design. grid = (T, S, ceil(H / 64)), cluster = (1, S, 1) when S > 1 (a plain launch for one
// split), 384 threads = 3 warpgroups, 1 CTA per SM (~220 KB shared memory). CTA (t, r, z)
// handles heads [64 z, 64 z + 64) of token t over the r-th of S equal ranges (whole 64-row
// tiles) of the token's compacted valid rows. The launcher picks S from the token count and the
// SM count (a wave model, `choose_splits`) unless the caller forces it. Steps 1 and 2p are shared
// with the head-split kernel (include/dsv41_sparse_attention_common.cuh).
//   1. The compute warpgroups load the token's indices at once, then issue the cp.async copies
//      of q (64 heads x 512 bf16, waited for at tile 0); a ballot + warp scan compacts the valid
//      indices and the CTA keeps the entries of its range (source bit + row) in shared memory.
//   2. Warpgroup 2 is the producer (setmaxnreg down to 40 registers, the two compute
//      warpgroups up to 232): it gathers tile j (64 rows) into stage j & 1 once the compute
//      warps released the stage (an "empty" mbarrier, one arrival per compute warp), with
//      16-byte cp.async carrying the .L2::256B prefetch hint; 16 groups of 8 threads, group g
//      takes rows g, g + 16, g + 32, g + 48, thread q of it chunk q of each 128-byte plane
//      segment, so one warp instruction reads four rows' 128-byte segments (measured: 2x the
//      gather rate of a warp reading 512 contiguous bytes of one row). Each producer thread then
//      arms an asynchronous arrival on the stage's "full" mbarrier (cp.async.mbarrier.arrive.noinc)
//      and moves on; the compute warps wait on it and publish the rows to the tensor cores with
//      fence.proxy.async. Packed sources (528 B window rows, 288 B compressed rows of spec §7.2,
//      DSV41_KV_PACKED_A / _B): the producer copies a row's raw codes and scales into the stage
//      slots the row's bf16 values will occupy, waits for its copies, expands them to bf16 in
//      place (exactly: the tile equals the fake-quantized bf16 rows; include/dsv41_attn_rows.cuh)
//      and then arrives with a plain mbarrier arrival after fence.proxy.async.
//      Per tile, the "seesaw" (measured below): tile j belongs to compute warpgroup
//      j % 2, which alone computes its S and softmax; both warpgroups accumulate its P.V.
//      S: the owner computes S_j for all 64 heads x 64 rows (32 wgmma m64n64k16, A = q and B =
//        the row tile, both K-major from shared memory). In the m64n64 accumulator a head's 64
//        row values sit in one quad of lanes (16 per lane), so the softmax stays in registers:
//        rows past the tile's end masked, the per-head tile max (two shuffles), m_new = max(m
//        after tile j - 1, tile max) (m after tile j - 1 from shared memory, written by the other
//        warpgroup), alpha_j = e^{m_old - m_new}, bf16 p into P tile j % 2 ([64 heads][64 rows],
//        128-byte swizzle, double-buffered by tile parity) and the unrounded f32 row sums into
//        the owner's share of the denominators. m_new and alpha_j go to shared memory and the
//        owner's 128 threads arrive on the p_ready mbarrier of the tile's parity.
//      P.V: each warpgroup keeps O for 64 heads x its 256 dims (128 f32 registers) and, for
//        every tile in order, rescales it (and its denominator share) by alpha_j and adds P_j .
//        V_j[:, its dims] (4 wgmma m64n256k16, A = the P tile, B = the row tile MN-major). The
//        epilogue adds the two denominator shares.
//      Order in warpgroup w, per own tile j: wait for P_{j-1} (the other's tile), its P.V_{j-1}
//        (waited for, then this warpgroup is done with tile j - 1's stage), then (rows of tile j
//        arrived) S_j, softmax, P_j published, own P.V_j (a 128-thread named barrier orders the
//        warpgroup's P tile writes before it; waited for, stage released). Past its last own
//        tile it runs the other's last tile's P.V. A stage returns to the producer after S and
//        both P.V halves (one arrival per compute warp and tile after its P.V: the empty count
//        is unchanged). Each P.V is waited for at once because with two stages the gather of
//        tile j + 2 can only start once both P.V halves of tile j completed (measured: releasing
//        a stage only behind the next tile's S, or behind the next hand-over, put the gather into
//        every tile, 3.1-3.5 us apart instead of ~2.0). The P tile / alpha / max slots of a
//        parity are rewritten two tiles later, after the other warpgroup's P.V of the tile that
//        used them (it waits for that P.V before publishing the tile in between).
//      Shared layouts: the wgmma 128-byte-swizzle canonical layout (shared memory map below).
//   3. epilogue: CTA r stores heads [r hs, r hs + hs), hs = ceil(64 / S); per head the S splits'
//      (m, den) give the factors e^{m_r - M} / den and the lse, out = sum_r fl(factor_r O_r) in
//      split order (raw, unscaled O moves between the CTAs).
//      S <= 2 (include/dsv41_sparse_attention_epilogue.cuh): with S = 2 each CTA writes the raw
//        O of the other CTA's heads and their (m, den) into its own shared memory (a 64 KB
//        chunk), and after a cluster barrier (both CTAs past their tiles) one thread moves it
//        with a TMA bulk copy (cp.async.bulk shared::cluster) into the other CTA, completing on
//        that CTA's mbarrier; after a second cluster barrier (both chunks landed) each CTA
//        combines its heads from its registers and the received chunk into bf16 rows in shared
//        memory and writes them with 16-byte stores (the CTA's output rows are contiguous).
//      S > 2: after a cluster barrier every warp stores its raw O straight into slot `split` of
//        the storing CTA (distributed shared memory stores) while 64 threads merge the splits'
//        (m, den) (distributed shared memory loads); after a second cluster barrier each CTA
//        sums its S slots (local reads) and writes bf16 out.
// Launch: programmatic dependent launch (griddepcontrol): the grid may be scheduled while the
// previous kernel of the stream finishes; every thread waits (griddepcontrol.wait) before its
// first global access, and the CTAs allow the next grid to launch at once. In a decode step the
// attention follows the indexer's top-k, which lets its dependents launch once its selections are
// done (kernels/indexer_topk.cu): the attention's launch overlaps the top-k's end (measured on the
// H200 at B = 64: a trigger at the top-k's start took ~4 us off the head-split kernel's in-stream
// share, 40.7 -> 36.6 us; the late trigger is faster still, and the dims-split pair's clusters need
// it: its share 22.9-23.2 us against 29.9 behind the early trigger).
// Chain contract (what a kernel could read before its griddepcontrol.wait). A grid launched with
// the attribute may start as soon as every CTA of the previous grid in the stream executed
// griddepcontrol.launch_dependents or exited: while that grid runs, before its writes are
// visible; griddepcontrol.wait returns once all prerequisite grids completed and their writes
// are visible. If every kernel of the stream either is launched without the attribute, or calls
// griddepcontrol.wait before griddepcontrol.launch_dependents (in this crate: the sparse
// attention kernels are the only ones launched with it and all wait first; indexer_topk.cu is
// launched without it and triggers before its emit step; the crate's other kernels and Candle's never
// trigger; library kernels such as cuBLAS's are outside this knowledge), then when grid N + 1
// starts, grid N has started, and grid N started only after grid N - 1 completed (launched
// without the attribute: ordinary stream order; with it: it triggers only after its own wait).
// So grid N + 1 could read before its wait what grid N - 1 and earlier wrote, never what grid N
// writes. A kernel cannot know which grid wrote an input, so such reads need the caller's
// guarantee. In the layer's decode step (attention/layer_fused.rs) q, the sink, the window
// index list and the window rows are two or more kernels old after a computed top-k (the
// selection's kernels follow the inserts and the q RoPE), but not in window-only layers or with
// a reused top-k list, where the attention's predecessor may be the window insert. So both
// kernels read nothing before the wait. (Measured on the H200: the head-split kernel with its q
// copies and the gather of its two window tiles before the wait saved another ~1.8 us of the
// in-stream share; a sound variant, L2 prefetches of the same data before the wait, saved
// nothing. A caller flag "inputs are two kernels old" would be the way to use the former.)
// Diagnostics: compiled in only with the DSV41_SA_DIAG switch (crate feature `cuda-diag`; the
// mode bits and their environment variables in include/dsv41_sparse_attention_common.cuh). In
// this kernel's DIAG instantiation mode bit 0 traces the phase times of CTA (0, 0, 0) (printed
// after the launch, synchronising), bit 1 skips the tensor-core products and bit 2 the row gather
// (wrong results, for timing the other parts).
// Measured on the H200: with the earlier loop (both warpgroups computing S over half the rows
// each, then both the softmax) a 64-row tile cost ~2.4 us; with the seesaw ~2.0 us (P.V of the
// previous tile ~0.55, S 0.58, softmax 0.63 in series, also without the gather: the next tile's
// rows cannot be resident during the softmax with two stages; prefill +15 %). Moving 64 KB
// between the two CTAs of a cluster takes ~2.5 us as a bulk copy, ~3.5-4 us as distributed shared
// memory stores.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <type_traits>
#include <utility>

#include "include/dsv41_attn_rows.cuh"
#include "include/dsv41_hopper.cuh"
#include "include/dsv41_launch.cuh"
#include "include/dsv41_sparse_attention.h"
#include "include/dsv41_sparse_attention_epilogue.cuh"
#include "include/dsv41_sparse_attention_layout.cuh"

namespace cg = cooperative_groups;

namespace dsv41_sa {

using namespace dsv41_ptx;

// Warpgroups 0 and 1 compute (threads 0..255), warpgroup 2 is the producer (threads 256..383).
// R: the index rounds the compaction is unrolled for (Kw + Kc <= 256 R; ValidIndicesR: the V4.1
// shape's 640 indices take R = 3, without the branches over 13 unused rounds). DIAG: the
// diagnostics compiled in (`mode`: bit 0 phase trace, bit 1 no tensor-core products, bit 2 no
// row gather); the production instantiation (DIAG = false) ignores `mode` and carries none of
// their code.
template <int R, bool DIAG>
__global__ void __launch_bounds__(THREADS + PROD_THREADS, 1)
    sparse_attention_kernel(const Dsv41SparseAttentionParams p, int mode) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sbase = smem_addr(smem);
    if ((sbase & 1023u) != 0) __trap();  // the wgmma descriptors assume 1024-byte aligned tiles
    float* m_s = reinterpret_cast<float*>(smem + SM_M);
    float* alpha_s = reinterpret_cast<float*>(smem + SM_ALPHA);
    float* den_s = reinterpret_cast<float*>(smem + SM_DEN);
    float* stat_s = reinterpret_cast<float*>(smem + SM_STAT);
    int* cnt_s = reinterpret_cast<int*>(smem + SM_CNT);
    int* total_s = reinterpret_cast<int*>(smem + SM_TOTAL);
    uint32_t* ent_s = reinterpret_cast<uint32_t*>(smem + SM_ENT);
    const uint32_t bar_full = sbase + SM_BAR, bar_empty = sbase + SM_BAR + 16;  // [2] each, 8 bytes apart
    const uint32_t bar_rx = sbase + SM_BAR + 32;  // the other split's chunk landed (epilogue, S = 2)
    const uint32_t bar_pready = sbase + SM_BAR + 40;  // [2] P tile of tile j published (by tile parity)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool compute = tid < THREADS;  // false: the producer warpgroup
    const int g = lane >> 2, tq = lane & 3;  // fragment coordinates
    const int t = blockIdx.x;
    const int split = blockIdx.y, nsplit = gridDim.y;
    const int h0 = blockIdx.z * HB;
    const int nh = min(HB, p.num_heads - h0);
    // Diagnostic modes (DIAG instantiation only): bit 0 phase trace, bit 1 skip the tensor-core
    // products, bit 2 skip the row gather (timing of the other parts).
    const bool trace = DIAG && (mode & 1), skip_mma = DIAG && (mode & 2), skip_gather = DIAG && (mode & 4);
    // Epilogue: bulk-copy exchange with S <= 2 splits, distributed shared memory stores with more.
    const bool xfer = nsplit <= 2;
    const bool tracer = trace && tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
    auto stamp = [&](int slot) {
        if (tracer) g_trace[slot] = clock64();
    };
    grid_dep_wait();  // everything below may read what the previous kernel wrote
    grid_dep_launch();
    stamp(0);
    if (tid < HB) {
        m_s[tid] = M_FLOOR;
        m_s[HB + tid] = M_FLOOR;
    }
    if (tid == 0) {
        mbar_init(bar_full, PROD_THREADS);  // one asynchronous arrival per producer thread
        mbar_init(bar_full + 8, PROD_THREADS);
        mbar_init(bar_empty, THREADS / 32);  // one arrival per compute warp
        mbar_init(bar_empty + 8, THREADS / 32);
        mbar_init(bar_pready, THREADS / 2);  // one arrival per thread of the owner warpgroup
        mbar_init(bar_pready + 8, THREADS / 2);
        if (xfer && nsplit > 1) {
            mbar_init(bar_rx, 1);
            mbar_arrive_expect_tx(bar_rx, (HB / 2) * OROW + XSTAT);  // the one chunk of the other CTA (hs = 32 rows sent, any nh)
            fence_mbar_init_cluster();
        }
    }

    // 1. Compaction of the valid indices in order (window then extra), by the compute threads;
    // the q copies (heads past nh zero-filled; the sink with them) are issued while the index
    // loads are in flight.
    ValidIndicesR<R> vi;
    if (compute)
        vi.load_and_count(p, t, tid, cnt_s, [&]() { load_q_tile<HB, THREADS>(p, t, h0, nh, tid, sbase + SM_Q, sbase + SM_SINK); });
    __syncthreads();
    stamp(23);
    if (warp == 0) vi.scan(cnt_s, total_s, lane);
    __syncthreads();
    const int count = *total_s;
    // This split's range of valid rows: equal shares in whole tiles.
    const int tiles_all = (count + BLK - 1) / BLK;
    const int per = (tiles_all + nsplit - 1) / nsplit * BLK;
    const int lo = min(count, split * per), hi = min(count, lo + per);
    if (compute) vi.store(cnt_s, ent_s, lo, hi, tid);
    __syncthreads();

    const int nrows = hi - lo;
    const int ntiles = (nrows + BLK - 1) / BLK;
    // Heads per storing CTA of the epilogue: CTA r writes heads [r hs, min(nh, r hs + hs)).
    const int hs = (nh + nsplit - 1) / nsplit;

    if (!compute) {
        // 2p. Producer warpgroup (dsv41_sparse_attention_common.cuh, produce_tiles).
        setmaxnreg_dec<PROD_REGS>();
        produce_tiles(p, sbase + SM_K, ent_s, nrows, bar_full, bar_empty, tid - THREADS, skip_gather);
        // The epilogue's cluster barriers count every thread of the cluster.
        if (nsplit > 1) {
            cluster_sync_all();
            cluster_sync_all();
        }
        return;
    }

    // 2c. Compute warpgroups.
    setmaxnreg_inc<MMA_REGS>();
    stamp(1);
    // The sink of head `tid` (read by the epilogue's merge; loaded early, off the critical path).
    // (Thread tid merges head tid, or head split hs + tid of the bulk-copy epilogue; read after
    // the epilogue's cp_async_wait_all.)
    const float* sink_s = reinterpret_cast<const float*>(smem + SM_SINK);
    // Warp roles: warpgroup wg = warp / 4 owns the tiles j with j % 2 == wg (their S and softmax)
    // and accumulates dims 256 wg .. +256 of every tile's P.V; warp hg = warp % 4 of it holds heads
    // 16 hg .. +16 (rows of both products' accumulators). wg is read from lane 0 so that the
    // compiler sees the role branches as warp-uniform (wgmma in divergent code serialises).
    const int hg = warp & 3;
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
    const int hlo = hg * 16 + g, hhi = hlo + 8;
    const bool qk_active = hg * 16 < nh;
    // O accumulators (m64n256 fragment of warpgroup wg): acc[4i + c] = head hlo + 8 (c / 2),
    // dim 256 wg + 8 i + 2 tq + c % 2.
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    // This warpgroup's share of the denominators of heads hlo, hhi: the row sums of its own tiles,
    // rescaled by every tile's alpha in tile order (the two shares are added in the epilogue).
    float den_lo = 0.f, den_hi = 0.f;
    const bool tracer_wg = trace && (tid & 127) == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
    auto wstamp = [&](int slot) {
        if (tracer_wg) g_trace[slot] = clock64();
    };
    // The tile loop, with the products and (DIAG instantiation only) without them (the diagnostic
    // skip_mma; a loop of its own keeps every wgmma path free of register writes behind products
    // in flight, which would serialise them).
    auto tile_loop = [&](auto skip_c) {
        constexpr bool kSkip = decltype(skip_c)::value;
        // This warp is done with the stage of tile jj (its wgmma reads completed): hand it back.
        auto release = [&](int jj) {
            if (lane == 0) mbar_arrive(bar_empty + 8 * (jj & 1));
        };
        // O = alpha O + P_jj . V_jj[:, dims 256 wg .. +256] (m64n256k16 per 16 rows; A = the P tile,
        // K-major; B = the row tile, MN-major: 64-dim planes 8 KB apart). Rows past the tile's end
        // have p = 0 and zero-filled rows, so all four k-steps run. One commit group.
        auto issue_pv = [&](int jj, float al, float ah) {
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                acc[4 * i] *= al;
                acc[4 * i + 1] *= al;
                acc[4 * i + 2] *= ah;
                acc[4 * i + 3] *= ah;
            }
            const uint32_t kt = sbase + SM_K + (jj & 1) * TILEB, pt = sbase + SM_P + (jj & 1) * PTILE;
            wg_fence_regs<128>(acc);
            wg_fence();
            if constexpr (!kSkip) {
#pragma unroll
                for (int kk = 0; kk < BLK / 16; ++kk)
                    wg_m64n256k16_kmn(acc, wg_desc(pt + kk * 32, 16, 1024), wg_desc(kt + wg * 4 * PLANE + kk * 16 * 128, PLANE, 1024));
            }
            wg_commit();
        };
        auto wait_acc = [&]() {
            wg_wait<0>();
            wg_fence_regs<128>(acc);
        };

        cp_async_wait_all();  // this thread's q copies
        fence_proxy_async();  // q (generic-proxy writes) is read by wgmma
        compute_sync();       // all of q (copied by the 256 compute threads)

        // The seesaw: warpgroup wg visits its own tiles j = wg, wg + 2, ... and, before each (and once
        // past the end when the last tile is the other's), the other warpgroup's tile j - 1.
        for (int j = wg; j <= ntiles; j += 2) {
            // Tile j - 1 (the other warpgroup's): wait for its P tile, alpha and max, then this half of
            // its P.V; the stage goes back as soon as that completed (with two stages, the gather of
            // tile j + 1 waits for it).
            if (j >= 1) {
                mbar_wait(bar_pready + 8 * ((j - 1) & 1), ((j - 1) >> 1) & 1);
                const float* al_s = alpha_s + ((j - 1) & 1) * HB;
                const float al = al_s[hlo], ah = al_s[hhi];
                den_lo = __fmul_rn(den_lo, al);
                den_hi = __fmul_rn(den_hi, ah);
                issue_pv(j - 1, al, ah);
                wait_acc();
                release(j - 1);
            }
            if (j >= ntiles) break;  // past the end: only the other's last tile
        // Own tile j. S = q . K_j^T for all 64 heads x 64 rows (m64n64k16 over the 512 dims, A =
            // q and B = the row tile, both K-major); s[4i + c] = head hlo + 8 (c / 2), row 8 i + 2 tq
            // + c % 2.
            mbar_wait(bar_full + 8 * (j & 1), (j >> 1) & 1);
            fence_proxy_async();  // the row tile (generic-proxy writes) is read by wgmma
            wg_sync(wg);
            if (j < 16) wstamp(24 + j);
            const uint32_t kt = sbase + SM_K + (j & 1) * TILEB;
            // Written by the first k-step (accumulate = 0): no zeroing behind the P.V in flight.
            float s[32];
            if constexpr (kSkip) {
#pragma unroll
                for (int i = 0; i < 32; ++i) s[i] = 0.f;
            } else {
#pragma unroll
                for (int ks = 0; ks < D / 16; ++ks) {
                    const uint32_t off = (ks >> 2) * PLANE + (ks & 3) * 32;
                    wg_m64n64k16(s, wg_desc(sbase + SM_Q + off, 16, 1024), wg_desc(kt + off, 16, 1024), ks > 0);
                }
            }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs<32>(s);
            if (j < 16) wstamp(48 + j);
            // Softmax of tile j in registers: scale, mask, per-head max over the quad's 64 rows.
            const int nb = min(BLK, nrows - j * BLK);
            float mlo = -INFINITY, mhi = -INFINITY;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const bool ok = qk_active && 8 * i + 2 * tq + (c & 1) < nb;
                    s[4 * i + c] = ok ? __fmul_rn(p.scale, s[4 * i + c]) : -INFINITY;
                }
                mlo = fmaxf(mlo, fmaxf(s[4 * i], s[4 * i + 1]));
                mhi = fmaxf(mhi, fmaxf(s[4 * i + 2], s[4 * i + 3]));
            }
            mlo = fmaxf(mlo, __shfl_xor_sync(0xffffffffu, mlo, 1));
            mlo = fmaxf(mlo, __shfl_xor_sync(0xffffffffu, mlo, 2));
            mhi = fmaxf(mhi, __shfl_xor_sync(0xffffffffu, mhi, 1));
            mhi = fmaxf(mhi, __shfl_xor_sync(0xffffffffu, mhi, 2));
            // m_new = max(m after tile j - 1, tile max); bf16 p -> P tile j % 2; alpha; denominators.
            const float* m_old_s = m_s + (j & 1) * HB;
            const float olo = m_old_s[hlo], ohi = m_old_s[hhi];
            const float nlo = fmaxf(olo, mlo), nhi = fmaxf(ohi, mhi);
            const float alo = expf(olo - nlo), ahi = expf(ohi - nhi);
            unsigned char* pt = smem + SM_P + (j & 1) * PTILE;
            float slo = 0.f, shi = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float e0 = expf(s[4 * i] - nlo), e1 = expf(s[4 * i + 1] - nlo);
                const float e2 = expf(s[4 * i + 2] - nhi), e3 = expf(s[4 * i + 3] - nhi);
                slo += e0 + e1;
                shi += e2 + e3;
                // rows 8 i + 2 tq, + 1: chunk i, elements 2 tq, 2 tq + 1
                *reinterpret_cast<uint32_t*>(pt + sw128(hlo, i) + tq * 4) = pack_bf16x2_rn(e0, e1);
                *reinterpret_cast<uint32_t*>(pt + sw128(hhi, i) + tq * 4) = pack_bf16x2_rn(e2, e3);
            }
            slo += __shfl_xor_sync(0xffffffffu, slo, 1);
            slo += __shfl_xor_sync(0xffffffffu, slo, 2);
            shi += __shfl_xor_sync(0xffffffffu, shi, 1);
            shi += __shfl_xor_sync(0xffffffffu, shi, 2);
            den_lo = __fadd_rn(__fmul_rn(den_lo, alo), slo);
            den_hi = __fadd_rn(__fmul_rn(den_hi, ahi), shi);
            if (tq == 0) {
                float* m_new_s = m_s + ((j + 1) & 1) * HB;
                float* a_s = alpha_s + (j & 1) * HB;
                m_new_s[hlo] = nlo;
                m_new_s[hhi] = nhi;
                a_s[hlo] = alo;
                a_s[hhi] = ahi;
            }
            fence_proxy_async();  // the P tile is read by wgmma
            mbar_arrive(bar_pready + 8 * (j & 1));  // to the other warpgroup (its P.V half of tile j, its tile j + 1)
            wg_sync(wg);          // this warpgroup's P tile writes, for its own P.V
            if (j < 16) wstamp(2 + j);
            issue_pv(j, alo, ahi);
            wait_acc();
            release(j);
        }
    };
    if constexpr (DIAG) {
        if (skip_mma)
            tile_loop(std::true_type{});
        else
            tile_loop(std::false_type{});
    } else {
        tile_loop(std::false_type{});
    }
    stamp(22);

    // 3. Epilogue: per-head (m, den) of this split, merged over the cluster.
    cp_async_wait_all();  // the q copy is still in flight when the range is empty
    if (xfer && nsplit > 1) cluster_arrive();  // this CTA is done with q and the stages (the other may write its chunk)
    // Shared memory of split r: distributed shared memory with S > 1 (no cluster launch else).
    auto split_smem = [&](float* ptr, int r) -> float* {
        return nsplit > 1 ? cg::this_cluster().map_shared_rank(ptr, r) : ptr;
    };
    if (tq == 0) {
        den_s[wg * HB + hg * 16 + g] = den_lo;
        den_s[wg * HB + hg * 16 + g + 8] = den_hi;
    }
    compute_sync();
    if (tid < HB) {
        stat_s[tid] = m_s[(ntiles & 1) * HB + tid];
        stat_s[HB + tid] = __fadd_rn(den_s[tid], den_s[HB + tid]);
    }
    if (xfer) {
        epilogue_xfer(p, smem, acc, t, split, nsplit, h0, nh, hs, count, tracer);
        return;
    }
    // Cluster barriers only with S > 1 (a barrier of the compute threads otherwise).
    auto all_sync = [&]() {
        if (nsplit > 1)
            cluster_sync_all();
        else
            compute_sync();
    };
    all_sync();  // stats visible cluster-wide; every CTA is done with its q and row tiles
    stamp(21);
    // The raw O (not yet scaled) goes straight to the storing CTA's slot while 64 threads
    // merge the splits' (m, den) of every head into all S factors (fac_all, local); the
    // storing CTA applies them: sum_r fl(fac_r O_r), in split order (bitwise the same terms and
    // sums as scaling before the push).
    float* fac_all = reinterpret_cast<float*>(smem + SM_P);  // f32 [S][64 heads]
    float mr[MAX_SPLITS], dr[MAX_SPLITS];
    if (tid < HB) {
#pragma unroll
        for (int r = 0; r < MAX_SPLITS; ++r) {
            mr[r] = M_FLOOR;
            dr[r] = 0.f;
            if (r < nsplit) {
                const float* st = split_smem(stat_s, r);
                mr[r] = st[tid];
                dr[r] = st[HB + tid];
            }
        }
    }
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        const int h = hg * 16 + g + 8 * hi;
        if (h < nh) {
            const int r = h / hs, row = split * hs + h - r * hs;
            unsigned char* base = reinterpret_cast<unsigned char*>(split_smem(reinterpret_cast<float*>(smem + SM_O), r));
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int d0 = wg * 256 + 8 * i + 2 * tq;
                float2* dst = reinterpret_cast<float2*>(base + sw2k(row, d0 >> 2) + (d0 & 3) * 4);
                *dst = make_float2(acc[4 * i + 2 * hi], acc[4 * i + 2 * hi + 1]);
            }
        }
    }
    if (tid < HB) {
        const int h = tid;
        float big = M_FLOOR;
#pragma unroll
        for (int r = 0; r < MAX_SPLITS; ++r) big = fmaxf(big, mr[r]);
        float wsum = 0.f;
#pragma unroll
        for (int r = 0; r < MAX_SPLITS; ++r)
            if (r < nsplit) wsum = __fadd_rn(wsum, __fmul_rn(expf(mr[r] - big), dr[r]));
        const float den = __fadd_rn(wsum, expf(sink_s[h] - big));
        const bool ok = den > 0.f && isfinite(den);
#pragma unroll
        for (int r = 0; r < MAX_SPLITS; ++r)
            if (r < nsplit) fac_all[r * HB + h] = ok ? __fdiv_rn(expf(mr[r] - big), den) : 0.f;
        if (split == 0 && h < nh)
            p.lse[static_cast<int64_t>(t) * p.num_heads + h0 + h] = count > 0 ? big + logf(wsum) : -INFINITY;
    }
    stamp(18);
    all_sync();  // every split's raw tiles have arrived; fac_all written
    stamp(19);
    // This CTA's heads [split hs, ...): a thread per 4 dims of each half of a head row
    // (chunks col and col + 64 = dims 4 col .. +4 and 256 + 4 col .. +4).
    const int hb = split * hs, he = min(nh, hb + hs);
    const int items = (he - hb) * 64;
    constexpr int PER = 4;
    for (int c0 = 0; c0 < items; c0 += PER * THREADS) {
        float4 oa[PER], ob[PER];
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            oa[k] = make_float4(0.f, 0.f, 0.f, 0.f);
            ob[k] = oa[k];
        }
#pragma unroll 1
        for (int r = 0; r < nsplit; ++r) {
#pragma unroll
            for (int k = 0; k < PER; ++k) {
                const int c = c0 + k * THREADS + tid;
                if (c < items) {
                    const int hr = c >> 6, col = c & 63, row = r * hs + hr;
                    const float f = fac_all[r * HB + hb + hr];
                    const float4 x = *reinterpret_cast<const float4*>(smem + SM_O + sw2k(row, col));
                    const float4 y = *reinterpret_cast<const float4*>(smem + SM_O + sw2k(row, col + 64));
                    oa[k].x += __fmul_rn(x.x, f); oa[k].y += __fmul_rn(x.y, f);
                    oa[k].z += __fmul_rn(x.z, f); oa[k].w += __fmul_rn(x.w, f);
                    ob[k].x += __fmul_rn(y.x, f); ob[k].y += __fmul_rn(y.y, f);
                    ob[k].z += __fmul_rn(y.z, f); ob[k].w += __fmul_rn(y.w, f);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const int c = c0 + k * THREADS + tid;
            if (c < items) {
                const int h = hb + (c >> 6), col = c & 63;
                __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) + (static_cast<int64_t>(t) * p.num_heads + h0 + h) * D + col * 4;
                *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16x2_rn(oa[k].x, oa[k].y), pack_bf16x2_rn(oa[k].z, oa[k].w));
                *reinterpret_cast<uint2*>(dst + 256) = make_uint2(pack_bf16x2_rn(ob[k].x, ob[k].y), pack_bf16x2_rn(ob[k].z, ob[k].w));
            }
        }
    }
    stamp(20);
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }


// Splits per token: the fewest that minimise the estimated time, in units of one 64-row tile:
// per CTA its tiles + a fixed cost (index compaction, first loads, epilogue; ~2 tiles) + the
// cluster merge (~1 tile); waves of one CTA per SM, fractional when many CTAs stream through.
int choose_splits(long tokens_x_hblocks, int tiles, int sms) {
    int best = 1;
    double best_cost = -1.0;
    for (int s = 1; s <= MAX_SPLITS; ++s) {
        if (s > 1 && s > tiles) break;
        const long ctas = tokens_x_hblocks * s;
        const double waves = ctas < 4L * sms ? static_cast<double>((ctas + sms - 1) / sms) : static_cast<double>(ctas) / sms;
        const double cost = waves * ((tiles + s - 1) / s + 2.0 + (s > 1 ? 1.0 : 0.0));
        if (best_cost < 0.0 || cost < best_cost - 1e-9) {
            best_cost = cost;
            best = s;
        }
    }
    return best;
}

// The kernel of a call: forced by the caller, the all-heads kernel with forced splits, else for
// bf16 rows wherever the all-heads kernel would split (few tokens: 2 CTAs per token fit one wave)
// the head-split launcher, which runs the dims-split pair (docs/perf.md "Sparse attention", H200:
// 19.0 us median at B = 64 against the all-heads kernel's 27.9-28.4; at B = 1 17.8-17.9 against
// 17.6-17.7) or the ping-pong loop where its slots do not fit. Packed rows expand each tile on the
// producer, which the head-split kernels would do twice per token (67 us at B = 64 against the
// all-heads kernel's 40.6, same section): all-heads.
bool use_head_split(const Dsv41SparseAttentionParams& p, long tokens_x_hblocks, int tiles, int sms) {
    if (p.kernel != DSV41_SA_KERNEL_AUTO) return p.kernel >= DSV41_SA_KERNEL_HEAD_SPLIT;
    if (p.num_splits > 0 || p.window_format != DSV41_KV_BF16 || p.extra_format != DSV41_KV_BF16) return false;
    return choose_splits(tokens_x_hblocks, tiles, sms) >= 2;
}

// The opt-in shared memory per block and the SM count of device `dev`, queried once per thread
// and device (the launcher runs for every attention call of a decode step).
static cudaError_t device_limits(int dev, int* max_smem, int* sms) {
    static thread_local int cached_dev = -1, cached_smem = 0, cached_sms = 0;
    if (cached_dev != dev) {
        cudaError_t e = cudaDeviceGetAttribute(&cached_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (e == cudaSuccess) e = cudaDeviceGetAttribute(&cached_sms, cudaDevAttrMultiProcessorCount, dev);
        if (e != cudaSuccess) return e;
        cached_dev = dev;
    }
    *max_smem = cached_smem;
    *sms = cached_sms;
    return cudaSuccess;
}

// Diagnostics (DIAG instantiation): prints the phase timestamps of CTA (0, 0, 0) (synchronises the stream).
void print_trace(cudaStream_t stream, int splits, int tiles, int dev) {
    long long h[TRACE_SLOTS] = {};
    const int khz = dsv41_launch::read_trace(g_trace, h, sizeof(h), stream, dev);
    if (khz == 0) return;
    const double us = 1e3 / khz;
    fprintf(stderr, "sparse_attention trace (CTA 0, splits %d, index tiles %d, %d MHz): indices %.2f | compaction %.2f us", splits, tiles,
            khz / 1000, (h[23] - h[0]) * us, (h[1] - h[0]) * us);
    // Per tile (its owner warpgroup): rows arrived (from the end of the compaction), S, softmax up
    // to the P tile's hand-over; the loop ends with the last P.V (thread 0's, slot 22).
    long long prev = h[1];
    int n = 0;
    for (; n < 16 && h[2 + n] > prev; ++n) {
        fprintf(stderr, " | tile%d rows@%.2f S %.2f softmax %.2f (+%.2f)", n, (h[24 + n] - h[1]) * us, (h[48 + n] - h[24 + n]) * us,
                (h[2 + n] - h[48 + n]) * us, (h[2 + n] - prev) * us);
        prev = h[2 + n];
    }
    if (n > 0 && h[22] > h[1]) {
        fprintf(stderr, " | loop %.2f us (%.2f per tile, last P.V %.2f)", (h[22] - h[1]) * us, (h[22] - h[1]) * us / n, (h[22] - prev) * us);
        prev = h[22];
    }
    fprintf(stderr, " | bar1 %.2f | merge+push %.2f | bar2 %.2f | store %.2f | total %.2f us", (h[21] - prev) * us, (h[18] - h[21]) * us,
            (h[19] - h[18]) * us, (h[20] - h[19]) * us, (h[20] - h[0]) * us);
    if (h[41] > 0)
        fprintf(stderr, " (bulk epilogue: bar %.2f, factors %.2f, sync %.2f, combine %.2f, sync %.2f)", (h[44] > 0 ? h[44] - h[18] : 0) * us,
                (h[41] - (h[44] > 0 ? h[44] : h[18])) * us, (h[42] - h[41]) * us, (h[43] - h[42]) * us, (h[19] - h[43]) * us);
    fprintf(stderr, "\n");
}

}  // namespace dsv41_sa

extern "C" int dsv41_sparse_attention(const Dsv41SparseAttentionParams* p, size_t params_size, void* stream) {
    using namespace dsv41_sa;
    if (params_size != sizeof(Dsv41SparseAttentionParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->head_dim != D) return DSV41_ERR_HEAD_DIM;
    if (p->num_tokens < 0 || p->num_heads < 0 || p->kw < 0 || p->kc < 0 || p->kw + p->kc > MAX_INDICES ||
        p->num_heads > 65535 * HB || (p->index_bytes != 4 && p->index_bytes != 8) || p->num_window_rows < 0 ||
        p->num_extra_rows < 0 || p->num_window_rows > 0x7fffffff || p->num_extra_rows > 0x7fffffff ||
        p->num_splits < 0 || p->num_splits > MAX_SPLITS || p->kernel < DSV41_SA_KERNEL_AUTO || p->kernel > DSV41_SA_KERNEL_DIM_SPLIT_PAIR ||
        (p->kernel >= DSV41_SA_KERNEL_HEAD_SPLIT && p->num_splits > 1))
        return DSV41_ERR_SHAPE;
    if (p->num_tokens == 0 || p->num_heads == 0) return DSV41_OK;
    if (!p->q || !p->sink || !p->out || !p->lse || (p->kw > 0 && (!p->kv_window || !p->idx_window)) ||
        (p->kc > 0 && (!p->kv_extra || !p->idx_extra)))
        return DSV41_ERR_NULL;
    // Source formats; packed pages: a positive page size whose page holds all its slots' rows.
    for (const auto& [fmt, page] : {std::pair<int, int>{p->window_format, p->window_page_size}, {p->extra_format, p->extra_page_size}}) {
        if (fmt != DSV41_KV_BF16 && fmt != DSV41_KV_PACKED_A && fmt != DSV41_KV_PACKED_B) return DSV41_ERR_QUANT;
        if (fmt != DSV41_KV_BF16 && page <= 0) return DSV41_ERR_SHAPE;
    }
    // 16-byte row loads: every bf16 row start must be 8-element aligned; packed pages 16-byte
    // aligned (row and scale offsets are multiples of 16 bytes for 528 / 288 B rows).
    auto src_aligned = [](const void* base, int fmt, int64_t stride) { return aligned16(base) && (fmt != DSV41_KV_BF16 || stride % 8 == 0); };
    if (!aligned16(p->q) || p->q_token_stride % 8 || p->q_head_stride % 8 || !aligned16(p->out) ||
        (p->kw > 0 && !src_aligned(p->kv_window, p->window_format, p->window_row_stride)) ||
        (p->kc > 0 && !src_aligned(p->kv_extra, p->extra_format, p->extra_row_stride)))
        return DSV41_ERR_ALIGNMENT;
    const int ktot = p->kw + p->kc;
    const size_t smem = SM_ENT + sizeof(uint32_t) * static_cast<size_t>(ktot > 0 ? ktot : 1);
    int dev = 0, max_smem = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = device_limits(dev, &max_smem, &sms);
    if (e != cudaSuccess) return static_cast<int>(e);
    const int hblocks = (p->num_heads + HB - 1) / HB;
    const int tiles = (ktot + BLK - 1) / BLK;
    if (use_head_split(*p, static_cast<long>(p->num_tokens) * hblocks, tiles, sms)) {
        if (p->num_heads > 65535 * 32) return DSV41_ERR_SHAPE;
        return launch_head_split(*p, static_cast<cudaStream_t>(stream), dev, max_smem);
    }
    if (smem > static_cast<size_t>(max_smem)) return DSV41_ERR_SHAPE;
    // Diagnostic bits (0 without the DSV41_SA_DIAG switch): a call with any of this kernel's runs
    // its DIAG instantiation (which is the production one without the switch).
    const int mode = diagnostic_mode() & 7;
    const bool trace = mode & 1, diag = mode != 0;
    // Raise the dynamic limit to the maximum once per thread and device.
    const bool few = fits_few_rounds(ktot);
    auto* kernel = few ? (diag ? sparse_attention_kernel<FEW_ROUNDS, DIAG_BUILD> : sparse_attention_kernel<FEW_ROUNDS, false>)
                       : (diag ? sparse_attention_kernel<MAX_ROUNDS, DIAG_BUILD> : sparse_attention_kernel<MAX_ROUNDS, false>);
    static thread_local int configured_dev[4] = {-1, -1, -1, -1};
    e = dsv41_launch::set_max_dynamic_smem(kernel, dev, max_smem, configured_dev[2 * diag + few]);
    if (e != cudaSuccess) return static_cast<int>(e);
    const int splits = p->num_splits > 0 ? p->num_splits : choose_splits(static_cast<long>(p->num_tokens) * hblocks, tiles, sms);
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (trace) dsv41_launch::clear_trace(g_trace, sizeof(long long) * TRACE_SLOTS, st);
    // Programmatic dependent launch (the kernel waits in griddepcontrol.wait before touching
    // global memory); the splits of a token form a cluster (one split: no cluster).
    e = dsv41_launch::launch_pdl(kernel, dim3(p->num_tokens, splits, hblocks), dim3(THREADS + PROD_THREADS, 1, 1), smem,
                                 st, splits, *p, mode);
    if (e == cudaSuccess && trace) print_trace(st, splits, tiles, dev);
    return static_cast<int>(e);
}
