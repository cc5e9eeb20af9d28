// indexer_scores: lightning-indexer scores (spec §6.3, §0.1b.1) of T queries against an
// index-key cache of bf16 rows or packed MXFP4 68 B rows (§7.2 E), with the visibility rule and
// an optional allowed-block mask (candidate consumers, §6.4; built from the kept candidate blocks
// by kernels/indexer_allowed_mask.cu).
//
//   S[t, j] = bf16( sum_h bf16( relu(bf16(q[t,h] . K[j])) * w[t,h] ) )     (h ascending, f32 sum)
//
// Numerics: the reference's bf16 steps exactly (`attention::indexer::index_scores`): the 128-term
// dot product accumulates in f32 on the tensor cores, is rounded to bf16, ReLU'd, multiplied by
// the f32 (bf16-valued) head weight, rounded to bf16; the head sum runs in f32 from +0 in head
// order (the CPU's order) and is rounded to bf16. The only possible difference to the CPU is the
// f32 order inside the dot product; with fake-quantized q and K (Q3: e2m1 x 2^e, spec §2.3) every
// product and the partial sums of a 32-block are exact, so the scores match bit for bit except
// when two blocks' scales differ by more than ~2^10.
//
// Packed keys are dequantized in registers without tables (include/dsv41_ix_keys.cuh): the two
// e2m1 codes of a bf16x2 are copied by one integer multiply into the bit positions of
// code * 2^-126 (magnitude at bits 6..8, sign at 15; code 0.5 is the bf16 subnormal 2^-127),
// then one bf16x2 multiply by
// 2^(e-1) gives code * 2^(e-127) exactly; scale bytes e > 128 (values >= 2^2, not reached by
// k_norm'd keys) take a second multiply, in a separate copy of the tile loop chosen per warp
// and iteration (vote) so that the common path is straight-line code. e = 0 relies on bf16
// subnormal arithmetic. ~17 instructions per 8 dims.
//
// Design: mma.sync m16n8k16 bf16 (plain sm_80+ tensor-core path). A warp owns one token: its
// 32 (H <= 32, rows >= H zero) x 128 query block as A fragments; row slot hh of lane group g is
// head 4g + hh, so that a lane's accumulators hold heads 4g..4g+3 of each of its keys (one
// 8-byte shared store per key). Per iteration the warp scores 32 keys (4 n8 tiles): each lane
// (group g, column c) takes 32 contiguous dims [32c, 32c+32) of key g of every tile (bf16: 4 x
// 16 B; packed: 16 B plus the row's 4 scale bytes - exactly its 32-block), so the dot product's
// k-dimension is PERMUTED consistently for A and B (bf16 keys: register i = dims (2i, 2i+1) of
// the slice; packed keys: register 4i + p = dims (8i + p, 8i + p + 4), the order the nibbles
// unpack in; q is permuted the same way when loaded).
//  * Packed keys are staged one iteration ahead with cp.async into a per-warp double buffer in
//    shared memory: lane l divides the slot of entry key0 + l by the page size (multiply-high),
//    copies that row's scale word and hands the row's address to the 4 lanes that take its 16 B
//    slices (shuffles). Entries past L_t read the row of entry 0 (their scores are never written).
//  * Entry j of token t lies at row key_base[t] + j, or with a page table (the batched decode
//    step's paged pools) at row table[t][j / P] * P + j % P (P a power of two: a shift and a
//    mask per key; a page outside the cache reads row 0, never past the cache).
//  * Decode (one token per CTA, packed keys): the A fragments live in shared memory (8 KB per
//    CTA, shared by its 4 warps) and are read per k-step (2 LDS.128), the slices dequantized per
//    k-step: <= 128 registers, 4 CTAs (16 warps) per SM instead of 3 with 64 A registers per lane
//    (more warps to hide latency; 20 warps measured no faster).
//  * bf16 keys and prefill over shared keys (4 tokens per CTA): A fragments in registers (64),
//    3 CTAs per SM; bf16 rows are loaded per iteration (they stream at the HBM rate anyway).
// The per-head products go through a per-warp shared buffer [32 keys][32 heads] so that lane i
// sums key i's heads in order. TQ = 1 (decode, or per-token keys): the 4 warps split the CTA's
// 2048-key chunk; TQ = 4 (prefill sharing keys): 4 tokens, the same 512 keys (L1 reuse).
// Entries j >= L_t (and those whose key row lies past the cache) are written as -inf without
// any key read.
// Work distribution, the only difference between the kernels (one tile loop, score_span): a
// (token, chunk) grid (indexer_scores_kernel: decode of < 64 queries, bf16 keys, prefill), or for
// packed decode batches of 64..1024 queries resident CTAs taking equal shares of all tokens'
// visible entries (indexer_scores_balanced_kernel).
// One code form (the options measured on the balanced kernel, in every kernel, no numeric
// change): both m-tiles' MMAs for every H (rows >= H are zero; their heads are not summed), the
// common path's scale multiplier without a select, 32-bit entry ids, the lane,
// staging and product-buffer addresses (32-bit shared) and a loop-carried score pointer held in
// registers (packed keys; with bf16 keys' 64 key registers they would spill), the head sum of
// every lane without a branch (a predicated store), the score's bf16 from one F2FP and a select
// (measured on the H200, the grid kernels: scores at B = 16 / 32 -4 %, prefill select -9 %).
// Compile-time options (V): V_SPEC, a copy for H = 32 without a mask (the model's); V_I8, below.
// The kernels are latency-bound (fixed-latency dependencies and dispatch stalls at ~60 % issue).
// Integer MMAs (V_I8; the balanced kernel): tokens whose q is exactly s8 x 2^Eq per
// head (Q3 queries) and warp iterations whose keys' block scales span <= 3 run s8 x s8 m16n8k32
// IMMA (exact; 11 instructions per 8 dims, half the MMAs; dsv41_ix_int8.cuh has the numerics)
// with the same k permutation (word s of a lane's slice = k32-step s), else the bf16 path above;
// same scores bit for bit. The s8 A fragments live in shared memory (4 KB per CTA, converted by
// its 4 warps once per span). B = 256: 542 instead of 611 warp instructions per iteration. The
// grid kernels keep the bf16 path (docs/cuda.md, "indexer_scores: tried and not kept"): with V_I8
// the grid decode kernel was 10 % slower at B = 1 and 2-4 % at B = 16 / 32 (a span of <= 16 iterations
// per warp does not repay the conversion and its barrier), and the prefill kernel with s8
// fragments per warp 10 % slower. (On sm_90 mma.sync e4m3 is not FP8 hardware: ptxas emits
// F2FP -> f16 conversions + HMMA.16816.)
// What was measured and not kept (f32 product words, lane-pair staging, bf16x2-FMA unpacking of
// the products, work stealing, ...) is listed in docs/cuda.md, "indexer_scores: tried and not kept".
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "include/dsv41_hopper.cuh"
#include "include/dsv41_indexer.h"
#include "include/dsv41_ix_int8.cuh"
#include "include/dsv41_ix_keys.cuh"
#include "include/dsv41_warp.cuh"

