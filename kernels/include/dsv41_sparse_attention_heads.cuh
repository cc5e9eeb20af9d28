// The steps of the head-split decode kernels (kernels/sparse_attention_heads.cu: the two-stage
// kernel, whose header comment describes the design and the fragment layouts;
// kernels/sparse_attention_pingpong.cu: the ping-pong kernel on a slot ring): the barriers and the
// index compaction of the prologue, the Sᵀ staging, the per-tile softmax, the O rescale, the
// epilogue, and the slot ring with its producer. One definition for both kernels, so their
// numerics are the same by construction (up to the ping-pong kernel's f32 summation orders).
#pragma once
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "dsv41_hopper.cuh"
#include "dsv41_sparse_attention_common.cuh"

namespace dsv41_sa {
namespace heads {

using namespace dsv41_ptx;

constexpr int HS = 32;          // heads per CTA
constexpr int CONSUMERS = 128;  // warpgroup 0; warpgroup 1 produces
constexpr int THREADS_ALL = CONSUMERS + PROD_THREADS;
static_assert(THREADS_ALL == IDX_THREADS, "every thread compacts the indices");
// The Sᵀ staging tile: f32 [32 heads][64 rows] (8 KB), row r of head h at word 64 h + (r ^ s_swz(h)):
// the XOR (bits 2-4 of the row) spreads the fragment stores over all banks and keeps the softmax's
// 16-byte reads contiguous (2-way conflicts, as a padded layout).
__device__ __forceinline__ int s_swz(int h) { return (((h >> 1) & 3) << 3) | ((h & 1) << 2); }
constexpr int S_BYTES = HS * BLK * 4;
constexpr int OUT_STRIDE = D * 2 + 16;  // padded bf16 out row (conflict-free pair stores)

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory"); }
// Named barrier `id` over `n` threads (whole warps): wait for all / arrive without waiting (the
// arriving threads' earlier shared-memory accesses are performed for the waiting ones).
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
// Barrier `id` over `n` threads that also returns whether `v` holds in all of them.
__device__ __forceinline__ bool bar_red_and(int id, int n, bool v) {
    uint32_t r;
    asm volatile(
        "{\n.reg .pred q, a;\nsetp.ne.u32 q, %1, 0;\nbar.red.and.pred a, %2, %3, q;\nselp.u32 %0, 1, 0, a;\n}\n"
        : "=r"(r)
        : "r"(static_cast<uint32_t>(v)), "r"(id), "r"(n)
        : "memory");
    return r != 0;
}

// The mbarriers of the head-split kernels (threads tid < nbar): nbar full ones with PROD_THREADS
// arrivals at bar_full, as many empty ones with one arrival per consumer warp at bar_empty (one
// warpgroup consumes each use). The caller's barrier publishes them.
__device__ __forceinline__ void init_barriers(uint32_t bar_full, uint32_t bar_empty, int nbar, int tid) {
    if (tid < nbar) {
        mbar_init(bar_full + 8 * tid, PROD_THREADS);
        mbar_init(bar_empty + 8 * tid, CONSUMERS / 32);
    }
}

// The compaction of token t's valid indices into ent_s (u32 at ent_off) by the threads tid <
// IDX_THREADS (ValidIndicesR<R>), `between()` while their index loads are in flight (the q and sink
// copies); `sync()` is a barrier over all the threads that call this (others may too: they only
// take part in the barriers). Returns the valid count; ent_s is complete only after the caller's
// next barrier. `stamp(1)` marks the indices loaded.
template <int R = MAX_ROUNDS, class Between, class Sync, class Stamp>
__device__ __forceinline__ int compact_indices(const Dsv41SparseAttentionParams& p, unsigned char* smem, int cnt_off, int total_off,
                                               int ent_off, int t, int tid, int lane, int warp, Between between, Sync sync, Stamp stamp) {
    int* cnt_s = reinterpret_cast<int*>(smem + cnt_off);
    int* total_s = reinterpret_cast<int*>(smem + total_off);
    ValidIndicesR<R> vi;
    if (tid < IDX_THREADS) vi.load_and_count(p, t, tid, cnt_s, between);
    sync();
    stamp(1);
    if (warp == 0) vi.scan(cnt_s, total_s, lane);
    sync();
    const int count = *total_s;
    if (tid < IDX_THREADS) vi.store(cnt_s, reinterpret_cast<uint32_t*>(smem + ent_off), 0, count, tid);
    return count;
}

// Sᵀ fragments -> the staging tile (conflict-free stores, see s_swz), then the accumulators are
// zeroed (call only while no product is in flight).
__device__ __forceinline__ void stage_scores(float (&s)[16], float* s_s, int w, int g, int tq) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int h = 8 * i + 2 * tq + (c & 1);
            s_s[h * BLK + ((16 * w + g + 8 * (c >> 1)) ^ s_swz(h))] = s[4 * i + c];
            s[4 * i + c] = 0.f;
        }
}

