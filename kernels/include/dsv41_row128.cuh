// The insert pipeline of dsv41_row.cuh for 128-wide rows with a 64-dim RoPE (the V4.1 index
// keys, spec §6.2), with a quarter warp per row:
//
//   load bf16 row -> [RMSNorm, f32, then bf16] -> GPT-J RoPE of dims [64, 128) -> Q3 fake quant
//   -> store bf16 row, or e2m1 codes + UE8M0 scale bytes (packed format E)
//
// Why: with one warp per 128-wide row (4 elements per lane) every per-row step (the norm's
// reduction, the quant blocks' amax, RoPE staging, the divisor's reciprocal) costs a full warp
// instruction for 4 elements per lane, and those steps dominated the instruction count. Here 8
// lanes own a row (16 elements per lane), so each warp instruction advances 4 rows.
//
// Mapping: lane = 8 g + j; group g (0..3) owns row 4 s + g of row set s, lane j holds the four
// 4-element chunks m = 0..3 at elements 32 m + 4 j + c (c = 0..3): one 8-byte load per chunk,
// coalesced into 64 contiguous bytes per chunk and row. That layout makes
//   * the norm's sum of squares lane-local first: candle's AVX2 order needs, for every L in
//     [0, 32), p[L] = ((v[L] + v[32+L]) + v[64+L]) + v[96+L] (v = squares), and lane j holds
//     exactly L = 4 j + c; the warp_sum_candle_avx_order butterfly over L (xor 8, 16, 4, 1, 2)
//     becomes xor 2, 4, 1 over j (shuffles inside the group, all four columns c at once) then
//     c ^ 1, c ^ 2 inside the lane (compute_row128);
//   * quant block m (32 elements) = chunk m of the group's 8 lanes: amax by xor 1, 2, 4, two
//     blocks per shuffle as bf16 pairs;
//   * the RoPE pairs of dims [64, 128) lane-local: chunks 2 and 3, pairs 16 (m-2) + 2 j + {0, 1},
//     whose cos/sin are one float2 load each.
//
// Scheduling: a persistent grid (as many blocks as are resident at once); each warp walks its
// row sets with a stride and issues the loads of its next set (into registers) while it computes
// the current one, so every warp has a set in flight while it computes. Set and token indices
// are 32-bit and the lane's source pointers are set up once (row128_loop; with kRow128Rows32 also
// the row stride as 32 bits). The loads of a
// warp's first set are issued before the block loads the norm weights and waits at its barrier,
// and those of its next set only once the current set's norm is done (compute_row128 calls
// `prefetch` at its end, ptxas hoists the loads up to just after the weights' multiply; with
// kRow128EarlyRows the row and slot loads right after the quotient, see there): the first sets'
// data, which every warp waits for, then reaches the SMs sooner, and the later sets' loads still
// have the rest of a set's compute to arrive (measured on the H200, format E at G = 32768:
// 7.64 µs with the weights first, 7.32 µs with the first set's loads before them, 7.08 µs with
// the next set's loads after the norm as well, 7.90 µs with both sets' loads before the barrier).
//
// Values as bf16 pairs: after the norm and RoPE (f32, as the CPU) each pair of elements is
// rounded to bf16 by one conversion and the Q3 fake quant / e2m1 codes work on the pairs in the
// x domain (q3_fake_quant_pair / q3_codes4 of dsv41_numerics.cuh). The block maxima are taken of
// the f32 values, packed as bf16 pairs (the max of the rounded values: rounding is monotone) and
// their scale bits read off the 16 bits (q3_scale_bits2). A lane whose row has a block scale
// above 2^119 (never for normed keys of sane weights) takes the f32 element path
// (fake_quant_element / quant_code) for that row.
//
// Code layout: the rare paths (the IEEE division and two-rounding squares of the norm, the f32
// element path) are out-of-line functions, so that the loop spans about the hot path only
// (~550 instead of ~1100 instructions, which the instruction cache holds; measured no slower and
// up to 0.4 points faster).
//
// Numerics: every operation and its order is that of dsv41_row.cuh (rms_norm_row, rope_row /
// rope_loaded_row, fake_quant_row / the packed codes), and the pair path equals the element
// path for every bf16 value and scale (kernels/check/quant_exhaustive.cu), so the results are
// bit-identical to the one-warp-per-row kernels and to the CPU reference.
#pragma once
#include "dsv41_row.cuh"