namespace dsv41_ix {

constexpr int D = 128;
constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int KT = 32;           // keys per warp iteration (4 n8 tiles)
constexpr int PROD_STRIDE = 40;  // bf16 per key row of the product buffer (80 B: conflict-free)
constexpr uint16_t BF16_NEG_INF = 0xFF80;

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Products bf16(relu(bf16(acc)) * w) of two accumulator entries as bf16x2, the ReLU in the f32 ->
// bf16x2 conversion (cvt.rn.relu: relu(bf16(x)) = bf16(relu(x)), rounding keeps the sign; -0
// becomes +0, which the head sum from +0 cannot tell apart).
__device__ __forceinline__ uint32_t head_products(float a0, float a1, uint32_t w2) {
    uint32_t r;
    asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(a1), "f"(a0));
    return bf16x2_mul(r, w2);
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// Entries of token t with a key row (the visible L_t; with key_base clamped to the rows past
// key_base[t]: entries past the cache count as invisible) and how to find entry j's row.
struct Extent {
    int64_t L, kbase;
    const int64_t* table;  // the token's page-table row, or null (rows kbase + j)
    uint32_t shift, mask;  // log2(P), P - 1
    int64_t rows;          // num_key_rows
    // The key row of entry j (j < L, or 0).
    __device__ __forceinline__ int64_t row(uint32_t j) const {
        if (!table) return kbase + j;
        const int64_t r = __ldg(table + (j >> shift)) * (static_cast<int64_t>(mask) + 1) + (j & mask);
        return r >= 0 && r < rows ? r : 0;
    }
};
__device__ __forceinline__ Extent token_extent(const Dsv41IndexerScoresParams& p, int64_t t) {
    const int64_t n = p.num_cols;
    int64_t L = p.visible ? static_cast<int64_t>(p.visible[t]) : (p.start + t + 1) / p.ratio;
    L = L < n ? L : n;
    Extent e;
    e.rows = p.num_key_rows;
    e.table = p.page_table ? p.page_table + t * p.page_table_stride : nullptr;
    e.shift = p.page_table ? static_cast<uint32_t>(__ffs(p.table_page_size) - 1) : 0u;
    e.mask = p.page_table ? static_cast<uint32_t>(p.table_page_size - 1) : 0u;
    e.kbase = p.key_base ? static_cast<int64_t>(p.key_base[t]) : 0;
    // Afterwards every j < L has a key row (kbase + j < num_key_rows, or through the table),
    // and row(0) exists whenever L >= 1.
    const int64_t rows_left = e.table ? (p.num_key_rows > 0 ? L : 0) : p.num_key_rows - e.kbase;
    e.L = L < rows_left ? L : (rows_left > 0 ? rows_left : 0);
    return e;
}

// Scores of token t (TQ = 1; TQ = 4: tokens t..t+3, one per warp) for the n_it warp iterations
// of 32 keys from entry chunk0 (TQ = 1: warp w takes iterations w, w + 4, ...). Every warp of
// the CTA calls it with the same arguments (TQ = 1: it holds a CTA barrier). One code form for
// every kernel (the grid kernels and the balanced one differ only in how they hand out spans);
// its compile-time options (bits of V, chosen at launch; same numerics in every form):
constexpr int V_SPEC = 1;  // H = 32 and no allowed mask as compile-time facts (the model's decode)
constexpr int V_I8 = 2;    // packed keys: the integer MMAs (dsv41_ix_int8.cuh) with the bf16 fallbacks

template <int KF, int TQ, int V>
__device__ __forceinline__ void score_span(const Dsv41IndexerScoresParams& p, const int64_t t, const int64_t chunk0,
                                           const int n_it) {
    constexpr bool kPacked = KF == DSV41_INDEX_KEYS_MXFP4;
    constexpr bool kSharedA = kPacked && TQ == 1;
    constexpr bool kI8 = kPacked && (V & V_I8) != 0;
    constexpr bool kSpec = (V & V_SPEC) != 0;
    // (The integer path needs the CTA's shared A fragments; the prefill kernel with s8 fragments per
    // warp was 10 % slower: docs/cuda.md "indexer_scores: tried and not kept", the form measured in
    // commit 74ed9c9.)
    static_assert(!kI8 || kSharedA, "V_I8: packed keys, one token per CTA");
    // Per warp: bf16 products [32 keys][PROD_STRIDE halves], key-major so a lane reads its key's
    // heads with 16-byte loads.
    __shared__ __align__(16) uint16_t prod[WARPS][32 * PROD_STRIDE];
    // kSharedA: qsh[s][m][lane] = the lane's A fragment of k-step s, m-tile m.
    __shared__ __align__(16) uint4 qsh[kSharedA ? 8 : 1][2][32];
    // kI8: qsh8[s][m][lane] = the lane's s8 A fragment of k32-step s, m-tile m.
    __shared__ __align__(16) uint4 qsh8[kI8 ? 4 : 1][2][32];
    // Packed keys, per warp and buffer: the slices [tile][lane] and the 32 keys' scale words.
    __shared__ __align__(16) uint4 kst_d[kPacked ? WARPS : 1][2][4][32];
    __shared__ __align__(16) uint32_t kst_s[kPacked ? WARPS : 1][2][32];
    // Warp and lane held in registers (not recomputed from SR_TID per iteration, a variable-latency read).
    int warp_r = threadIdx.x / 32, lane_r = threadIdx.x % 32;
    if constexpr (kPacked) {
        asm volatile("" : "+r"(warp_r));
        asm volatile("" : "+r"(lane_r));
    }
    const int warp = warp_r, lane = lane_r;
    const int g = lane / 4, c = lane % 4;
    const int step = TQ == 1 ? WARPS : 1;
    const int first = TQ == 1 ? warp : 0;
    const int64_t n = p.num_cols;
    const Extent ext = token_extent(p, t);
    const int64_t L = ext.L;
    uint16_t* out = reinterpret_cast<uint16_t*>(p.scores) + t * p.score_row_stride;
    const uint32_t* allowed = kSpec ? nullptr : (p.allowed ? p.allowed + t * p.allowed_words : nullptr);
    const int H = kSpec ? 32 : p.num_heads;
    uint16_t* pw = prod[warp];

    // Entries past L: -inf without reading keys.
    for (int it = first; it < n_it; it += step) {
        const int64_t key0 = chunk0 + static_cast<int64_t>(it) * KT;
        if (key0 >= n) break;
        if (key0 >= L && key0 + lane < n) out[key0 + lane] = BF16_NEG_INF;
    }
    auto valid = [&](int it) { return it < n_it && chunk0 + static_cast<int64_t>(it) * KT < L; };
    int it = first;
    // Everything from the A fragments on; a warp without work returns from it early (TQ = 1:
    // after the A-fragment barrier).
    auto span = [&]() {
        if (!kSharedA && !valid(it)) return;

        // A fragments: row slot hh of lane group g is head 4g + hh (slots 0, 1: rows g, g + 8 of
        // m-tile 0; slots 2, 3: of m-tile 1), so that a lane's C fragments hold heads 4g..4g+3 of
        // each of its keys; qa[hh][i] = dims (32c + 2i, +1) of that head (zero for heads >= H).
        // w2[m] = the weights of heads (4g + 2m, 4g + 2m + 1) as bf16x2.
        uint32_t qa[4][16], w2[2];
        auto load_q = [&]() {
            const __nv_bfloat16* q0 = static_cast<const __nv_bfloat16*>(p.q);
#pragma unroll
            for (int hh = 0; hh < 4; ++hh) {
                const int h = 4 * g + hh;
                if (h < H) {
                    const uint4* src = reinterpret_cast<const uint4*>(q0 + (t * H + h) * D + 32 * c);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const uint4 v = __ldg(src + i);
                        if (kPacked) {
                            // The packed slices' dim order: register 4i + p = dims (8i + p, 8i + p + 4).
                            qa[hh][4 * i] = __byte_perm(v.x, v.z, 0x5410);
                            qa[hh][4 * i + 1] = __byte_perm(v.x, v.z, 0x7632);
                            qa[hh][4 * i + 2] = __byte_perm(v.y, v.w, 0x5410);
                            qa[hh][4 * i + 3] = __byte_perm(v.y, v.w, 0x7632);
                        } else {
                            qa[hh][4 * i] = v.x;
                            qa[hh][4 * i + 1] = v.y;
                            qa[hh][4 * i + 2] = v.z;
                            qa[hh][4 * i + 3] = v.w;
                        }
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 16; ++i) qa[hh][i] = 0u;
                }
            }
        };
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            uint32_t wb[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int h = 4 * g + 2 * m + e;
                wb[e] = h < H ? static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(p.w[t * H + h]))) : 0u;
            }
            w2[m] = wb[0] | (wb[1] << 16);
        }
        load_q();
        // kI8: whether the token takes the integer MMAs, and the scaled weights w2i[m] (w_h * 2^Eq_h,
        // bf16x2).
        bool tok_i8 = false;
        uint32_t w2i[2] = {0u, 0u};
        if constexpr (kSharedA) {
            // Warp w stores k-steps 2w, 2w + 1 (all warps hold the same token's fragments).
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                if ((s >> 1) == warp) {
                    qsh[s][0][lane] = make_uint4(qa[0][2 * s], qa[1][2 * s], qa[0][2 * s + 1], qa[1][2 * s + 1]);
                    qsh[s][1][lane] = make_uint4(qa[2][2 * s], qa[3][2 * s], qa[2][2 * s + 1], qa[3][2 * s + 1]);
                }
            }
            if constexpr (kI8) tok_i8 = dsv41_ix_i8::int8_queries(p, t, H, qa, qsh8, w2i);
            else __syncthreads();
            if (!valid(it)) return;
        }

        // bf16 rows: loaded by the lanes that use them; an entry past L reads entry 0's row (it
        // exists: the tile's key0 < L) and is zeroed. (32-bit entry ids: key0 < L <= N < 2^31.)
        const PageDiv pd(kPacked ? static_cast<uint32_t>(p.page_size) : 2u);
        auto fetch = [&](KeySlice<KF>& ks, int64_t key0, int nt) {
            if constexpr (!kPacked) {
                const uint32_t j = static_cast<uint32_t>(key0) + static_cast<uint32_t>(nt * 8 + g);
                const bool ok = j < static_cast<uint32_t>(L);
                ks.fetch(p, pd, ext.row(ok ? j : 0u), c);
                if (!ok) ks.zero();
            }
        };
        // Packed rows: lane l finds the page and row of entry key0 + l (slot < 2^32, page bytes <
        // 2^32: the launcher checks), copies its scale word and hands the row's address to the lanes
        // that copy its 16-byte slices. Entries past L read entry 0's row; their scores are not written.
        const uint64_t keys64 = reinterpret_cast<uint64_t>(p.keys);
        const uint32_t pstride = static_cast<uint32_t>(p.key_row_stride);
        const uint32_t psize = static_cast<uint32_t>(p.page_size);
        // Shared addresses (held in registers) of this lane's staging slots in buffer 0 (cp.async
        // destinations), of its product stores (key 2c, heads 4g..) and of its key's product row.
        uint32_t kst_s_addr = dsv41_ptx::smem_addr(&kst_s[kPacked ? warp : 0][0][lane]);
        uint32_t kst_d_addr = dsv41_ptx::smem_addr(&kst_d[kPacked ? warp : 0][0][0][lane]);
        uint32_t prod_st = dsv41_ptx::smem_addr(pw + 2 * c * PROD_STRIDE + 4 * g);
        uint32_t prod_ld = dsv41_ptx::smem_addr(pw + lane * PROD_STRIDE);
        if constexpr (kPacked) {  // (bf16 keys: 64 registers of key data per iteration; pinned, these spill)
            asm volatile("" : "+r"(kst_s_addr));
            asm volatile("" : "+r"(kst_d_addr));
            asm volatile("" : "+r"(prod_st));
            asm volatile("" : "+r"(prod_ld));
        }
        auto stage = [&](int64_t key0, int buf) {
            const uint32_t j = static_cast<uint32_t>(key0) + static_cast<uint32_t>(lane);
            const uint32_t slot = static_cast<uint32_t>(ext.row(j < static_cast<uint32_t>(L) ? j : 0u));
            const uint32_t page = pd.div(slot);
            const uint32_t r = slot - page * psize;
            const uint64_t pb = static_cast<uint64_t>(page) * pstride + keys64;
            const uint64_t row = static_cast<uint64_t>(r) * 64u + pb;
            cp_async4(kst_s_addr + buf * static_cast<uint32_t>(sizeof(kst_s[0][0])),
                      reinterpret_cast<const void*>(static_cast<uint64_t>(r + 16u * psize) * 4u + pb));
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const uint32_t lo = __shfl_sync(0xFFFFFFFFu, static_cast<uint32_t>(row), nt * 8 + g);
                const uint32_t hi = __shfl_sync(0xFFFFFFFFu, static_cast<uint32_t>(row >> 32), nt * 8 + g);
                const uint64_t src = ((static_cast<uint64_t>(hi) << 32) | lo) + 16u * c;
                dsv41_ptx::cp_async16(kst_d_addr + buf * static_cast<uint32_t>(sizeof(kst_d[0][0])) + nt * 512u,
                                      reinterpret_cast<const void*>(src), true);
            }
            dsv41_ptx::cp_async_commit();
        };
        int buf = 0;
        if constexpr (kPacked) stage(chunk0 + static_cast<int64_t>(it) * KT, 0);
        // This lane's score of the current iteration (a loop-carried pointer).
        uint16_t* optr = out + chunk0 + static_cast<int64_t>(it) * KT + lane;
        while (valid(it)) {
            const int64_t key0 = chunk0 + static_cast<int64_t>(it) * KT;
            const int next = it + step;
            KeySlice<KF> cur[4];
            uint32_t s_own = 0u;  // kI8: the scale word of this lane's key key0 + lane
            if constexpr (kPacked) {
                dsv41_ptx::cp_async_wait_all();
                __syncwarp();  // the scale words were copied by other lanes
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    cur[nt].d = kst_d[warp][buf][nt][lane];
                    cur[nt].s4 = kst_s[warp][buf][nt * 8 + g];
                }
                if constexpr (kI8) s_own = kst_s[warp][buf][lane];
                if (valid(next)) stage(chunk0 + static_cast<int64_t>(next) * KT, buf ^ 1);
                buf ^= 1;
            } else {
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) fetch(cur[nt], key0, nt);
            }
            // (kI8: dead in the integer path; zeroing in the bf16 branch instead spills.)
            float acc[4][2][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc[nt][mt][r] = 0.f;
            // Dequantize and multiply the 4 n8 tiles (both m-tiles for every H: rows >= H are zero,
            // their heads are not summed); one straight-line section per scale range.
            auto scores = [&](auto wide) {
                constexpr bool W = decltype(wide)::value;
                if constexpr (kSharedA) {
                    // Per k-step: the A fragments from shared memory, 2 B registers per tile.
                    uint32_t sc[4], sc2[4];
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt) cur[nt].template scales_for<W>(c, sc[nt], sc2[nt]);
#pragma unroll
                    for (int s = 0; s < 8; ++s) {
                        const uint4 a0 = qsh[s][0][lane], a1 = qsh[s][1][lane];
#pragma unroll
                        for (int nt = 0; nt < 4; ++nt) {
                            uint32_t k0, k1;
                            cur[nt].template step<W>(s, sc[nt], sc2[nt], k0, k1);
                            mma_bf16(acc[nt][0], a0.x, a0.y, a0.z, a0.w, k0, k1);
                            mma_bf16(acc[nt][1], a1.x, a1.y, a1.z, a1.w, k0, k1);
                        }
                    }
                } else {
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt) {
                        uint32_t kb[16];
                        cur[nt].template expand<W>(c, kb);
#pragma unroll
                        for (int s = 0; s < 8; ++s) {
                            mma_bf16(acc[nt][0], qa[0][2 * s], qa[1][2 * s], qa[0][2 * s + 1], qa[1][2 * s + 1],
                                     kb[2 * s], kb[2 * s + 1]);
                            mma_bf16(acc[nt][1], qa[2][2 * s], qa[3][2 * s], qa[2][2 * s + 1], qa[3][2 * s + 1],
                                     kb[2 * s], kb[2 * s + 1]);
                        }
                    }
                }
            };
            // kI8: the integer MMAs when the token's q converted and every key of the warp has
            // block scales spanning <= 3 (Emin_j = its smallest scale byte, within the bounds).
            bool use_i8 = false;
            uint32_t emin = 0u;
            if constexpr (kI8) {
                using namespace dsv41_ix_i8;
                uint32_t emax;
                byte_range(s_own, emin, emax);
                const bool kok = emax - emin <= 3u && emin + EXP_BOUND >= 128u && emin <= 128u + EXP_BOUND;
                use_i8 = __all_sync(0xFFFFFFFFu, tok_i8 && kok);
                if (use_i8) {
                    // Tables of the lane's (key nt * 8 + g, block c); its Emin from the key's lane.
                    Lut lut[4];
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt) lut[nt].set(cur[nt].scale_byte(c) - __shfl_sync(0xFFFFFFFFu, emin, nt * 8 + g));
                    int acci[4][2][4];
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                            for (int r = 0; r < 4; ++r) acci[nt][mt][r] = static_cast<int>(MAGIC_BITS);
#pragma unroll
                    for (int s = 0; s < 4; ++s) {
                        const uint4 a0 = qsh8[s][0][lane], a1 = qsh8[s][1][lane];
#pragma unroll
                        for (int nt = 0; nt < 4; ++nt) {
                            const uint32_t wd[4] = {cur[nt].d.x, cur[nt].d.y, cur[nt].d.z, cur[nt].d.w};
                            uint32_t b0, b1;
                            lut[nt].expand(wd[s], b0, b1);
                            mma_s8(acci[nt][0], a0.x, a0.y, a0.z, a0.w, b0, b1);
                            mma_s8(acci[nt][1], a1.x, a1.y, a1.z, a1.w, b0, b1);
                        }
                    }
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                            for (int r = 0; r < 4; ++r) acc[nt][mt][r] = __int_as_float(acci[nt][mt][r]) - MAGIC;
                }
            }
            if (!use_i8) {
                bool wide = false;
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) wide |= cur[nt].wide_scale(c);
                if (__any_sync(0xFFFFFFFFu, wide)) scores(std::true_type{});
                else scores(std::false_type{});
            }
            // The products' weights, and the power of two the head sum is scaled by (kI8).
            const uint32_t wp0 = use_i8 ? w2i[0] : w2[0], wp1 = use_i8 ? w2i[1] : w2[1];
            const float kscale = use_i8 ? dsv41_ix_i8::exp2i(static_cast<int>(emin) - 128) : 1.f;
            // Per-head products (bf16) into the warp's buffer: pw[key * PROD_STRIDE + h]; a lane
            // writes heads 4g..4g+3 of each of its keys at once (8 B; 2 wavefronts per warp).
            __syncwarp();
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const uint32_t x = head_products(acc[nt][0][e], acc[nt][0][2 + e], wp0);
                    const uint32_t y = head_products(acc[nt][1][e], acc[nt][1][2 + e], wp1);
                    asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(
                                     prod_st + static_cast<uint32_t>((nt * 8 + e) * PROD_STRIDE * 2)),
                                 "r"(x), "r"(y)
                                 : "memory");
                }
            __syncwarp();
            // Lane = key: the head sum in head order, f32 from +0 (heads >= H hold 0 products
            // but are not added). Every lane's key row of the product buffer was written (keys
            // past N or L hold products of entry 0's row or zero rows): no branch around it.
            float sum = 0.f;
            auto add_heads = [&](auto all) {
#pragma unroll
                for (int q8 = 0; q8 < 4; ++q8) {
                    uint4 v;
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                                 : "r"(prod_ld + 16u * q8)
                                 : "memory");
                    const uint32_t ws[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const float x = __uint_as_float((i & 1) ? (ws[i / 2] & 0xFFFF0000u) : (ws[i / 2] << 16));
                        if (decltype(all)::value || 8 * q8 + i < H) sum = __fadd_rn(sum, x);
                    }
                }
            };
            if (H == 32) add_heads(std::true_type{});
            else add_heads(std::false_type{});
            if constexpr (kI8) sum *= kscale;
            // 32-bit entry ids (j < N < 2^31); bf16(sum) in the low half of one register (F2FP with
            // a zero high half); a predicated store.
            const uint32_t j = static_cast<uint32_t>(key0) + static_cast<uint32_t>(lane);
            bool ok = j < static_cast<uint32_t>(L);
            if (ok && allowed) {
                const uint32_t b = j / static_cast<uint32_t>(p.allowed_block);
                ok = b < 32ull * static_cast<uint64_t>(p.allowed_words) && ((allowed[b / 32] >> (b % 32)) & 1u);
            }
            uint32_t v;
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(v) : "f"(0.f), "f"(sum));
            v = ok ? v : BF16_NEG_INF;
            if (j < static_cast<uint32_t>(n)) *optr = static_cast<uint16_t>(v);
            it = next;
            optr += step * KT;
        }
    };
    span();
}