// Softmax of head hw over rows rq .. +16 of the staged tile (after a barrier): scale, mask rows
// past the tile's end (nb valid rows), tile max (the head's 4 lanes), m_new, bf16 p -> Pᵀ
// [head][row] (two 16-byte stores into the 128-byte-swizzled tile at p_tile), the denominator,
// alpha = e^{m_old - m_new} -> alpha_s[hw] (lanes l % 4 = 0). The caller fences and syncs.
// m_new = max(chain(mx), mx) for the tile max mx: `chain` gives the running max after the
// previous tile (m_run in the two-stage loop; the other consumer's hand-over in the ping-pong
// loop, whose m_run / den / alpha then cover its own tiles only). Every thread reads its scores
// before it calls `chain`.
template <class Chain>
__device__ __forceinline__ void softmax_tile(const float* s_s, unsigned char* p_tile, float* alpha_s, float scale, int nb, int hw,
                                             int rq, int lane, float& m_run, float& den, Chain chain) {
    float x[16];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 v = *reinterpret_cast<const float4*>(s_s + hw * BLK + ((rq + 4 * k) ^ s_swz(hw)));
        x[4 * k] = v.x, x[4 * k + 1] = v.y, x[4 * k + 2] = v.z, x[4 * k + 3] = v.w;
    }
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        x[k] = rq + k < nb ? __fmul_rn(scale, x[k]) : -INFINITY;
        mx = fmaxf(mx, x[k]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(chain(mx), mx);
    const float alpha = expf(m_run - mn);
    m_run = mn;
    float sum = 0.f;
    uint32_t pk[8];
#pragma unroll
    for (int k = 0; k < 16; k += 2) {
        const float e0 = expf(x[k] - mn), e1 = expf(x[k + 1] - mn);
        sum += e0;
        sum += e1;
        pk[k >> 1] = pack_bf16x2_rn(e0, e1);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    den = __fadd_rn(__fmul_rn(den, alpha), sum);
    *reinterpret_cast<uint4*>(p_tile + sw128(hw, rq >> 3)) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
    *reinterpret_cast<uint4*>(p_tile + sw128(hw, (rq >> 3) + 1)) = make_uint4(pk[4], pk[5], pk[6], pk[7]);
    if ((lane & 3) == 0) alpha_s[hw] = alpha;
}

// The per-head factors of a thread's O fragments: al[2 i + c] = alpha_s[8 i + 2 tq + c] (heads of
// o[16 mb + 4 i + c'] with c' % 2 = c).
__device__ __forceinline__ void load_head_factors(float (&al)[8], const float* alpha_s, int tq) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 a2 = *reinterpret_cast<const float2*>(alpha_s + 8 * i + 2 * tq);
        al[2 * i] = a2.x, al[2 * i + 1] = a2.y;
    }
}

// O rescale by its heads' alpha (o[16 mb + 4 i + c] belongs to head 8 i + 2 tq + c % 2).
__device__ __forceinline__ void rescale_o(float (&o)[128], const float* alpha_s, int tq) {
    float al[8];
    load_head_factors(al, alpha_s, tq);
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int c = 0; c < 16; ++c) o[16 * mb + c] *= al[2 * (c >> 2) + (c & 1)];
}

// One head's epilogue factor from its running max m, denominator den (relative to m) and sink, as
// the all-heads kernel's merge with one split: big = max(floor, m), wsum = fl(e^{m - big} den),
// fac = fl(e^{m - big} / (wsum + e^{sink - big})), 0 when that denominator is 0 or not finite;
// lse = big + ln wsum (head_lse; -inf without a valid row).
struct HeadFactor {
    float fac, big, wsum;
};
__device__ __forceinline__ HeadFactor head_factor(float m_run, float den, float sink) {
    const float big = fmaxf(M_FLOOR, m_run);
    const float wsum = __fadd_rn(0.f, __fmul_rn(expf(m_run - big), den));
    const float dall = __fadd_rn(wsum, expf(sink - big));
    const bool ok = dall > 0.f && isfinite(dall);
    return {ok ? __fdiv_rn(expf(m_run - big), dall) : 0.f, big, wsum};
}
__device__ __forceinline__ float head_lse(const HeadFactor& f, bool any_row) { return any_row ? f.big + logf(f.wsum) : -INFINITY; }