namespace dsv41 {

constexpr int kRow128Rope = 64;  // the rope_dim of this path (dims [64, 128) rotated)
// Resident blocks per SM the kernels are compiled for (__launch_bounds__): 4 x 256 threads
// caps them at 64 registers (without it they take 80, 3 blocks), more warps to hide latency.
constexpr int kRow128BlocksPerSm = 4;

// The parts of a row set's loads (load_row128, the `prefetch` of row128_loop).
constexpr int kRow128LoadRow = 1, kRow128LoadCosSin = 2, kRow128LoadSlot = 4, kRow128LoadAll = 7;

// One row's inputs in a lane's registers (chunks as loaded).
struct Row128In {
    uint2 raw[4];           // chunk m: bf16 elements 32 m + 4 j .. + 4
    float2 cos[2], sin[2];  // chunk 2 + h: cos/sin of pairs 16 h + 2 j and 16 h + 2 j + 1
    int64_t slot;           // destination, or -1 (padding, out of range, t >= T); as loaded until checked
};

// bf16 pairs (packed by dsv41_numerics.cuh's pack_bf16x2_rn) back to f32.
__device__ __forceinline__ float bf16x2_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16x2_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// The rare paths of compute_row128, out of line: keeping them out of the loop body halves the
// code the loop spans. Values by value in structs, so that the hot path keeps its registers.
struct Row128F16 { float v[16]; };
struct Row128F4 { float v[4]; };
__device__ __forceinline__ Row128F16 row128_f16(const float (&x)[16]) {
    Row128F16 r;
#pragma unroll
    for (int k = 0; k < 16; ++k) r.v[k] = x[k];
    return r;
}
// The partial sums of squares with two roundings per term (candle's order, see below).
static __device__ __noinline__ Row128F4 row128_squares_slow(Row128F16 x) {
    Row128F4 p;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        p.v[c] = __fmul_rn(x.v[c], x.v[c]);
#pragma unroll
        for (int m = 1; m < 4; ++m) p.v[c] = __fadd_rn(p.v[c], __fmul_rn(x.v[4 * m + c], x.v[4 * m + c]));
    }
    return p;
}
// x / r by IEEE division.
static __device__ __noinline__ Row128F16 row128_divide_slow(Row128F16 x, float r) {
#pragma unroll
    for (int k = 0; k < 16; ++k) x.v[k] = __fdiv_rn(x.v[k], r);
    return x;
}

