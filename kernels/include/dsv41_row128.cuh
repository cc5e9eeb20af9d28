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
//     becomes xor 2, 4, 1 over j (shuffles inside the group) then c ^ 1, c ^ 2 in the lane;
//   * quant block m (32 elements) = chunk m of the group's 8 lanes: amax by xor 1, 2, 4;
//   * the RoPE pairs of dims [64, 128) lane-local: chunks 2 and 3, pairs 16 (m-2) + 2 j + {0, 1},
//     whose cos/sin are one float2 load each.
//
// Scheduling: a persistent grid (as many blocks as are resident at once); each warp walks its
// row sets with a stride and issues the loads of its next set before computing the current
// one, so every warp has a set in flight while it computes.
//
// Values as bf16 pairs: after the norm and RoPE (f32, as the CPU) each pair of elements is
// rounded to bf16 by one conversion (instead of two instructions per element) and the Q3 fake
// quant / e2m1 codes work on the pairs in the x domain (q3_fake_quant_pair / q3_code_pair of
// dsv41_numerics.cuh: 7 / 10 instructions per pair instead of ~11 / ~12 per element). The block
// scale comes from the unrounded block max (q3_pair_exp_biased), which gives the scale of the
// rounded max. A lane whose row has a block scale above 2^119 (never for normed keys of sane
// weights) takes the f32 element path (fake_quant_element / quant_code) for that row.
//
// Numerics: every operation and its order is that of dsv41_row.cuh (rms_norm_row, rope_row /
// rope_loaded_row, fake_quant_row / the packed codes), and the pair path equals the element
// path for every bf16 value and scale (kernels/check/quant_exhaustive.cu), so the results are
// bit-identical to the one-warp-per-row kernels and to the CPU reference.
#pragma once
#include <stdlib.h>

#include "dsv41_row.cuh"

namespace dsv41 {

constexpr int kRow128Rope = 64;  // the rope_dim of this path (dims [64, 128) rotated)
// Resident blocks per SM the kernels are compiled for (__launch_bounds__): 4 x 256 threads
// caps them at 64 registers (without it they take 80, 3 blocks), more warps to hide latency.
constexpr int kRow128BlocksPerSm = 4;
constexpr int kRow128DefaultVariant = 8;

// Session-5 measurement switch (docs/perf.md, Run 11), read once per process:
// DSV41_ROW128_VARIANT = 0: the run-10 kernels (compute_row128_pairs in row128_loop);
// 1: compute_row128_v2 in row128_loop; 4: compute_row128_v2 in row128_loop_fast; 6: as 4, and
// format E stores its codes straight from the lanes (2 bytes per chunk, no shared-memory
// staging); 7: as 6 with the cos/sin prefetched into shared memory by cp.async; 8 / 9: as 6 / 7
// with the rare paths (IEEE division, two-rounding squares, f32 element path) out of line.
inline int row128_variant() {
    static const int v = [] {
        const char* e = getenv("DSV41_ROW128_VARIANT");
        const int x = e && e[0] >= '0' && e[0] <= '9' && e[1] == 0 ? e[0] - '0' : -1;
        return x == 0 || x == 1 || x == 4 || x >= 6 ? x : kRow128DefaultVariant;
    }();
    return v;
}

// One row's inputs in a lane's registers (chunks as loaded).
struct Row128In {
    uint2 raw[4];           // chunk m: bf16 elements 32 m + 4 j .. + 4
    float2 cos[2], sin[2];  // chunk 2 + h: cos/sin of pairs 16 h + 2 j and 16 h + 2 j + 1
    int64_t slot;           // destination, or -1 (padding, out of range, t >= T)
};

// Issues the lane's loads of token t (t >= T: clamped to T-1, slot -1).
template <class P>
__device__ __forceinline__ void load_row128(const P& p, int64_t t, int j, Row128In& r) {
    const bool valid = t < p.num_tokens;
    const int64_t tc = valid ? t : p.num_tokens - 1;
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.src) + tc * p.src_row_stride + 4 * j;
#pragma unroll
    for (int m = 0; m < 4; ++m) ld_nc(r.raw[m], src + 32 * m);
    const float* c = p.cos + tc * (kRow128Rope / 2) + 2 * j;
    const float* s = p.sin + tc * (kRow128Rope / 2) + 2 * j;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        r.cos[h] = ld_nc_f32x2(c + 16 * h);
        r.sin[h] = ld_nc_f32x2(s + 16 * h);
    }
    const int64_t slot = ld_nc_s64(p.slots + tc);
    r.slot = valid && slot >= 0 && slot < p.num_slots ? slot : -1;
}

