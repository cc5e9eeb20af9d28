// Integer tensor-core path of the indexer scores over packed MXFP4 keys (kernels/indexer_scores.cu,
// V_I8): exact s8 x s8 -> s32 mma.sync m16n8k32 products of Q3 data (spec §2.3: e2m1 codes x
// UE8M0 2^e per 32-block on both sides). (On sm_90 the e4m3 mma.sync is no tensor-core FP8: ptxas
// lowers it to F2FP e4m3 -> f16 conversions and two f16 HMMA.16816; IMMA.16832 is native.)
//
// Keys: a key j whose four block scale bytes e_b span at most 3 (r_b = e_b - Emin_j in 0..3) is
// exactly k_int * 2^(Emin_j - 128) with k_int = 2 code << r_b, an integer in [-96, 96]: per (key,
// block) two 8-entry byte tables (+k and -k for the 8 magnitudes), a PRMT by the 3 magnitude bits
// from each and a byte select by the code's sign (PRMT sign-replicate): 11 instructions per 8 dims.
// Queries: q[h, :] = q_int[h, :] * 2^Eq_h with Eq_h = floor(log2 max|q[h, :]|) - 6 whenever every
// q / 2^Eq_h is an integer (|q_int| <= 127: true for Q3 queries whose blocks' scales span <= 3).
// Accumulators start at 0x4B400000 (1.5 * 2^23 as f32 bits): the s32 result read as f32 is
// 1.5 * 2^23 + D (|D| <= 128 * 127 * 96 < 2^22), one FADD gives D = q_int . k_int exactly.
// Scores: bf16(relu(bf16(D * 2^(Eq+K))) * w) = 2^K * bf16(relu(bf16(D)) * (w * 2^Eq)) and the f32
// head sum scales the same way, exactly, while no value leaves the normal range; the callers
// check exponent bounds (|K|, |Eq|, |log2 w|, |log2 w + Eq| <= 40) that guarantee it and take
// the bf16 path otherwise.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "dsv41_indexer.h"