// x[4 m + c] = element 32 m + 4 j + c of the row after [norm] and RoPE, each rounded to bf16 as
// the CPU does, returned as bf16 pairs: h[2 m + i] holds elements 32 m + 4 j + 2 i and + 1 (low
// half first). `w`: the norm weights [128] in shared memory (Norm::Weighted only).
// amax2[0] holds the Q3 block maxima of blocks 0 (low half) and 1, amax2[1] of blocks 2 and 3:
// the group's max of the rounded |values| floored at 6 * 2^-126 (kQ3AmaxFloor2; an all-NaN block
// gives the floor, as the CPU's NaN-ignoring fold from 0 and the floor do).
//   * Norm: the squares are summed by FMA: x^2 of a bf16 x with |x| >= 2^-64 (8 significant bits)
//     is exact in f32 (its lowest bit is >= 2^-142), so fma(x, x, p) = RN(p + RN(x^2)); a warp in
//     which some lane has a smaller |x| (the vote, also the test of the division-free quotient;
//     the lane's min |x| in two chains of 8, or a tree with kRow128TreeMin) replaces them by the
//     two-rounding form (out of line). The FMA form is computed before the vote's result is known,
//     so the vote is off the dependence chain. The partial sums p[c] (L = 4 j + c) are reduced by
//     a butterfly over j with all four columns per level (xor 2, 4, 1: 12 shuffles in 3 dependent
//     levels) and then (S0 + S1) + (S2 + S3) in the lane, each addition one of candle's butterfly
//     (commutativity aside). (A reduce-scatter needs 6 shuffles but 5 dependent levels and the
//     lane selects; the shorter chain measured ~0.1 us faster at G = 32768.) The mean's `+ 0`
//     and the `* 1` of the eps step are identities here (the sum is >= +0 or NaN) and are left
//     out. The quotient is division-free where norm_div_row_ok / norm_div_x_ok hold, else IEEE
//     (out of line).
//   * RoPE: the normed values of chunks 2, 3 are rounded to bf16 by one conversion each into the
//     high half of a word with a +0 low half, which is the rounded value as an f32.
//   * Block maxima: a lane's max of |value| per chunk in f32 (before rounding), two chunks packed
//     into one bf16 pair word (RN), then max.bf16x2 over the group (xor 1 with the floor, 2, 4).
// Schedule options of compute_row128 (bit set O), all with the same results:
//   kRow128TreeMin: the vote's min |x| by a tree (depth 4) instead of two chains of 8;
//   kRow128EarlyRows: the next set's row and slot loads (prefetch) at the end of the division's
//   branches, right after the quotient (ahead of the weights' shared-memory loads), cos / sin at
//   the end; without it all of the next set's loads at the end (ptxas hoists them up to just
//   after the weights' multiply).
// The bf16 index keys take both (measured on the H200: 7.09 -> 6.87 us at G = 32768, 86.0 -> 88.8 %
// of 4.17 TB/s), format E neither (each was slower there: 6.74 -> 6.81 / 6.87 us).
constexpr int kRow128TreeMin = 1;
constexpr int kRow128EarlyRows = 2;
template <Norm N, int O, class Pf>
__device__ __forceinline__ void compute_row128(const Row128In& r, const float* w, float eps, float inv_dim, int j,
                                               uint32_t (&h)[8], uint32_t (&amax2)[2], Pf&& prefetch) {
    constexpr bool kEarly = N != Norm::None && (O & kRow128EarlyRows) != 0;
    using EarlyParts = std::integral_constant<int, kRow128LoadRow | kRow128LoadSlot>;
    float x[16];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        x[4 * m] = bf16x2_lo(r.raw[m].x);
        x[4 * m + 1] = bf16x2_hi(r.raw[m].x);
        x[4 * m + 2] = bf16x2_lo(r.raw[m].y);
        x[4 * m + 3] = bf16x2_hi(r.raw[m].y);
    }
    if constexpr (N != Norm::None) {
        // min |x| in two chains of 8 or a tree (fminf is associative and commutative, NaNs included)
        float mn;
        if constexpr ((O & kRow128TreeMin) != 0) {  // a tree: 8, 4, 2, 1
            float t[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) t[k] = fminf(fabsf(x[k]), fabsf(x[k + 8]));
#pragma unroll
            for (int k = 0; k < 4; ++k) t[k] = fminf(t[k], t[k + 4]);
            mn = fminf(fminf(t[0], t[2]), fminf(t[1], t[3]));
        } else {
            float mn0 = fabsf(x[0]), mn1 = fabsf(x[8]);
#pragma unroll
            for (int k = 1; k < 8; ++k) {
                mn0 = fminf(mn0, fabsf(x[k]));
                mn1 = fminf(mn1, fabsf(x[k + 8]));
            }
            mn = fminf(mn0, mn1);
        }
        const bool fast = __all_sync(kFullMask, norm_div_x_ok(mn));
        float p[4];  // p[c] = partial sum of L = 4 j + c, sequential over the chunks
#pragma unroll
        for (int c = 0; c < 4; ++c) {  // the FMA form first (not waiting for the vote) ...
            p[c] = __fmul_rn(x[c], x[c]);
#pragma unroll
            for (int m = 1; m < 4; ++m) p[c] = __fmaf_rn(x[4 * m + c], x[4 * m + c], p[c]);
        }
        if (!fast) {  // ... replaced by the two-rounding form where the vote fails
            const Row128F4 q = row128_squares_slow(row128_f16(x));
#pragma unroll
            for (int c = 0; c < 4; ++c) p[c] = q.v[c];
        }
        // Butterfly over j with all four columns: xor 2 (L ^ 8), 4 (L ^ 16), 1 (L ^ 4), then c ^ 1
        // (L ^ 1) and c ^ 2 (L ^ 2) in the lane.
        float sc[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) sc[c] = __fadd_rn(p[c], __shfl_xor_sync(kFullMask, p[c], 2));
#pragma unroll
        for (int c = 0; c < 4; ++c) sc[c] = __fadd_rn(sc[c], __shfl_xor_sync(kFullMask, sc[c], 4));
#pragma unroll
        for (int c = 0; c < 4; ++c) sc[c] = __fadd_rn(sc[c], __shfl_xor_sync(kFullMask, sc[c], 1));
        const float sum = __fadd_rn(__fadd_rn(sc[0], sc[1]), __fadd_rn(sc[2], sc[3]));
        const float rr = __fsqrt_rn(__fadd_rn(__fmul_rn(sum, inv_dim), eps));
        if (fast && norm_div_row_ok(rr)) {
            const float y = __frcp_rn(rr);
#pragma unroll
            for (int k = 0; k < 16; ++k) x[k] = div_by_rcp(x[k], rr, y);
            if constexpr (kEarly) prefetch(EarlyParts{});
        } else {
            const Row128F16 q = row128_divide_slow(row128_f16(x), rr);
#pragma unroll
            for (int k = 0; k < 16; ++k) x[k] = q.v[k];
            if constexpr (kEarly) prefetch(EarlyParts{});
        }
        if constexpr (N == Norm::Weighted) {
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const float4 wv = *reinterpret_cast<const float4*>(w + 32 * m + 4 * j);
                x[4 * m] = __fmul_rn(x[4 * m], wv.x);
                x[4 * m + 1] = __fmul_rn(x[4 * m + 1], wv.y);
                x[4 * m + 2] = __fmul_rn(x[4 * m + 2], wv.z);
                x[4 * m + 3] = __fmul_rn(x[4 * m + 3], wv.w);
            }
        }
    }
    float am[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        uint32_t a = r.raw[m].x, b = r.raw[m].y;
        if constexpr (N != Norm::None) {
            a = pack_bf16x2_rn(x[4 * m], x[4 * m + 1]);
            b = pack_bf16x2_rn(x[4 * m + 2], x[4 * m + 3]);
        }
        if (m < 2) {
            h[2 * m] = a;
            h[2 * m + 1] = b;
            am[m] = fmaxf(fmaxf(fabsf(x[4 * m]), fabsf(x[4 * m + 1])), fmaxf(fabsf(x[4 * m + 2]), fabsf(x[4 * m + 3])));
        } else {  // RoPE pairs 16 (m - 2) + 2 j and + 1 of the bf16 values
            float v[4] = {bf16x2_lo(a), bf16x2_hi(a), bf16x2_lo(b), bf16x2_hi(b)};
            if constexpr (N != Norm::None) {
                // Each value rounded to bf16 by one conversion into the high half of a word whose low
                // half is +0: that word is the rounded value as an f32 (no pack and unpack).
#pragma unroll
                for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(pack_bf16x2_rn(0.0f, x[4 * m + i]));
            }
            rotate_pair(v[0], v[1], r.cos[m - 2].x, r.sin[m - 2].x);
            rotate_pair(v[2], v[3], r.cos[m - 2].y, r.sin[m - 2].y);
            am[m] = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
            h[2 * m] = pack_bf16x2_rn(v[0], v[1]);
            h[2 * m + 1] = pack_bf16x2_rn(v[2], v[3]);
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        uint32_t a = pack_bf16x2_rn(am[2 * i], am[2 * i + 1]);
        a = bf16x2_max(bf16x2_max(a, __shfl_xor_sync(kFullMask, a, 1)), kQ3AmaxFloor2);
        a = bf16x2_max(a, __shfl_xor_sync(kFullMask, a, 2));
        amax2[i] = bf16x2_max(a, __shfl_xor_sync(kFullMask, a, 4));
    }
    if constexpr (kEarly) prefetch(std::integral_constant<int, kRow128LoadCosSin>{});
    else prefetch(std::integral_constant<int, kRow128LoadAll>{});
}