// Epilogue (consumer warpgroup): per head the factor 1 / (den + e^{sink - m}) and the lse (lanes
// l % 4 = 0), as the all-heads kernel's merge with one split (bitwise the same factor for the same
// m, den); out = fl(O f) rounded to bf16, transposed by stmatrix into [head][dim] rows at
// out_s / out_a (shared pointer / address, HS * OUT_STRIDE bytes, free), then 16-byte stores
// (the CTA's out rows are contiguous).
// `bar_id`: the named barrier of the warpgroup (128 threads, `tid` 0..127 of them); `sink()`: the
// sink of head hw (called after the q / sink copies landed).
template <class Sink>
__device__ __forceinline__ void epilogue(const Dsv41SparseAttentionParams& p, const float (&o)[128], float m_run, float den, Sink sink,
                                         float* fac_s, const unsigned char* out_s, uint32_t out_a, int t, int h0, int nh, int count,
                                         int hw, int lane, int w, int tid, int bar_id = 1) {
    const int tq = lane & 3;
    cp_async_wait_all();  // the q copies are still in flight when there is no row
    bar_sync(bar_id, CONSUMERS);  // the sink landed for every thread
    if ((lane & 3) == 0) {
        const HeadFactor f = head_factor(m_run, den, sink());
        fac_s[hw] = f.fac;
        if (hw < nh) p.lse[static_cast<int64_t>(t) * p.num_heads + h0 + hw] = head_lse(f, count > 0);
    }
    bar_sync(bar_id, CONSUMERS);
    float fac[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f2 = *reinterpret_cast<const float2*>(fac_s + 8 * i + 2 * tq);
        fac[2 * i] = f2.x, fac[2 * i + 1] = f2.y;
    }
    // Matrix (i, hf) of m-block mb = dims 64 mb + 16 w + 8 hf .. +8 of heads 8 i .. +8.
    auto scaled = [&](int idx, int k) { return __fadd_rn(0.f, __fmul_rn(o[idx], fac[k])); };
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int ip = 0; ip < 2; ++ip) {
            uint32_t r[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int i = 2 * ip + (k >> 1), base = 16 * mb + 4 * i + 2 * (k & 1);
                r[k] = pack_bf16x2_rn(scaled(base, 2 * i), scaled(base + 1, 2 * i + 1));
            }
            const int mat = lane >> 3, i = 2 * ip + (mat >> 1), hf = mat & 1;
            stmatrix_x4_trans(out_a + (8 * i + (lane & 7)) * OUT_STRIDE + (64 * mb + 16 * w + 8 * hf) * 2, r[0], r[1], r[2], r[3]);
        }
    bar_sync(bar_id, CONSUMERS);
    __nv_bfloat16* orow = static_cast<__nv_bfloat16*>(p.out) + (static_cast<int64_t>(t) * p.num_heads + h0) * D;
    const int items = nh * (D / 8);
#pragma unroll 4
    for (int c = tid; c < items; c += CONSUMERS)
        *reinterpret_cast<uint4*>(orow + c * 8) = *reinterpret_cast<const uint4*>(out_s + (c >> 6) * OUT_STRIDE + (c & 63) * 16);
}

// Early window tiles (the producer warpgroup of the ping-pong and dims-split kernels, thread ptid;
// needs p.kw >= PROD_THREADS = 2 BLK): token t's window entry ptid -> win_s[ptid]; returns whether
// the first 128 are all valid (then they are the token's first 128 compacted rows, tiles 0 and 1),
// after the producer warpgroup's named barrier `bar_id`, which also publishes win_s to it.
__device__ __forceinline__ bool early_window_entries(const Dsv41SparseAttentionParams& p, int t, int ptid, uint32_t* win_s, int bar_id) {
    static_assert(PROD_THREADS == 2 * BLK, "one entry per producer thread");
    const int64_t k = static_cast<int64_t>(t) * p.kw + ptid;
    const int64_t e = p.index_bytes == 8 ? __ldg(static_cast<const long long*>(p.idx_window) + k)
                                         : static_cast<int64_t>(__ldg(static_cast<const int32_t*>(p.idx_window) + k));
    const bool ok = e >= 0 && e < p.num_window_rows;
    win_s[ptid] = static_cast<uint32_t>(e);
    return bar_red_and(bar_id, PROD_THREADS, ok);
}