// bf16 pairs (packed by dsv41_numerics.cuh's pack_bf16x2_rn) back to f32.
__device__ __forceinline__ float bf16x2_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16x2_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// x[4 m + c] = element 32 m + 4 j + c of the row after [norm] and RoPE, each rounded to bf16 as
// the CPU does, returned as bf16 pairs: h[2 m + i] holds elements 32 m + 4 j + 2 i and + 1 (low
// half first). `w`: the norm weights [128] in shared memory (Norm::Weighted only). Norm: the
// lane-local sums of squares in candle's order (see above), three in-group shuffle levels, the
// division-free quotient (norm_divide). amax[m]: the lane's max |.| of chunk m
// BEFORE the bf16 rounding (rounding is monotone, so rounding the block's max gives the max of
// the rounded values; q3_block_exps_row128 rounds it). Each f32 -> bf16 rounding is one
// conversion per pair instead of two instructions per element.
template <Norm N>
__device__ __forceinline__ void compute_row128_pairs(const Row128In& r, const float* w, float eps, float inv_dim,
                                                     uint32_t (&h)[8], float (&amax)[4]) {
    float x[16];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        x[4 * m] = bf16x2_lo(r.raw[m].x);
        x[4 * m + 1] = bf16x2_hi(r.raw[m].x);
        x[4 * m + 2] = bf16x2_lo(r.raw[m].y);
        x[4 * m + 3] = bf16x2_hi(r.raw[m].y);
    }
    if constexpr (N != Norm::None) {
        float p[4];  // p[c] = partial sum of L = 4 j + c, sequential over the chunks
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            p[c] = __fmul_rn(x[c], x[c]);
#pragma unroll
            for (int m = 1; m < 4; ++m) p[c] = __fadd_rn(p[c], __fmul_rn(x[4 * m + c], x[4 * m + c]));
        }
        constexpr int kOffsets[3] = {2, 4, 1};  // j ^ 2 = L ^ 8, then L ^ 16, then L ^ 4
#pragma unroll
        for (int i = 0; i < 3; ++i) {
#pragma unroll
            for (int c = 0; c < 4; ++c) p[c] = __fadd_rn(p[c], __shfl_xor_sync(kFullMask, p[c], kOffsets[i]));
        }
        const float sum = __fadd_rn(__fadd_rn(p[0], p[1]), __fadd_rn(p[2], p[3]));  // L ^ 1, then L ^ 2
        const float ms = __fadd_rn(__fmul_rn(sum, inv_dim), 0.0f);
        const float rr = __fsqrt_rn(__fadd_rn(__fmul_rn(ms, 1.0f), eps));
        norm_divide(x, rr);
        if constexpr (N == Norm::Weighted) {
            const int j = threadIdx.x & 7;
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
            float am = 0.0f;
#pragma unroll
            for (int c = 0; c < 4; ++c) am = fmaxf(am, fabsf(x[4 * m + c]));
            amax[m] = am;
        } else {  // RoPE pairs 16 (m - 2) + 2 j and + 1 of the bf16 values
            float v[4] = {bf16x2_lo(a), bf16x2_hi(a), bf16x2_lo(b), bf16x2_hi(b)};
            rotate_pair(v[0], v[1], r.cos[m - 2].x, r.sin[m - 2].x);
            rotate_pair(v[2], v[3], r.cos[m - 2].y, r.sin[m - 2].y);
            float am = 0.0f;
#pragma unroll
            for (int c = 0; c < 4; ++c) am = fmaxf(am, fabsf(v[c]));
            amax[m] = am;
            h[2 * m] = pack_bf16x2_rn(v[0], v[1]);
            h[2 * m + 1] = pack_bf16x2_rn(v[2], v[3]);
        }
    }
}