// The Q3 scale bits of the row's 4 blocks from compute_row128's amax2 (q3_scale_bits2), and
// whether every block can take the bf16-pair path.
struct Q3Blocks {
    uint32_t sb[2];
    bool pairs_ok;
};
__device__ __forceinline__ Q3Blocks q3_blocks_row128(const uint32_t (&amax2)[2]) {
    Q3Blocks b;
    b.sb[0] = q3_scale_bits2(amax2[0]);
    b.sb[1] = q3_scale_bits2(amax2[1]);
    b.pairs_ok = (((b.sb[0] + 0x04800480u) | (b.sb[1] + 0x04800480u)) & 0x80008000u) == 0;
    return b;
}
// k of block m from amax2 (any scale; the element path).
__device__ __forceinline__ int q3_block_k_row128(const uint32_t (&amax2)[2], int m) {
    return q3_scale_exp(__uint_as_float(m & 1 ? amax2[m >> 1] & 0xffff0000u : amax2[m >> 1] << 16));
}

// The lane's source pointers (its 8-byte column of every row), set up once per kernel so that a
// token's addresses are one wide multiply-add each (32-bit token index: T < 2^31).
template <class RB>
struct Row128Src {
    const char* src;  // p.src + 4 j elements
    const char* cos;  // p.cos + 2 j floats
    const char* sin;
    const char* slots;
    RB row_bytes;  // 2 * src_row_stride (uint64_t, or uint32_t with kRow128Rows32)
};
template <class RB, class P>
__device__ __forceinline__ Row128Src<RB> row128_src(const P& p, int j) {
    return {reinterpret_cast<const char*>(static_cast<const __nv_bfloat16*>(p.src) + 4 * j),
            reinterpret_cast<const char*>(p.cos + 2 * j), reinterpret_cast<const char*>(p.sin + 2 * j),
            reinterpret_cast<const char*>(p.slots), static_cast<RB>(2 * static_cast<uint64_t>(p.src_row_stride))};
}
// Issues the lane's loads of token tc (< T) into r (the Parts of it, kRow128Load*); r.slot is the
// slot as loaded (checked at use).
template <int Parts = kRow128LoadAll, class RB>
__device__ __forceinline__ void load_row128(const Row128Src<RB>& a, uint32_t tc, Row128In& r) {
    const char* src;
    if constexpr (sizeof(RB) == 4) {  // one IMAD.WIDE.U32 (written out: from C++ ptxas adds a zero high part)
        asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(src) : "r"(tc), "r"(a.row_bytes), "l"(a.src));
    } else {
        src = a.src + tc * a.row_bytes;
    }
    if constexpr ((Parts & kRow128LoadRow) != 0) {
#pragma unroll
        for (int m = 0; m < 4; ++m) ld_nc(r.raw[m], src + 64 * m);
    }
    const uint64_t cs = static_cast<uint64_t>(tc) * (kRow128Rope / 2 * 4);
    if constexpr ((Parts & kRow128LoadCosSin) != 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            r.cos[h] = ld_nc_f32x2(reinterpret_cast<const float*>(a.cos + cs + 64 * h));
            r.sin[h] = ld_nc_f32x2(reinterpret_cast<const float*>(a.sin + cs + 64 * h));
        }
    }
    if constexpr ((Parts & kRow128LoadSlot) != 0)
        r.slot = ld_nc_s64(reinterpret_cast<const int64_t*>(a.slots + static_cast<uint64_t>(tc) * 8));
}

