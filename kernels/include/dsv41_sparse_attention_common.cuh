// The pieces both sparse attention kernels share (kernels/sparse_attention.cu: all heads of a
// token per CTA, split-KV; kernels/sparse_attention_heads.cu: 32 heads per CTA, rows as the
// wgmma M dimension): row geometry, the 128-byte-swizzled tile layout, the compaction of a
// token's valid indices, the q copies, and the producer warpgroup that gathers the 64-row tiles
// into a two-stage ring behind full / empty mbarriers. The design of each is described in the
// header comment of kernels/sparse_attention.cu (steps 1 and 2p).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdlib.h>

#include "dsv41_attn_rows.cuh"
#include "dsv41_warp.cuh"
#include "dsv41_hopper.cuh"
#include "dsv41_numerics.cuh"
#include "dsv41_sparse_attention.h"

namespace dsv41_sa {

constexpr int D = 512;             // head dim (row width)
constexpr int BLK = 64;            // rows per tile = softmax block of the reference
constexpr int TILEB = BLK * D * 2; // one 64-row bf16 tile (8 planes of 8 KB)
constexpr int PLANE = BLK * 128;   // one 64-dim plane of a row tile
constexpr int IDX_THREADS = 256;   // threads that compact the indices (8 warps)
constexpr int PROD_THREADS = 128;  // the producer warpgroup
constexpr int MAX_ROUNDS = 16;     // index rounds of 256: Kw + Kc <= 4096
constexpr int MAX_INDICES = MAX_ROUNDS * IDX_THREADS;
constexpr float M_FLOOR = -1e30f;

// Byte offset of 16-byte chunk `c` (0..63) of row `r` in a 128-byte-swizzled tile of `ROWS`
// rows: 8 planes of 64 dims, [c / 8][r][128 bytes, chunk c % 8 at (c ^ r) % 8] (the wgmma
// canonical layout; K-major over the dims, MN-major when the rows are the K dimension).
template <int ROWS>
__device__ __forceinline__ uint32_t wgsw_rows(int r, int c) {
    return static_cast<uint32_t>((c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
// Same for a tile of 128-byte rows (8 chunks), e.g. a P tile of 64 bf16 per row.
__device__ __forceinline__ uint32_t sw128(int r, int c) { return static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) << 4)); }

using dsv41::pack_bf16x2_rn;  // bf16x2 of two f32 (dsv41_numerics.cuh)

__device__ __forceinline__ const __nv_bfloat16* row_ptr(const Dsv41SparseAttentionParams& p, uint32_t e) {
    const int64_t row = e & 0x7fffffffu;
    return (e >> 31) ? static_cast<const __nv_bfloat16*>(p.kv_extra) + row * p.extra_row_stride
                     : static_cast<const __nv_bfloat16*>(p.kv_window) + row * p.window_row_stride;
}

// q of heads [h0, h0 + nh) of token t -> a ROWS-row swizzled tile at `dst` by cp.async (16 bytes
// per thread and step, NT threads `tid`; rows past nh zero-filled), and the heads' sink values
// (f32 [ROWS]) to `sink_dst` (4-byte cp.async; not with SINK = false). One commit group; wait with
// cp_async_wait_all.
template <int ROWS, int NT, bool SINK = true>
__device__ __forceinline__ void load_q_tile(const Dsv41SparseAttentionParams& p, int t, int h0, int nh, int tid, uint32_t dst,
                                            uint32_t sink_dst) {
    using namespace dsv41_ptx;
    static_assert(NT % 64 == 0 && ROWS * 64 % NT == 0, "whole rows per step");
    const __nv_bfloat16* qt = static_cast<const __nv_bfloat16*>(p.q) + static_cast<int64_t>(t) * p.q_token_stride;
    const int col = tid & 63;
#pragma unroll 4
    for (int i = 0; i < ROWS * 64 / NT; ++i) {
        const int h = (tid >> 6) + (NT / 64) * i;
        const bool ok = h < nh;
        const __nv_bfloat16* src = qt + (ok ? static_cast<int64_t>(h0 + h) * p.q_head_stride + col * 8 : 0);
        cp_async16(dst + wgsw_rows<ROWS>(h, col), src, ok);
    }
    if (SINK && tid < ROWS) cp_async4(sink_dst + 4 * tid, p.sink + h0 + min(tid, nh - 1));
    cp_async_commit();
}

// Compaction of token t's valid indices in order (window then extra) by IDX_THREADS threads
// (tid < IDX_THREADS; the caller's block barriers separate the steps):
//   load_and_count (all loads first: one memory round trip; `between` runs while they are in
//   flight) -> per-warp valid counts in cnt_s; barrier; scan (warp 0: exclusive offsets, total);
//   barrier; store (the entries of ranks [lo, hi) to ent_s[rank - lo] as (source << 31) | row).
// R: the rounds the code is unrolled for (Kw + Kc <= 256 R). A kernel instantiated for the few
// rounds of its usual shape skips the branches over the unused ones (each costs a fetch redirect:
// ~0.6 us of the prologue at R = 16 and 640 indices, measured on the H200).
template <int R = MAX_ROUNDS>
struct ValidIndicesR {
    static_assert(R >= 1 && R <= MAX_ROUNDS, "index rounds");
    uint32_t code[R];
    unsigned bal[R];
    int rounds;