// The Q3 block scales of the row from the lanes' amax of compute_row128_pairs: amax[m] becomes
// the max over the group's 8 lanes (unrounded) and e[m] = q3_pair_exp_biased(amax[m]) (k + 129
// of the scale 2^k of the rounded max when the pair path applies; q3_block_k gives k always).
__device__ __forceinline__ void q3_block_exps_row128(float (&amax)[4], int (&e)[4]) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) amax[m] = fmaxf(amax[m], __shfl_xor_sync(kFullMask, amax[m], off));
        e[m] = q3_pair_exp_biased(amax[m]);
    }
}
__device__ __forceinline__ int q3_block_k(float amax) { return q3_scale_exp(round_bf16(amax)); }

// Whether every block of the lane's row can take the bf16-pair Q3 path.
__device__ __forceinline__ bool q3_pairs_ok(const int (&e)[4]) {
    return q3_pair_biased_ok(e[0]) && q3_pair_biased_ok(e[1]) && q3_pair_biased_ok(e[2]) && q3_pair_biased_ok(e[3]);
}

// The loop of a row-128 kernel: `finish(row, w, g, j)` runs for every row of the warp's sets
// (rows past T included, with row.slot = -1: finish stores only when slot >= 0), with `w` the
// norm weights in shared memory (Norm::Weighted) for compute_row128_pairs. All lanes of the
// warp call finish together (it may use warp shuffles / __syncwarp).
//
// Block b handles the rounds of 8 consecutive sets starting at set 8 (b + k * gridDim.x), warp w
// set 8 (...) + w of each; every branch of the loop depends on the block and the parameters
// only (a warp past the last set computes a clamped set with slot -1 instead of leaving), so
// the compiler sees the warps converged at every shuffle and emits plain SHFL instructions
// (with a per-warp exit it wraps each one in a convergence check).
template <Norm N, class P, class F>
__device__ __forceinline__ void row128_loop(const P& p, F&& finish) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 3, j = lane & 7;
    const int warp = threadIdx.x / 32;
    const int64_t sets = (static_cast<int64_t>(p.num_tokens) + 3) / 4;
    const int64_t round_sets = static_cast<int64_t>(gridDim.x) * kInsertWarps;
    int64_t base = static_cast<int64_t>(blockIdx.x) * kInsertWarps;
    // The norm weights, once per block, in shared memory (registers are the scarce resource).
    __shared__ __align__(16) float w[N == Norm::Weighted ? 128 : 4];
    if constexpr (N == Norm::Weighted) {
        if (threadIdx.x < 128) w[threadIdx.x] = ld_nc_f32(p.norm_weight + threadIdx.x);
        __syncthreads();
    }
    if (base >= sets) return;
    Row128In cur;
    load_row128(p, 4 * (base + warp) + g, j, cur);
    for (;;) {
        const int64_t next = base + round_sets;
        Row128In nxt;
        if (next < sets) load_row128(p, 4 * (next + warp) + g, j, nxt);
        finish(cur, static_cast<const float*>(w), g, j);
        if (next >= sets) break;
        cur = nxt;
        base = next;
    }
}

// The rare paths of compute_row128_v2 out of line (kOol): keeping them out of the loop body
// halves the code the loop spans (the instruction cache holds the hot path only). Values by
// value in structs, so that the hot path keeps its registers.
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