// Slot ring (the ping-pong kernel): the row tiles live in `nslot` slots of two 64-dim planes (16 KB,
// one plane = PLANE bytes of the 128-byte-swizzled 64-row layout); pair pr (planes 2 pr, 2 pr + 1)
// of tile k is ring position P = 4 k + pr, in slot P % nslot for its (P / nslot)-th use. Slot s has
// a full mbarrier (bar_full + 8 s, PROD_THREADS arrivals) and an empty one (bar_empty + 8 s, one
// arrival per warp of the consumer of that use). The positions of a tile, with their full barriers
// and parities:
struct TileSlots {
    int s0, u0;  // slot and use of pair 0
    uint32_t slots, bar_full;
    int nslot;
    __device__ __forceinline__ void locate(int k) { s0 = (4 * k) % nslot, u0 = (4 * k) / nslot; }
    __device__ __forceinline__ void advance() {  // to the next tile (4 positions on)
        s0 += 4;
        if (s0 >= nslot) s0 -= nslot, ++u0;
    }
    __device__ __forceinline__ int slot(int pr) const { return s0 + pr < nslot ? s0 + pr : s0 + pr - nslot; }
    __device__ __forceinline__ uint32_t addr(int pr) const { return slots + static_cast<uint32_t>(slot(pr)) * (2 * PLANE); }
    __device__ __forceinline__ uint32_t full(int pr) const { return bar_full + 8 * slot(pr); }
    __device__ __forceinline__ uint32_t parity(int pr) const { return (s0 + pr < nslot ? u0 : u0 + 1) & 1; }
};

// The ring producer (thread ptid = 0..127 of the producer warpgroup; bf16 rows only): ring
// positions [pos0, pos1) (multiples of 4 = whole tiles; tile k's rows are entries 64 k .. of the
// nrows entries ent_s). Position P waits until the consumers released the slot's previous use
// (position P - nslot), copies its two planes of the tile's rows (16 groups of 8 threads as
// produce_tiles: group gr rows gr + 16 lr, thread q chunk q; rows past the tile's end zero-filled)
// and arrives on the slot's full barrier once its copies landed (no waiting here).
// `skip_gather` (diagnostic) issues no copies.
__device__ __forceinline__ void produce_ring(const Dsv41SparseAttentionParams& p, uint32_t slots, int nslot, const uint32_t* ent_s,
                                             int nrows, uint32_t bar_full, uint32_t bar_empty, int ptid, bool skip_gather, int pos0,
                                             int pos1) {
    const int gr = ptid >> 3, q = ptid & 7;
    const __nv_bfloat16* src[4];
    bool ok[4];
    int s = pos0 % nslot, u = pos0 / nslot;
    for (int pos = pos0; pos < pos1; ++pos) {
        const int pr = pos & 3;
        if (pr == 0) {
            const int base = (pos >> 2) * BLK, nb = min(BLK, nrows - base);
#pragma unroll
            for (int lr = 0; lr < 4; ++lr) {
                const int r = lr * 16 + gr;
                ok[lr] = r < nb;
                src[lr] = ok[lr] ? row_ptr(p, ent_s[base + r]) + q * 8 : static_cast<const __nv_bfloat16*>(p.q);
            }
        }
        if (u > 0) mbar_wait(bar_empty + 8 * s, (u - 1) & 1);
        const uint32_t dst = slots + static_cast<uint32_t>(s) * (2 * PLANE);
#pragma unroll
        for (int lr = 0; lr < 4; ++lr) {
            const int r = lr * 16 + gr;
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (!skip_gather)
                    cp_async16_l2(dst + h * PLANE + r * 128 + ((q ^ (r & 7)) << 4), src[lr] + (ok[lr] ? (2 * pr + h) * 64 : 0), ok[lr]);
        }
        cp_async_mbar_arrive(bar_full + 8 * s);
        if (++s == nslot) s = 0, ++u;
    }
}

}  // namespace heads

// The ping-pong kernel's launch (kernels/sparse_attention_pingpong.cu; bf16 rows, `p` validated):
// a cudaError_t or a DSV41 status, DSV41_ERR_SHAPE when its slots do not fit `max_smem`.
int launch_head_split_pingpong(const Dsv41SparseAttentionParams& p, cudaStream_t stream, int dev, int max_smem);

}  // namespace dsv41_sa