// One CTA per token (group of TQ tokens) and chunk of iters x WARPS / TQ warp iterations. Decode
// over packed keys (A fragments in shared memory): 4 CTAs per SM (<= 128 registers); otherwise 3
// (<= 170 registers: the A fragments alone take 64).
template <int KF, int TQ, int V>
__global__ void __launch_bounds__(THREADS, (KF == DSV41_INDEX_KEYS_MXFP4 && TQ == 1) ? 4 : 3)
    indexer_scores_kernel(const Dsv41IndexerScoresParams p, const int iters) {
    const int64_t t = static_cast<int64_t>(blockIdx.x) * TQ + (TQ == 1 ? 0 : threadIdx.x / 32);
    if (t >= p.num_tokens) return;  // CTA-uniform when TQ = 1
    const int n_it = iters * (WARPS / TQ);
    score_span<KF, TQ, V>(p, t, static_cast<int64_t>(blockIdx.y) * KT * n_it, n_it);
}

// Balanced decode (TQ = 1, T <= BAL_MAX_T): a grid of resident CTAs; the visible units (128
// entries: one iteration of each warp) of all tokens are laid end to end and CTA c takes the
// c-th G-th of them (at most a few tokens' spans), so that no wave is left half full and a CTA
// sets up a token's queries once or twice instead of once per 2048 keys. Entries past a token's
// last visible unit are filled with -inf by CTA t mod G.
constexpr int BAL_MIN_T = 64;
constexpr int BAL_MAX_T = 1024;
constexpr int UNIT = KT * WARPS;
template <int KF, int V>
__global__ void __launch_bounds__(THREADS, KF == DSV41_INDEX_KEYS_MXFP4 ? 4 : 3)
    indexer_scores_balanced_kernel(const Dsv41IndexerScoresParams p) {
    __shared__ uint32_t pre[BAL_MAX_T + 1];  // pre[t] = visible units of the tokens before t
    __shared__ uint32_t wsum[WARPS];
    constexpr int PER = BAL_MAX_T / THREADS;
    const int T = p.num_tokens;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    uint32_t u[PER], local = 0;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int t = tid * PER + i;
        u[i] = t < T ? static_cast<uint32_t>((token_extent(p, t).L + UNIT - 1) / UNIT) : 0u;
        local += u[i];
    }
    const uint32_t incl = dsv41_warp::inclusive_sum(local, lane);
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    uint32_t run = incl - local, total = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        run += w < warp ? wsum[w] : 0u;
        total += wsum[w];
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        pre[tid * PER + i] = run;
        run += u[i];
    }
    if (tid == 0) pre[BAL_MAX_T] = total;
    __syncthreads();
    // Entries from the last visible unit's end: -inf.
    const int64_t n = p.num_cols;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        int64_t j0 = static_cast<int64_t>(pre[t + 1] - pre[t]) * UNIT;
        j0 = j0 < n ? j0 : n;
        uint16_t* out = reinterpret_cast<uint16_t*>(p.scores) + t * p.score_row_stride;
        for (int64_t j = j0 + tid; j < n; j += THREADS) out[j] = BF16_NEG_INF;
    }
    // This CTA's units [a, a1) of the concatenation.
    uint32_t a = static_cast<uint32_t>(static_cast<uint64_t>(total) * blockIdx.x / gridDim.x);
    const uint32_t a1 = static_cast<uint32_t>(static_cast<uint64_t>(total) * (blockIdx.x + 1) / gridDim.x);
    int lo = 0, hi = T;  // the token t with pre[t] <= a < pre[t + 1]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (pre[mid] <= a) lo = mid;
        else hi = mid;
    }
    int t = lo;
    bool first = true;
    while (a < a1) {
        while (pre[t + 1] <= a) ++t;
        const uint32_t u0 = a - pre[t];
        const uint32_t u1 = (a1 < pre[t + 1] ? a1 : pre[t + 1]) - pre[t];
        if (!first) __syncthreads();  // the previous span's warps are done with the shared buffers
        first = false;
        score_span<KF, 1, V>(p, t, static_cast<int64_t>(u0) * UNIT, static_cast<int>(u1 - u0) * WARPS);
        a = pre[t] + u1;
    }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Resident CTAs of the balanced kernel (SMs x CTAs per SM), once per process and instance.