// ------------------------------------------------------------------ the session-5 path (variants >= 1)
//
// compute_row128_v2 computes what compute_row128_pairs does, with fewer instructions:
//   * squares by FMA: for |x| >= 2^-64 (bf16, 8 significant bits) x^2 is exact in f32 (its lowest
//     bit is >= 2^-142), so fma(x, x, p) = RN(p + RN(x^2)); a warp whose lanes all pass that
//     test (the test of the division-free quotient, taken before the squares) takes it, the
//     others the two-rounding form;
//   * the sum of squares as a reduce-scatter: the pair of lanes j, j ^ 2 exchange two of the
//     four column sums each way (each lane keeps two), j ^ 4 one, then j ^ 1 completes the
//     column sum of c = 2 b1 + b2 (b1, b2: bits 1, 2 of j), and j ^ 4, j ^ 2 form
//     (S0 + S1) + (S2 + S3): 6 shuffles instead of 12, the additions in candle's order (each
//     addition is one of the butterfly's, commutativity aside);
//   * the mean's `+ 0` and the `* 1` of the eps step dropped: the sum is >= +0 or NaN, where
//     both are identities;
//   * the block maxima of the f32 values packed as bf16 pairs (rounding is monotone, so that is
//     the max of the rounded values), two blocks per word: 6 shuffles and max.bf16x2 for the four
//     blocks instead of 12 and f32 max; their scale bits by q3_scale_bits2 (dsv41_numerics.cuh).
// amax2[0] holds blocks 0 (low half) and 1, amax2[1] blocks 2 and 3: the group's max of the
// rounded |values| floored at 6 * 2^-126 (kQ3AmaxFloor2; an all-NaN block gives the floor).
template <Norm N, bool kOol = false>
__device__ __forceinline__ void compute_row128_v2(const Row128In& r, const float* w, float eps, float inv_dim, int j,
                                                  uint32_t (&h)[8], uint32_t (&amax2)[2]) {
    float x[16];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        x[4 * m] = bf16x2_lo(r.raw[m].x);
        x[4 * m + 1] = bf16x2_hi(r.raw[m].x);
        x[4 * m + 2] = bf16x2_lo(r.raw[m].y);
        x[4 * m + 3] = bf16x2_hi(r.raw[m].y);
    }
    if constexpr (N != Norm::None) {
        float mn = fabsf(x[0]);
#pragma unroll
        for (int k = 1; k < 16; ++k) mn = fminf(mn, fabsf(x[k]));
        const bool fast = __all_sync(kFullMask, norm_div_x_ok(mn));
        float p[4];  // p[c] = partial sum of L = 4 j + c, sequential over the chunks
        if (fast) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                p[c] = __fmul_rn(x[c], x[c]);
#pragma unroll
                for (int m = 1; m < 4; ++m) p[c] = __fmaf_rn(x[4 * m + c], x[4 * m + c], p[c]);
            }
        } else if constexpr (kOol) {
            const Row128F4 q = row128_squares_slow(row128_f16(x));
#pragma unroll
            for (int c = 0; c < 4; ++c) p[c] = q.v[c];
        } else {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                p[c] = __fmul_rn(x[c], x[c]);
#pragma unroll
                for (int m = 1; m < 4; ++m) p[c] = __fadd_rn(p[c], __fmul_rn(x[4 * m + c], x[4 * m + c]));
            }
        }
        const bool b1 = (threadIdx.x & 2u) != 0, b2 = (threadIdx.x & 4u) != 0;  // bits 1, 2 of j
        // j ^ 2 (L ^ 8): keep c = 2 b1 + {0, 1}, send the other two.
        const float q0 = __fadd_rn(b1 ? p[2] : p[0], __shfl_xor_sync(kFullMask, b1 ? p[0] : p[2], 2));
        const float q1 = __fadd_rn(b1 ? p[3] : p[1], __shfl_xor_sync(kFullMask, b1 ? p[1] : p[3], 2));
        // j ^ 4 (L ^ 16): keep c = 2 b1 + b2.
        float t = __fadd_rn(b2 ? q1 : q0, __shfl_xor_sync(kFullMask, b2 ? q0 : q1, 4));
        t = __fadd_rn(t, __shfl_xor_sync(kFullMask, t, 1));  // j ^ 1 (L ^ 4): the column sum S_c
        t = __fadd_rn(t, __shfl_xor_sync(kFullMask, t, 4));  // c ^ 1 (L ^ 1): S0 + S1 or S2 + S3
        const float sum = __fadd_rn(t, __shfl_xor_sync(kFullMask, t, 2));  // c ^ 2 (L ^ 2)
        const float rr = __fsqrt_rn(__fadd_rn(__fmul_rn(sum, inv_dim), eps));
        if (fast && norm_div_row_ok(rr)) {
            const float y = __frcp_rn(rr);
#pragma unroll
            for (int k = 0; k < 16; ++k) x[k] = div_by_rcp(x[k], rr, y);
        } else if constexpr (kOol) {
            const Row128F16 q = row128_divide_slow(row128_f16(x), rr);
#pragma unroll
            for (int k = 0; k < 16; ++k) x[k] = q.v[k];
        } else {
#pragma unroll
            for (int k = 0; k < 16; ++k) x[k] = __fdiv_rn(x[k], rr);
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
}