    template <class Between>
    __device__ __forceinline__ void load_and_count(const Dsv41SparseAttentionParams& p, int t, int tid, int* cnt_s, Between between) {
        const int lane = tid & 31, warp = tid >> 5;
        const int ktot = p.kw + p.kc;
        rounds = (ktot + IDX_THREADS - 1) / IDX_THREADS;
        int64_t raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            code[r] = 0xffffffffu;
            bal[r] = 0u;
            raw[r] = -1;
            const int i = r * IDX_THREADS + tid;
            if (r < rounds && i < ktot) {
                const bool win = i < p.kw;
                const void* base = win ? p.idx_window : p.idx_extra;
                const int64_t k = win ? static_cast<int64_t>(t) * p.kw + i : static_cast<int64_t>(t) * p.kc + (i - p.kw);
                raw[r] = p.index_bytes == 8 ? __ldg(static_cast<const long long*>(base) + k)
                                            : static_cast<int64_t>(__ldg(static_cast<const int32_t*>(base) + k));
            }
        }
        between();
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < rounds) {
                const int i = r * IDX_THREADS + tid;
                const int64_t s = raw[r];
                if (i < p.kw) {
                    if (s >= 0 && s < p.num_window_rows) code[r] = static_cast<uint32_t>(s);
                } else if (i < ktot) {
                    if (s >= 0 && s < p.num_extra_rows) code[r] = 0x80000000u | static_cast<uint32_t>(s);
                }
                bal[r] = __ballot_sync(0xffffffffu, code[r] != 0xffffffffu);
                if (lane == 0) cnt_s[r * 8 + warp] = __popc(bal[r]);
            }
        }
    }

    // Warp 0: exclusive scan over rounds * 8 warp counts (<= 128, 4 consecutive per lane), the
    // total to *total_s.
    __device__ __forceinline__ void scan(int* cnt_s, int* total_s, int lane) const {
        const int n = rounds * 8;
        int v[4], s = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = 4 * lane + i < n ? cnt_s[4 * lane + i] : 0;
            s += v[i];
        }
        const int incl = dsv41_warp::inclusive_sum(s, lane);
        int run = incl - s;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (4 * lane + i < n) cnt_s[4 * lane + i] = run;
            run += v[i];
        }
        if (lane == 31) *total_s = incl;
    }

    __device__ __forceinline__ void store(const int* cnt_s, uint32_t* ent_s, int lo, int hi, int tid) const {
        const int lane = tid & 31, warp = tid >> 5;
        const unsigned lt = (1u << lane) - 1u;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < rounds && code[r] != 0xffffffffu) {
                const int rank = cnt_s[r * 8 + warp] + __popc(bal[r] & lt);
                if (rank >= lo && rank < hi) ent_s[rank - lo] = code[r];
            }
        }
    }
};