template <int KF, int V>
int balanced_grid() {
    static const int g = [] {
        int dev = 0, sms = 0, per = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, indexer_scores_balanced_kernel<KF, V>, THREADS, 0) !=
                cudaSuccess)
            return 0;
        return sms * per;
    }();
    return g;
}

template <int KF, int TQ, int V>
int launch_grid(const Dsv41IndexerScoresParams& p, cudaStream_t stream) {
    // Iterations per warp: up to 16, fewer when the grid would be too small to fill the GPU
    // (decode of few queries): aim at >= 1024 CTAs.
    const int64_t groups = (p.num_tokens + TQ - 1) / TQ;
    const int64_t warp_iters = (p.num_cols + KT - 1) / KT / (WARPS / TQ) + 1;
    const int64_t want_chunks = (1024 + groups - 1) / groups;
    int64_t iters = (warp_iters + want_chunks - 1) / want_chunks;
    iters = iters < 2 ? 2 : (iters > 16 ? 16 : iters);
    const int64_t chunk = KT * iters * (WARPS / TQ);
    const dim3 grid(static_cast<unsigned>(groups), static_cast<unsigned>((p.num_cols + chunk - 1) / chunk));
    if ((p.num_cols + chunk - 1) / chunk > 65535) return DSV41_ERR_SHAPE;
    indexer_scores_kernel<KF, TQ, V><<<grid, THREADS, 0, stream>>>(p, static_cast<int>(iters));
    return static_cast<int>(cudaGetLastError());
}
// The grid kernel compiled for H = 32 without a mask (the model's), else its general form; the
// bf16 path only (V_I8 in the grid decode kernel was 2-10 % slower at B = 1..32: docs/cuda.md
// "indexer_scores: tried and not kept").
template <int KF, int TQ>
int launch(const Dsv41IndexerScoresParams& p, cudaStream_t stream) {
    if (p.num_heads == 32 && !p.allowed) return launch_grid<KF, TQ, V_SPEC>(p, stream);
    return launch_grid<KF, TQ, 0>(p, stream);
}