// The loop of a row-128 kernel: `finish(row, w, g, j, prefetch)` runs for every row of the
// warp's sets (rows past T included, with row.slot = -1: finish stores only when slot >= 0), with
// `w` the norm weights in shared memory (Norm::Weighted) for compute_row128. All lanes of the warp
// call finish together (it may use warp shuffles / __syncwarp), and finish has each part of
// `prefetch(parts)` (the loads of the warp's next set, if any; parts an integral_constant of
// kRow128Load* bits) issued exactly once, by compute_row128 (see Scheduling above).
//
// Block b handles the rounds of 8 consecutive sets starting at set 8 (b + k * gridDim.x), warp w
// set 8 (...) + w of each; every branch of the loop depends on the block and the parameters
// only (a warp past the last set computes a clamped set with slot -1 instead of leaving), so
// the compiler sees the warps converged at every shuffle and emits plain SHFL instructions
// (with a per-warp exit it wraps each one in a convergence check). Set and token indices are
// 32-bit (T < 2^31), the lane's pointers are set up once, the slot is checked where it is used.
// Loop options (bit set LO): kRow128Rows32: the source row stride in bytes as 32 bits (the
// caller checks 2 * src_row_stride < 2^32), one 32 x 32 -> 64-bit multiply-add per row address
// instead of a 64-bit product (format E takes it: with packed_insert.cu's 32-bit offsets 6.64 ->
// 6.62 us at G = 32768; the bf16 index keys keep the 64-bit product, not measured with it).
constexpr int kRow128Rows32 = 1;
template <Norm N, int LO = 0, class P, class F>
__device__ __forceinline__ void row128_loop(const P& p, F&& finish) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 3, j = lane & 7;
    const int warp = threadIdx.x / 32;
    const uint32_t T = static_cast<uint32_t>(p.num_tokens);
    const uint32_t sets = (T + 3) / 4;
    const uint32_t round_sets = gridDim.x * kInsertWarps;
    uint32_t base = blockIdx.x * kInsertWarps;  // block-uniform, as every branch below
    // The norm weights, once per block, in shared memory (registers are the scarce resource).
    __shared__ __align__(16) float w[N == Norm::Weighted ? 128 : 4];
    if (base >= sets) return;  // block-uniform: the whole block leaves (no barrier reached)
    const auto a = row128_src<std::conditional_t<(LO & kRow128Rows32) != 0, uint32_t, uint64_t>>(p, j);
    const uint32_t row = 4 * warp + g;  // the lane's row of a round: token 4 base + row
    // slot in [0, S) (one unsigned compare) of a token < T, else -1
    auto checked = [&](uint32_t b, Row128In& r) {
        r.slot = 4 * b + row < T && static_cast<uint64_t>(r.slot) < static_cast<uint64_t>(p.num_slots) ? r.slot : -1;
    };
    Row128In cur;
    load_row128(a, min(4 * base + row, T - 1), cur);  // before the weights' barrier
    if constexpr (N == Norm::Weighted) {
        if (threadIdx.x < 128) w[threadIdx.x] = ld_nc_f32(p.norm_weight + threadIdx.x);
        __syncthreads();
    }
    for (;;) {
        const uint32_t next = base + round_sets;
        Row128In nxt;
        checked(base, cur);
        finish(cur, static_cast<const float*>(w), g, j, [&](auto parts) {
            if (next < sets) load_row128<decltype(parts)::value>(a, min(4 * next + row, T - 1), nxt);
        });
        if (next >= sets) break;
        base = next;
        cur = nxt;
    }
}

// Host: blocks of a persistent row-128 grid: enough for `sets` row sets, at most the number of
// blocks of `Kernel` resident on the device at once (queried once per kernel; if the query
// fails, the plain count — the loop is correct for any grid).
template <auto Kernel>
unsigned row128_grid(int64_t sets) {
    static const int64_t resident = [] {
        int dev = 0, sms = 0, per_sm = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kInsertThreads, 0) != cudaSuccess) {
            (void)cudaGetLastError();  // not this launch's error
            return int64_t{0};
        }
        return static_cast<int64_t>(sms) * per_sm;
    }();
    const int64_t needed = (sets + kInsertWarps - 1) / kInsertWarps;
    return static_cast<unsigned>(resident > 0 && resident < needed ? resident : needed);
}

// Whether a call can take the row-128 path: D = 128, R = 64 and 8-byte aligned cos/sin rows
// (the src/cache checks of the callers already require 8-byte aligned rows for D = 128).
template <class P>
inline bool row128_applies(const P& p) {
    return p.head_dim == 128 && p.rope_dim == kRow128Rope && reinterpret_cast<uintptr_t>(p.cos) % 8 == 0 &&
           reinterpret_cast<uintptr_t>(p.sin) % 8 == 0;
}

}  // namespace dsv41