// The rounds of the V4.1 decode shape (128 window + 512 extra indices): the launchers take the
// R = FEW_ROUNDS instantiation of a kernel when the token's index count fits it.
constexpr int FEW_ROUNDS = 3;
__host__ __device__ constexpr bool fits_few_rounds(int ktot) { return ktot <= FEW_ROUNDS * IDX_THREADS; }

// The producer warpgroup's loop (thread ptid = 0..127 of it): tile j (rows 64 j .. of the
// nrows entries ent_s) -> stage j & 1 (TILEB bytes each from `stages`) once the consumers
// released it (tile j - 2 consumed: one arrival per consumer warp on bar_empty + 8 (j & 1)).
// bf16 rows: this thread's arrival on bar_full + 8 (j & 1) fires when its copies have landed
// (no waiting here; the barrier counts PROD_THREADS arrivals). Packed rows: the thread waits for
// its copies, expands its slots to bf16 in place (dsv41_attn_rows.cuh), then arrives. 16 groups
// of 8 threads, group gr takes rows gr, gr + 16, gr + 32, gr + 48, thread q of it chunk q of each
// 128-byte plane segment (one warp instruction reads four rows' 128-byte segments); rows past the
// tile's end are zero-filled. `skip_gather` (diagnostic) issues no copies.
__device__ __forceinline__ void produce_tiles(const Dsv41SparseAttentionParams& p, uint32_t stages, const uint32_t* ent_s, int nrows,
                                              uint32_t bar_full, uint32_t bar_empty, int ptid, bool skip_gather) {
    using namespace dsv41_ptx;
    const int ntiles = (nrows + BLK - 1) / BLK;
    const int gr = ptid >> 3, q = ptid & 7;
    const dsv41_rows::RowSource win{static_cast<const unsigned char*>(p.kv_window), p.window_format, p.window_page_size};
    const dsv41_rows::RowSource ext{static_cast<const unsigned char*>(p.kv_extra), p.extra_format, p.extra_page_size};
    const bool any_packed = p.window_format != DSV41_KV_BF16 || p.extra_format != DSV41_KV_BF16;
    auto copy16 = [&](uint32_t dst, const void* src) {
        if (!skip_gather) cp_async16_l2(dst, src, true);
    };
    for (int j = 0; j < ntiles; ++j) {
        const int st = j & 1;
        if (j >= 2) mbar_wait(bar_empty + 8 * st, ((j >> 1) - 1) & 1);
        const int base = j * BLK;
        const int nb = min(BLK, nrows - base);
        const uint32_t dst = stages + st * TILEB;
        int fmt[4];
#pragma unroll
        for (int lr = 0; lr < 4; ++lr) {
            const int r = lr * 16 + gr;
            const bool ok = r < nb;
            const uint32_t e = ok ? ent_s[base + r] : 0u;
            const bool extra = e >> 31;
            fmt[lr] = ok ? (extra ? ext.format : win.format) : DSV41_KV_BF16;
            if (fmt[lr] != DSV41_KV_BF16) {
                dsv41_rows::copy_packed_row(extra ? ext : win, e & 0x7fffffffu, dst, r, q, copy16);
                continue;
            }
            const __nv_bfloat16* src = ok ? row_ptr(p, e) + q * 8 : static_cast<const __nv_bfloat16*>(p.q);
#pragma unroll
            for (int pl = 0; pl < D / 64; ++pl)
                if (!skip_gather) cp_async16_l2(dst + wgsw_rows<BLK>(r, pl * 8 + q), src + (ok ? pl * 64 : 0), ok);
        }
        if (!any_packed) {
            cp_async_mbar_arrive(bar_full + 8 * st);
            continue;
        }
        // (Measured slower: a second tile's copies in flight together with bank-spread raw chunk
        // positions, 44 / 155 us instead of 41 / 131 us at decode B = 64 / 256: the refilled stage
        // frees only after the compute warps' previous tile, which put the expansion on their
        // critical path. Likewise slower: the compute warps expanding the tile after their wait,
        // 42.6 / 139.8 us instead of 40.6 / 130.3.)
        cp_async_wait_all();  // all of this thread's copies, committed or not
        __syncwarp();  // the 8 threads of a row copied its chunks
#pragma unroll
        for (int lr = 0; lr < 4; ++lr) dsv41_rows::expand_packed_slot(fmt[lr], fmt[lr] != DSV41_KV_BF16, dst, lr * 16 + gr, q);
        fence_proxy_async();  // the expanded rows are read by wgmma
        mbar_arrive(bar_full + 8 * st);
    }
}