// The balanced kernel; the (token, chunk) grid when the device query behind its size failed.
template <int KF, int V>
int launch_balanced_v(const Dsv41IndexerScoresParams& p, cudaStream_t stream) {
    const int g = balanced_grid<KF, V>();
    if (g <= 0) {
        (void)cudaGetLastError();  // the failed query's error is not this launch's
        return launch<KF, 1>(p, stream);
    }
    indexer_scores_balanced_kernel<KF, V><<<g, THREADS, 0, stream>>>(p);
    return static_cast<int>(cudaGetLastError());
}
// The balanced kernel (with the integer MMAs) compiled for H = 32 without a mask (the model's
// decode), else its general form.
template <int KF>
int launch_balanced(const Dsv41IndexerScoresParams& p, cudaStream_t stream) {
    if (p.num_heads == 32 && !p.allowed) return launch_balanced_v<KF, V_SPEC | V_I8>(p, stream);
    return launch_balanced_v<KF, V_I8>(p, stream);
}

}  // namespace dsv41_ix

extern "C" int dsv41_indexer_scores(const Dsv41IndexerScoresParams* p, size_t params_size, void* stream) {
    using namespace dsv41_ix;
    if (params_size != sizeof(Dsv41IndexerScoresParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->head_dim != D) return DSV41_ERR_HEAD_DIM;
    if (p->num_tokens < 0 || p->num_cols < 0 || p->num_heads < 1 || p->num_heads > 32 || p->num_key_rows < 0 ||
        p->score_row_stride < p->num_cols || p->score_row_stride % 8 || p->start < 0 ||
        (!p->visible && p->ratio < 1) || (p->allowed && (p->allowed_words < 0 || p->allowed_block < 1)) ||
        (p->page_table && (p->key_base || p->page_table_stride < 0 || p->table_page_size < 1 ||
                           (p->table_page_size & (p->table_page_size - 1)) || p->table_page_size > (1 << 30))))
        return DSV41_ERR_SHAPE;
    if (p->num_tokens == 0 || p->num_cols == 0) return DSV41_OK;
    if (!p->q || !p->w || !p->keys || !p->scores) return DSV41_ERR_NULL;
    if (!aligned16(p->q) || !aligned16(p->keys) || !aligned16(p->scores)) return DSV41_ERR_ALIGNMENT;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    // Prefill over shared keys: 4 tokens per CTA share the key loads; otherwise one token.
    const bool shared = p->key_base == nullptr && p->page_table == nullptr && p->num_tokens >= DSV41_INDEXER_SHARED_KEY_TOKENS;
    if (p->key_format == DSV41_INDEX_KEYS_BF16) {
        if (p->key_row_stride % 8) return DSV41_ERR_ALIGNMENT;
        return shared ? launch<DSV41_INDEX_KEYS_BF16, 4>(*p, s) : launch<DSV41_INDEX_KEYS_BF16, 1>(*p, s);
    }
    if (p->key_format == DSV41_INDEX_KEYS_MXFP4) {
        if (p->num_key_rows > 0xFFFFFFFFll || p->key_row_stride > 0xFFFFFFFFll) return DSV41_ERR_SHAPE;
        if (p->page_size < 4 || p->page_size % 4 || p->key_row_stride % 16 ||
            p->key_row_stride < static_cast<int64_t>(p->page_size) * 68)
            return DSV41_ERR_ALIGNMENT;
        // Prefill and small decode batches: the grid kernel on the bf16 path (its integer path was
        // slower: docs/cuda.md "indexer_scores: tried and not kept").
        if (shared) return launch<DSV41_INDEX_KEYS_MXFP4, 4>(*p, s);
        // Decode batches: the balanced kernel (resident CTAs, equal shares of the visible entries;
        // measured at B = 64 and 256). Small batches keep the (token, chunk) grid.
        if (p->num_tokens >= BAL_MIN_T && p->num_tokens <= BAL_MAX_T)
            return launch_balanced<DSV41_INDEX_KEYS_MXFP4>(*p, s);
        return launch<DSV41_INDEX_KEYS_MXFP4, 1>(*p, s);
    }
    return DSV41_ERR_QUANT;
}