// The Q3 scale bits of the row's 4 blocks from compute_row128_v2's amax2 (q3_scale_bits2), and
// whether every block can take the bf16-pair path.
struct Q3Blocks {
    uint32_t sb[2];
    bool pairs_ok;
};
__device__ __forceinline__ Q3Blocks q3_blocks_v2(const uint32_t (&amax2)[2]) {
    Q3Blocks b;
    b.sb[0] = q3_scale_bits2(amax2[0]);
    b.sb[1] = q3_scale_bits2(amax2[1]);
    b.pairs_ok = (((b.sb[0] + 0x04800480u) | (b.sb[1] + 0x04800480u)) & 0x80008000u) == 0;
    return b;
}
// k of block m from amax2 (any scale; the element path).
__device__ __forceinline__ int q3_block_k_v2(const uint32_t (&amax2)[2], int m) {
    return q3_scale_exp(__uint_as_float(m & 1 ? amax2[m >> 1] & 0xffff0000u : amax2[m >> 1] << 16));
}

// The lane's source pointers (its 8-byte column of every row), set up once per kernel so that a
// token's addresses are one wide multiply-add each (32-bit token index: T < 2^31).
struct Row128Src {
    const char* src;  // p.src + 4 j elements
    const char* cos;  // p.cos + 2 j floats
    const char* sin;
    const char* slots;
    uint64_t row_bytes;  // 2 * src_row_stride
};
template <class P>
__device__ __forceinline__ Row128Src row128_src(const P& p, int j) {
    return {reinterpret_cast<const char*>(static_cast<const __nv_bfloat16*>(p.src) + 4 * j),
            reinterpret_cast<const char*>(p.cos + 2 * j), reinterpret_cast<const char*>(p.sin + 2 * j),
            reinterpret_cast<const char*>(p.slots), 2 * static_cast<uint64_t>(p.src_row_stride)};
}
// Issues the lane's loads of token tc (< T) into r; r.slot is the slot as loaded (checked at use).
// kCsAsync: the cos/sin go to shared memory by cp.async (dst: the lane's float2 of the stage,
// 4 x 32 float2 per warp: cos h = 0, 1, sin h = 0, 1) instead of registers.
template <bool kCsAsync>
__device__ __forceinline__ void load_row128_fast(const Row128Src& a, uint32_t tc, Row128In& r, uint32_t cs_dst) {
    const char* src = a.src + tc * a.row_bytes;
#pragma unroll
    for (int m = 0; m < 4; ++m) ld_nc(r.raw[m], src + 64 * m);
    const uint64_t cs = static_cast<uint64_t>(tc) * (kRow128Rope / 2 * 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if constexpr (kCsAsync) {
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(cs_dst + 256 * h), "l"(a.cos + cs + 64 * h) : "memory");
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(cs_dst + 512 + 256 * h), "l"(a.sin + cs + 64 * h) : "memory");
        } else {
            r.cos[h] = ld_nc_f32x2(reinterpret_cast<const float*>(a.cos + cs + 64 * h));
            r.sin[h] = ld_nc_f32x2(reinterpret_cast<const float*>(a.sin + cs + 64 * h));
        }
    }
    if constexpr (kCsAsync) asm volatile("cp.async.commit_group;\n" ::: "memory");
    r.slot = ld_nc_s64(reinterpret_cast<const int64_t*>(a.slots + static_cast<uint64_t>(tc) * 8));
}