// Diagnostics of the sparse attention kernels (phase traces, timing-only modes with wrong
// results), a compile-time switch: DSV41_SA_DIAG=1 (build.rs defines it with the crate feature
// `cuda-diag`) compiles them in; the default build has none of their code. Every kernel is a
// template on `bool DIAG`: the production instantiation (DIAG = false) carries no trace or
// diagnostic branch, and only a diagnostic build instantiates DIAG = true, which its launcher
// runs for a call with diagnostic bits set (any index count). The bits come from the environment,
// read at every call of a diagnostic build (a constant 0 in the default build, so the launchers'
// diagnostic branches vanish at compile time too):
//   DSV41_SPARSE_ATTENTION_TRACE=1: bit 0, the phase trace of CTA 0 printed after the call
//     (synchronises the stream); =2: bit 32, the dims-split pair's trace of every 4th
//     back-to-back call (no synchronisation in between).
//   DSV41_SPARSE_ATTENTION_DIAG (bits): 2 no tensor-core products (all-heads kernel), 4 no row
//     gather (every kernel), 8 no early window tiles (ping-pong and dims-split), 64 no merge or
//     epilogue (dims-split: out and lse not written).
#ifndef DSV41_SA_DIAG
#define DSV41_SA_DIAG 0
#endif
constexpr bool DIAG_BUILD = DSV41_SA_DIAG != 0;
#if DSV41_SA_DIAG
inline int diagnostic_mode() {
    const char* tr = getenv("DSV41_SPARSE_ATTENTION_TRACE");
    const char* dg = getenv("DSV41_SPARSE_ATTENTION_DIAG");
    return (tr && tr[0] == '1' ? 1 : 0) | (tr && tr[0] == '2' ? 32 : 0) | (dg ? (atoi(dg) & 78) : 0);
}
#else
constexpr int diagnostic_mode() { return 0; }
#endif

// The head-split kernels' launch (kernels/sparse_attention_heads.cu), called by the launcher of
// kernels/sparse_attention.cu after it validated `p` (bf16 or packed rows, any H): grid (T,
// ceil(H / 32)), no cluster; bf16 rows run the ping-pong kernel unless p.kernel ==
// DSV41_SA_KERNEL_HEAD_SPLIT (then, and for packed rows, the two-stage kernel). Returns a
// cudaError_t or a DSV41 status.
int launch_head_split(const Dsv41SparseAttentionParams& p, cudaStream_t stream, int dev, int max_smem);
// The dims-split pair kernel's launch (kernels/sparse_attention_dimsplit.cu; bf16 rows, `p`
// validated): a cudaError_t or a DSV41 status, DSV41_ERR_SHAPE when its slots do not fit `max_smem`.
int launch_dimsplit_pair(const Dsv41SparseAttentionParams& p, cudaStream_t stream, int dev, int max_smem);

}  // namespace dsv41_sa