namespace dsv41_ix_i8 {

// Exponent bound of the checks above (|K|, |Eq|, ...).
constexpr int EXP_BOUND = 40;
// 1.5 * 2^23: f32 bits 0x4B400000.
constexpr uint32_t MAGIC_BITS = 0x4B400000u;
constexpr float MAGIC = 12582912.0f;

__device__ __forceinline__ void mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// prmt.b32 with the selector's sign-replicate bits honoured (__byte_perm clears them).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// Smallest and largest of the four scale bytes of a row's scale word.
__device__ __forceinline__ void byte_range(uint32_t s4, uint32_t& mn, uint32_t& mx) {
    const uint32_t a = s4 & 0x00FF00FFu, b = (s4 >> 8) & 0x00FF00FFu;
    const uint32_t lo = __vminu2(a, b), hi = __vmaxu2(a, b);
    mn = min(lo & 0xFFFFu, lo >> 16);
    mx = max(hi & 0xFFFFu, hi >> 16);
}

// The s8 tables of one (key, block) with r = e_b - Emin in 0..3: p = 2 code << r for the eight
// magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6 -> 0, 1, 2, 3, 4, 6, 8, 12; bytes <= 96: no carries), n =
// the bytes' two's complements (0x100 - p per nonzero byte: one word subtraction each, since
// 0xFF - p never borrows and + 1 never carries for p >= 1; entry 0 stays 0).
struct Lut {
    uint32_t p0, p1, n0, n1;
    __device__ __forceinline__ void set(uint32_t r) {
        p0 = 0x03020100u << r;
        p1 = 0x0C080604u << r;
        n0 = 0x01010000u - p0;
        n1 = 0x01010100u - p1;
    }
    // The 8 codes of word w (nibble i = dim i, bit 3 = sign) as s8 bytes: b0 = dims 0..3, b1 = 4..7.
    __device__ __forceinline__ void expand(uint32_t w, uint32_t& b0, uint32_t& b1) const {
        const uint32_t x = w & 0x77777777u, xh = x >> 16, w4 = w << 4;
        const uint32_t plo = prmt(p0, p1, x), phi = prmt(p0, p1, xh);
        const uint32_t nlo = prmt(n0, n1, x), nhi = prmt(n0, n1, xh);
        // 0xFF bytes where the code is negative: the sign of nibble 2i is bit 7 of byte i of
        // w << 4, that of nibble 2i + 1 bit 7 of byte i of w (prmt sign-replicate selectors).
        const uint32_t slo = prmt(w4, w, 0xD9C8u), shi = prmt(w4, w, 0xFBEAu);
        b0 = (plo & ~slo) | (nlo & slo);
        b1 = (phi & ~shi) | (nhi & shi);
    }
};

// f32 value of the low / high bf16 half of a bf16x2 word.
__device__ __forceinline__ float lo_f(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_f(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

// Eq of a head from the largest |q| (bf16 bits, 0 for an all-zero head: Eq = 0), and whether it
// lies in the checked bounds.
__device__ __forceinline__ int head_exponent(uint32_t maxbits, bool& ok) {
    if (maxbits == 0u) return 0;
    const int e = static_cast<int>((maxbits >> 7) & 0xFFu);
    ok = ok && e != 0 && e != 255 && e - 133 >= -EXP_BOUND && e - 133 <= EXP_BOUND;
    return e - 133;
}

// x * 2^-eq as a byte when it is an integer in [-127, 127] (else ok = false).
__device__ __forceinline__ uint32_t to_s8(float x, float inv, bool& ok) {
    const float y = x * inv;
    const int i = __float2int_rn(y);
    ok = ok && static_cast<float>(i) == y && i >= -127 && i <= 127;
    return static_cast<uint32_t>(i) & 0xFFu;
}

// 2^e as f32 (|e| <= 126).
__device__ __forceinline__ float exp2i(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }

// Whether w (f32, bf16-valued) is 0 or has a binary exponent in the bounds, also after * 2^eq.
__device__ __forceinline__ bool weight_ok(float w, int eq) {
    const uint32_t b = __float_as_uint(w) & 0x7FFFFFFFu;
    if (b == 0u) return true;
    const int e = static_cast<int>(b >> 23) - 127;
    return (b >> 23) != 0u && (b >> 23) != 255u && e >= -EXP_BOUND && e <= EXP_BOUND && e + eq >= -EXP_BOUND &&
           e + eq <= EXP_BOUND;
}

// The s8 A fragments of token t (one CTA of 4 warps, all holding the same bf16 fragments qa
// [slot hh = head 4g + hh][register 4i + p = dims (8i + p, 8i + p + 4) of the lane's 32-dim
// slice c]): warp w converts and stores k32-step w (qsh8[w][m][lane] = rows g, g + 8 of m-tile m
// = heads 4g + 2m, 4g + 2m + 1, dims 8w..8w+3 and 8w+4..8w+7 of the slice); every lane gets the
// scaled weights w2i[m] of heads (4g + 2m, 4g + 2m + 1). A CTA barrier; returns (CTA-uniform)
// whether every head of the token converted exactly within the bounds.
__device__ __forceinline__ bool int8_queries(const Dsv41IndexerScoresParams& p, int64_t t, int H, const uint32_t (&qa)[4][16],
                                             uint4 (&qsh8)[4][2][32], uint32_t (&w2i)[2]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    bool ok = true;
    int eq[4];
    float inv[4];
#pragma unroll
    for (int hh = 0; hh < 4; ++hh) {
        // The largest |q| of head 4g + hh (bf16 bits; non-negative bits order like the values).
        uint32_t m2 = 0u;
#pragma unroll
        for (int i = 0; i < 16; ++i) m2 = __vmaxu2(m2, qa[hh][i] & 0x7FFF7FFFu);
        uint32_t mb = max(m2 & 0xFFFFu, m2 >> 16);
        mb = max(mb, __shfl_xor_sync(0xFFFFFFFFu, mb, 1));
        mb = max(mb, __shfl_xor_sync(0xFFFFFFFFu, mb, 2));
        eq[hh] = head_exponent(mb, ok);
        inv[hh] = ok ? exp2i(-eq[hh]) : 0.f;
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        uint32_t wb[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int h = 4 * g + 2 * m + e;
            const float w = h < H ? p.w[t * H + h] : 0.f;
            ok = ok && weight_ok(w, eq[2 * m + e]);
            wb[e] = ok ? static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(w * exp2i(eq[2 * m + e])))) : 0u;
        }
        w2i[m] = wb[0] | (wb[1] << 16);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        if (s != warp) continue;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            uint32_t a[4];
#pragma unroll
            for (int f = 0; f < 4; ++f) {
                // f = 0 / 1: dims 8s..8s+3 (low halves) of slots 2m / 2m + 1; f = 2 / 3: 8s+4..8s+7.
                const int hh = 2 * m + (f & 1);
                uint32_t v = 0u;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const uint32_t x = qa[hh][4 * s + i];
                    v |= to_s8(f < 2 ? lo_f(x) : hi_f(x), inv[hh], ok) << (8 * i);
                }
                a[f] = v;
            }
            qsh8[s][m][lane] = make_uint4(a[0], a[1], a[2], a[3]);
        }
    }
    return __syncthreads_and(ok) != 0;
}

}  // namespace dsv41_ix_i8