// row128_loop with 32-bit set / token indices, the lane's pointers set up once (Row128Src) and
// the slot checked where it is used; kCsAsync prefetches the cos/sin into shared memory
// (double-buffered, 2 KB per warp) instead of registers. Same contract as row128_loop.
template <Norm N, bool kCsAsync, class P, class F>
__device__ __forceinline__ void row128_loop_fast(const P& p, F&& finish) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 3, j = lane & 7;
    const int warp = threadIdx.x / 32;
    const uint32_t T = static_cast<uint32_t>(p.num_tokens);
    const uint32_t sets = (T + 3) / 4;
    const uint32_t round_sets = gridDim.x * kInsertWarps;
    uint32_t base = blockIdx.x * kInsertWarps;  // block-uniform, as every branch below
    __shared__ __align__(16) float w[N == Norm::Weighted ? 128 : 4];
    __shared__ __align__(16) float2 cs_stage[kCsAsync ? kInsertWarps : 1][2][4][32];
    if constexpr (N == Norm::Weighted) {
        if (threadIdx.x < 128) w[threadIdx.x] = ld_nc_f32(p.norm_weight + threadIdx.x);
        __syncthreads();
    }
    if (base >= sets) return;
    const Row128Src a = row128_src(p, j);
    const uint32_t row = 4 * warp + g;  // the lane's row of a round: token 4 base + row
    const uint32_t cs0 = kCsAsync ? static_cast<uint32_t>(__cvta_generic_to_shared(&cs_stage[kCsAsync ? warp : 0][0][0][lane])) : 0;
    constexpr uint32_t kCsBuf = 4 * 32 * sizeof(float2);
    uint32_t buf = 0;
    // slot in [0, S) (one unsigned compare) of a token < T, else -1
    auto checked = [&](uint32_t b, Row128In& r) {
        r.slot = 4 * b + row < T && static_cast<uint64_t>(r.slot) < static_cast<uint64_t>(p.num_slots) ? r.slot : -1;
    };
    auto cs_read = [&](Row128In& r) {
        if constexpr (kCsAsync) {
            const float2* c = reinterpret_cast<const float2*>(reinterpret_cast<const char*>(&cs_stage[kCsAsync ? warp : 0][0][0][lane]) + buf);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                r.cos[h] = c[32 * h];
                r.sin[h] = c[32 * (2 + h)];
            }
        }
    };
    Row128In cur;
    load_row128_fast<kCsAsync>(a, min(4 * base + row, T - 1), cur, cs0);
    for (;;) {
        uint32_t next = base + round_sets;
        Row128In nxt;
        if (next < sets) load_row128_fast<kCsAsync>(a, min(4 * next + row, T - 1), nxt, cs0 + (buf ^ kCsBuf));
        if constexpr (kCsAsync) {
            if (next < sets) asm volatile("cp.async.wait_group 1;\n" ::: "memory");
            else asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        }
        cs_read(cur);
        checked(base, cur);
        finish(cur, static_cast<const float*>(w), g, j);
        if (next >= sets) break;
        base = next;
        cur = nxt;
        buf ^= kCsBuf;
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
