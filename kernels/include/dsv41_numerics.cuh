// Bit-exact device versions of the crate's CPU numerics (crates/deepseek-v41/src/quant/ and
// src/nn/): e4m3 / e2m1 rounding, the three QAT block scales of spec §2.3, the GPT-J rotation,
// and the f32 reduction order of candle's CPU `sum` over a last dim.
//
// Every floating-point operation whose rounding matters is written with an explicit `_rn`
// intrinsic (__fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn): those are never contracted
// into FMAs and never replaced by approximations, whatever -fmad / --use_fast_math say. That is
// what makes the GPU results equal the CPU ones bit for bit (Rust never contracts a*b+c).
//
// The per-element fake-quant path (`fake_quant_element`, `quant_code`) is
// the hot loop of the insert kernels, so it avoids divisions: with a power-of-two scale s
// (Q1, Q3) x / s == x * (1/s) exactly (both are the correct rounding of the same real number,
// 1/s being exact); with the e4m3 scale of Q2 the quotient is the reciprocal product corrected by
// one FMA residual step (Markstein), which is the correctly rounded x / s; e4m3 / e2m1 rounding
// is done on the bits (round-to-nearest-even on the kept mantissa bits) and, below the formats'
// smallest normal, with one magic-number addition. These functions are `__host__ __device__`
// (host builds use plain IEEE f32 operations) so that they can be compared exhaustively on the
// host with the division-based definitions kept below (`round_e4m3`, `round_e2m1`,
// `e4m3_code`, `e2m1_code`): every bf16 x against every scale each format can produce
// (kernels/check/quant_exhaustive.cu).
//
// Faster forms for bf16 inputs, each checked the same way against the element path: Q3 fake
// quant and e2m1 codes on bf16 pairs for power-of-two scales (one bf16 FMA rounds two values,
// the 128-wide kernels), Q2 e2m1 codes on bf16 pairs by comparisons with the block's scaled
// tie points (no quotient, the format B kernel) and the Q2 block scale by the hardware e4m3
// conversions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define DSV41_HD __host__ __device__ __forceinline__

namespace dsv41 {

// ----------------------------------------------------------- host/device arithmetic primitives

DSV41_HD uint32_t f2u(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
#endif
}
DSV41_HD float u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, 4);
    return x;
#endif
}
#ifdef __CUDA_ARCH__
DSV41_HD float mul_rn(float a, float b) { return __fmul_rn(a, b); }
DSV41_HD float add_rn(float a, float b) { return __fadd_rn(a, b); }
DSV41_HD float sub_rn(float a, float b) { return __fsub_rn(a, b); }
DSV41_HD float div_rn(float a, float b) { return __fdiv_rn(a, b); }
DSV41_HD float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
DSV41_HD float rcp_rn(float a) { return __frcp_rn(a); }
DSV41_HD int clz32(uint32_t v) { return __clz(v); }
#else
// Host builds (the exhaustive check) must be compiled without FMA contraction.
inline float mul_rn(float a, float b) { return a * b; }
inline float add_rn(float a, float b) { return a + b; }
inline float sub_rn(float a, float b) { return a - b; }
inline float div_rn(float a, float b) { return a / b; }
inline float fma_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float rcp_rn(float a) { return 1.0f / a; }
inline int clz32(uint32_t v) { return v == 0 ? 32 : __builtin_clz(v); }
#endif

constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;

// 2^e as an f32 for e in [-149, 127] (subnormals included), like quant::formats::pow2.
DSV41_HD float pow2(int e) {
    if (e > 127) return u2f(0x7f800000u);
    if (e >= -126) return u2f(static_cast<uint32_t>(e + 127) << 23);
    if (e >= -149) return u2f(1u << (e + 149));
    return 0.0f;
}

// ceil(log2(v)) of a positive f32, exactly from its bits (quant::formats::ceil_log2); +inf
// gives 128.
DSV41_HD int ceil_log2(float v) {
    const uint32_t bits = f2u(v);
    const int exp = static_cast<int>((bits >> 23) & 0xff);
    const uint32_t man = bits & 0x7fffff;
    if (exp == 0) {  // subnormal: v = man * 2^-149
        const int bitlen = 32 - clz32(man);
        const int fl = bitlen - 1 - 149;
        return (man & (man - 1)) == 0 ? fl : fl + 1;
    }
    return exp - 127 + (man != 0 ? 1 : 0);
}

// ------------------------------------------------- definitions (division-based, as on the CPU)

// Nearest e4m3fn value, ties to even, saturating at +-448; NaN stays NaN, the sign of zero is
// kept (quant::formats::round_to_e4m3). Used for the Q2 block scale (once per block).
DSV41_HD float round_e4m3(float x) {
    if (isnan(x)) return x;
    const float a = fabsf(x);
    if (a >= kE4m3Max) return copysignf(kE4m3Max, x);
    if (a == 0.0f) return x;
    // Normal e4m3 exponents go down to -6; below that the quantum stays 2^-9 (subnormals).
    const int eb = static_cast<int>((f2u(a) >> 23) & 0xff) - 127;
    const int e = eb > -6 ? eb : -6;
    const float quantum = pow2(e - 3);
    const float q = mul_rn(rintf(div_rn(a, quantum)), quantum);  // rintf: ties to even
    return copysignf(fminf(q, kE4m3Max), x);
}

// Nearest e2m1 value with ties to the even code (quant::formats::round_to_e2m1): ties at 0.25,
// 1.25, 2.5 and 5 go down, 0.75, 1.75 and 3.5 go up; saturates at +-6; NaN gives +-6; the sign
// is always kept (negative values rounding to zero give -0.0).
DSV41_HD float round_e2m1(float x) {
    const float a = fabsf(x);
    float m;
    if (a <= 0.25f) m = 0.0f;
    else if (a < 0.75f) m = 0.5f;
    else if (a <= 1.25f) m = 1.0f;
    else if (a < 1.75f) m = 1.5f;
    else if (a <= 2.5f) m = 2.0f;
    else if (a < 3.5f) m = 3.0f;
    else if (a <= 5.0f) m = 4.0f;
    else m = 6.0f;  // also NaN: every comparison above is false
    return (f2u(x) >> 31) ? -m : m;
}

// e2m1 code (bit 3 = sign) of round_e2m1(x), as quant::formats::f32_to_e2m1.
DSV41_HD uint8_t e2m1_code(float x) {
    const float a = fabsf(x);
    uint8_t m;
    if (a <= 0.25f) m = 0;
    else if (a < 0.75f) m = 1;
    else if (a <= 1.25f) m = 2;
    else if (a < 1.75f) m = 3;
    else if (a <= 2.5f) m = 4;
    else if (a < 3.5f) m = 5;
    else if (a <= 5.0f) m = 6;
    else m = 7;
    return static_cast<uint8_t>(((f2u(x) >> 31) << 3) | m);
}

// e4m3fn byte of round_e4m3(x) (quant::formats::f32_to_e4m3); NaN gives 0x7f | sign.
DSV41_HD uint8_t e4m3_code(float x) {
    const uint8_t sign = (f2u(x) >> 31) ? 0x80 : 0x00;
    if (isnan(x)) return sign | 0x7f;
    const float a = fabsf(round_e4m3(x));
    if (a == 0.0f) return sign;
    const uint32_t bits = f2u(a);
    const int e = static_cast<int>(bits >> 23) - 127;
    if (e < -6) return sign | static_cast<uint8_t>(mul_rn(a, 512.0f));  // subnormal m * 2^-9
    return sign | static_cast<uint8_t>((e + 7) << 3) | static_cast<uint8_t>((bits >> 20) & 0x7);
}

// ------------------------------------------------------------- fast element path (hot loop)

// round_e4m3(clamp(y, +-448)) with NaN kept, without divisions: RNE on the bits for
// |y| >= 2^-6 (3 kept mantissa bits; a carry rolls into the exponent), and for the e4m3
// subnormal range (quantum 2^-9) the magic addition 2^14 + a, whose ulp is 2^-9.
DSV41_HD float round_e4m3_sat(float y) {
    const uint32_t sign = f2u(y) & 0x80000000u;
    const float a = fminf(fabsf(y), kE4m3Max);  // NaN -> 448, replaced below
    const uint32_t ua = f2u(a);
    const uint32_t big = (ua + 0x7ffffu + ((ua >> 20) & 1u)) & 0xfff00000u;
    const float small = sub_rn(add_rn(a, 16384.0f), 16384.0f);
    const float r = u2f((ua >= 0x3c800000u ? big : f2u(small)) | sign);
    return isnan(y) ? y : r;
}

// round_e2m1(clamp(y, +-6)) (NaN -> +-6 by its sign bit) without comparisons chains: RNE on
// the bits for |y| >= 1 (1 kept mantissa bit), the magic addition 2^22 + a (ulp 0.5) below.
DSV41_HD float round_e2m1_sat(float y) {
    const uint32_t sign = f2u(y) & 0x80000000u;
    const float a = fminf(fabsf(y), kE2m1Max);  // NaN -> 6
    const uint32_t ua = f2u(a);
    const uint32_t big = (ua + 0x1fffffu + ((ua >> 22) & 1u)) & 0xffc00000u;
    const float small = sub_rn(add_rn(a, 4194304.0f), 4194304.0f);
    return u2f((ua >= 0x3f800000u ? big : f2u(small)) | sign);
}

// e4m3fn byte of round_e4m3_sat(y) (= e4m3_code(clamp(y, +-448)), NaN -> 0x7f | sign),
// straight from y's bits: the RNE carry then the top bits give ((e + 7) << 3) | m3 for
// |y| >= 2^-6; below, 2^14 + |y| (ulp 2^-9) holds the subnormal code in its low bits.
DSV41_HD uint8_t e4m3_code_sat(float y) {
    const uint32_t uy = f2u(y);
    const uint32_t sign = (uy >> 24) & 0x80u;
    const float a = fminf(fabsf(y), kE4m3Max);
    const uint32_t ua = f2u(a);
    const uint32_t normal = ((ua + 0x7ffffu + ((ua >> 20) & 1u)) >> 20) - 960u;  // 960 = 120 << 3
    const uint32_t sub = f2u(add_rn(a, 16384.0f)) - 0x46800000u;                 // bits of 2^14
    const uint32_t mag = ua >= 0x3c800000u ? normal : sub;
    return static_cast<uint8_t>(sign | (isnan(y) ? 0x7fu : mag));
}

// e2m1 code of round_e2m1_sat(y) (= e2m1_code(clamp(y, +-6)); NaN -> 7 | sign), from the bits:
// 1.0 -> 2, 1.5 -> 3, 2 -> 4, 3 -> 5, 4 -> 6, 6 -> 7 by the RNE carry; below 1, 2^22 + |y|
// (ulp 0.5) holds 0, 1 or 2 in its low bits. The sign bit is taken from `sign_of`.
DSV41_HD uint8_t e2m1_code_sat_signed(float y, float sign_of) {
    const float a = fminf(fabsf(y), kE2m1Max);  // NaN -> 6
    const uint32_t ua = f2u(a);
    const uint32_t normal = ((ua + 0x1fffffu + ((ua >> 22) & 1u)) >> 22) - 252u;  // 1.0 = 254 << 22
    const uint32_t sub = f2u(add_rn(a, 4194304.0f)) - 0x4a800000u;               // bits of 2^22
    return static_cast<uint8_t>(((f2u(sign_of) >> 28) & 0x8u) | (ua >= 0x3f800000u ? normal : sub));
}
DSV41_HD uint8_t e2m1_code_sat(float y) { return e2m1_code_sat_signed(y, y); }

// The QAT formats of spec §2.3 (values equal enum Dsv41Quant).
enum class Quant : int { None = 0, Fp8Ue8m0B32 = 1, Fp4E4m3B16 = 2, Fp4Ue8m0B32 = 3 };

// A block's scale s and the reciprocal the element path multiplies by (exact 1/s for the
// power-of-two scales, RN(1/s) for Q2).
struct BlockScale {
    float s;
    float inv;
};

// 2^k and its exact reciprocal for the k the UE8M0 scales produce, k in [-126, 128] (2^128 is
// +inf, whose reciprocal is 0), without branches: both are normal floats except 2^-127.
DSV41_HD BlockScale pow2_scale(int k) {
    const float s = u2f(static_cast<uint32_t>(k + 127) << 23);
    const float inv = k < 127 ? u2f(static_cast<uint32_t>(127 - k) << 23) : (k == 127 ? u2f(0x00400000u) : 0.0f);
    return {s, inv};
}

// ceil(log2(v)) for a NORMAL positive v or +inf (128), from the bits (ceil_log2 without the
// subnormal branch).
DSV41_HD int ceil_log2_normal(float v) {
    const uint32_t bits = f2u(v);
    return static_cast<int>(bits >> 23) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
}

// ------------------------------------------------- division-free block scales and norm quotient
//
// The block scales divide the block's amax by the format's maximum; these forms give the same
// results without a division (checked against the `scale_def` definitions for every
// non-negative f32 amax, NaN patterns included, by kernels/check/quant_exhaustive.cu).

// Q1: k = ceil(log2(RN(a / 448))) for a = max(amax, 1e-4) = M * 2^E (M in [1, 2)). With
// 448 = 1.75 * 2^8: a / 448 <= 2^k  <=>  a <= 1.75 * 2^(k+8), so k = E - 8 + (M > 1.75); the
// rounding never lands on 2^k from above (the nearest f32 above 1.75 * 2^e is more than half an
// ulp of the quotient away). +inf gives 128 (the 2^128 = inf scale of the definition).
DSV41_HD int q1_scale_exp(float amax) {
    const uint32_t b = f2u(fmaxf(amax, 1e-4f));  // NaN -> 1e-4 like the definition's fmaxf
    const int k = static_cast<int>(b >> 23) - 135 + ((b & 0x7fffffu) > 0x600000u ? 1 : 0);
    return b >= 0x7f800000u ? 128 : k;
}

// Q3: the same with 6 = 1.5 * 2^2 and a = max(amax, 6 * 2^-126): k = E - 2 + (M > 1.5).
DSV41_HD int q3_scale_exp(float amax) {
    const uint32_t b = f2u(fmaxf(amax, 6.0f * 1.17549435e-38f));
    const int k = static_cast<int>(b >> 23) - 129 + ((b & 0x7fffffu) > 0x400000u ? 1 : 0);
    return b >= 0x7f800000u ? 128 : k;
}

// Q2: min(e4m3(RN(max(amax, 6 * 2^-9) / 6)), 448). The quotient is the product by RN(1/6)
// corrected by one FMA residual step (correctly rounded for these normal operands), then
// rounded to e4m3 on the bits (round_e4m3_sat saturates at 448).
DSV41_HD float q2_scale_quotient(float amax) {
    constexpr float kInv6 = 1.0f / 6.0f;  // RN(1/6)
    const float a = fmaxf(amax, 0.01171875f);
    const float q0 = mul_rn(a, kInv6);
    const float q = fma_rn(fma_rn(-q0, 6.0f, a), kInv6, q0);
    return a != u2f(0x7f800000u) ? q : a;  // +inf stays +inf (-> 448)
}
DSV41_HD float q2_scale_value(float amax) { return round_e4m3_sat(q2_scale_quotient(amax)); }

// The RMSNorm quotient x / r without a division per element: y = RN(1/r) once per row, then
// q = RN(x * y) and one FMA residual step, which is the correctly rounded x / r whenever every
// intermediate is a normal float. That holds when r is in [2^-60, 2^60) (`norm_div_row_ok`,
// one test per row) and |x| >= 2^-64 (`norm_div_x_ok` on the smallest |x| of a lane): then
// |x / r| >= 2^-124, the residual x - q*r is exact (|x| >= 2^-102 suffices) and |x| < 2^64
// (x^2 finite, else r = inf fails the row test) bounds |x / r| below 2^124. Scaling x and r by
// powers of two scales every step exactly under those conditions, so the exhaustive check of
// every bf16 x in [1, 2) against every f32 r in [1, 2) (plus scaled spot checks at the range
// ends, kernels/check/quant_exhaustive.cu) covers all cases; anything else takes __fdiv_rn.
DSV41_HD float div_by_rcp(float x, float r, float y) {
    const float q = mul_rn(x, y);
    return fma_rn(fma_rn(-q, r, x), y, q);
}
DSV41_HD bool norm_div_row_ok(float r) { return f2u(r) - 0x21800000u < 0x5d800000u - 0x21800000u; }
DSV41_HD bool norm_div_x_ok(float min_abs_x) { return f2u(min_abs_x) >= 0x1f800000u && min_abs_x == min_abs_x; }

template <Quant Q> struct QuantTraits;
template <> struct QuantTraits<Quant::Fp8Ue8m0B32> {
    static constexpr int kBlock = 32;
    static constexpr float kElemMax = kE4m3Max;
    // s = 2^ceil(log2(max(amax, 1e-4) / 448)), k in [-22, 128]
    DSV41_HD static BlockScale scale_def(float amax) {
        return pow2_scale(ceil_log2_normal(div_rn(fmaxf(amax, 1e-4f), kE4m3Max)));  // >= 2.2e-7
    }
    DSV41_HD static BlockScale scale(float amax) { return pow2_scale(q1_scale_exp(amax)); }
    DSV41_HD static float quotient(float x, BlockScale b) { return mul_rn(x, b.inv); }
    DSV41_HD static float round(float y) { return round_e4m3_sat(y); }
    DSV41_HD static uint8_t code(float y) { return e4m3_code_sat(y); }
    DSV41_HD static uint8_t scale_code(float s) { return static_cast<uint8_t>((f2u(s) >> 23) & 0xff); }
};
template <> struct QuantTraits<Quant::Fp4E4m3B16> {
    static constexpr int kBlock = 16;
    static constexpr float kElemMax = kE2m1Max;
    // s = min(e4m3(max(amax, 6 * 2^-9) / 6), 448): an e4m3 value in [2^-9, 448]
    DSV41_HD static BlockScale scale_def(float amax) {
        const float s = fminf(round_e4m3(div_rn(fmaxf(amax, 0.01171875f), kE2m1Max)), kE4m3Max);
        return {s, rcp_rn(s)};
    }
    DSV41_HD static BlockScale scale(float amax) {
        const float s = q2_scale_value(amax);
        return {s, rcp_rn(s)};
    }
    // RN(x / s): the product by RN(1/s) is within an ulp of x / s; one residual step (exact by
    // FMA) rounds it correctly. A non-finite product is already the quotient's value; the sign
    // is the product's (the residual step turns x = -0 into +0).
    DSV41_HD static float quotient(float x, BlockScale b) {
        const float q = mul_rn(x, b.inv);
        const float r = fma_rn(-q, b.s, x);
        const float q2 = fma_rn(r, b.inv, q);
        return isfinite(q) ? copysignf(q2, q) : q;
    }
    DSV41_HD static float round(float y) { return round_e2m1_sat(y); }
    DSV41_HD static uint8_t code(float y) { return e2m1_code_sat(y); }
    DSV41_HD static uint8_t scale_code(float s) { return e4m3_code_sat(s); }  // s: an e4m3 value
    // The code of x / s without quotient()'s sign and non-finite fix-ups: s > 0, so the code's
    // sign is x's; a non-finite product x * (1/s) makes the residual step NaN, whose magnitude
    // code (7) is that of the saturated +-inf quotient.
    DSV41_HD static uint8_t code_of(float x, BlockScale b) {
        const float q = mul_rn(x, b.inv);
        return e2m1_code_sat_signed(fma_rn(fma_rn(-q, b.s, x), b.inv, q), x);
    }
};
template <> struct QuantTraits<Quant::Fp4Ue8m0B32> {
    static constexpr int kBlock = 32;
    static constexpr float kElemMax = kE2m1Max;
    // s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), k in [-126, 128]
    DSV41_HD static BlockScale scale_def(float amax) {
        return pow2_scale(ceil_log2_normal(div_rn(fmaxf(amax, 6.0f * 1.17549435e-38f), kE2m1Max)));  // >= 2^-126
    }
    DSV41_HD static BlockScale scale(float amax) { return pow2_scale(q3_scale_exp(amax)); }
    DSV41_HD static float quotient(float x, BlockScale b) { return mul_rn(x, b.inv); }
    DSV41_HD static float round(float y) { return round_e2m1_sat(y); }
    DSV41_HD static uint8_t code(float y) { return e2m1_code_sat(y); }
    DSV41_HD static uint8_t scale_code(float s) { return static_cast<uint8_t>((f2u(s) >> 23) & 0xff); }
};

// One fake-quantized element: round(clamp(x / s, +-max)) * s, exact in bf16 (the definition,
// with IEEE x / s and a clamp that keeps NaN, is `fake_quant_reference` in the exhaustive check).
template <Quant Q> DSV41_HD float fake_quant_element(float x, BlockScale b) {
    return mul_rn(QuantTraits<Q>::round(QuantTraits<Q>::quotient(x, b)), b.s);
}

// The element's code (e4m3 byte or e2m1 nibble) in the packed formats.
template <Quant Q> DSV41_HD uint8_t quant_code(float x, BlockScale b) {
    if constexpr (Q == Quant::Fp4E4m3B16) return QuantTraits<Q>::code_of(x, b);
    else return QuantTraits<Q>::code(QuantTraits<Q>::quotient(x, b));
}

// ------------------------------------------------------------ Q3 on bf16 pairs (row-128 kernels)
//
// For a bf16 x and a power-of-two scale s = 2^k, fq_Q3(x) = round_e2m1(clamp(x / s, +-6)) * s is
// computed in the x domain on bf16 values, two per 32-bit word (x0 in the low half), with 7
// instructions per pair instead of ~11 per element:
//
//   a  = min(|x|, 6 s)                 (NaN -> 6 s: min returns the non-NaN operand)
//   M0 = max(2^floor(log2 a), s)       (a's exponent bits; a < s gives s)
//   A  = RN_bf16(a + 64 M0)            (one bf16 FMA)
//   r  = A - 64 M0, with x's sign      (exact)
//
// Near a the e2m1 grid (scaled by s) has the quantum q = M0 / 2 (s/2 below 2 s, s in [2 s, 4 s),
// 2 s in [4 s, 6 s]), which is the ulp of bf16 (8 significant bits) in [64 M0, 128 M0); a < 2 M0
// keeps A in that binade, so A rounds a to a multiple n q of the grid, ties to even n, and 64 M0
// is an even multiple of q: even n = even e2m1 code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
// 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 in units of s). Clamping before rounding keeps r <= 6 s;
// the sign is always x's (negative values rounding to zero give -0, as round_e2m1).
// The e2m1 code is in A's bits: its 7-bit mantissa field is n (0..4) and the code magnitude is
// n + 2 log2(M0 / s) = n + (bits(M0) - bits(s)) / 64.
// The packed integer steps never carry across the halves (every half stays in [0, 2^16)).
// Valid while 64 M0 <= 2^(k+8) and A stay finite: k <= 119 (q3_pair_ok); the kernels use the
// f32 element path for blocks with a larger scale. Checked for every bf16 x (both halves) and
// every k in [-126, 119] against fake_quant_element / quant_code (kernels/check/quant_exhaustive.cu).

// The per-block constants: bits(s) and bits(6 s) as bf16, in both halves.
struct Q3Pair {
    uint32_t s2;
    uint32_t six2;
};
DSV41_HD bool q3_pair_ok(int k) { return k <= 119; }
DSV41_HD Q3Pair q3_pair(int k) {
    const uint32_t sb = static_cast<uint32_t>(k + 127) << 7;  // k >= -126: a normal bf16
    return {sb * 0x10001u, (sb + 0x140u) * 0x10001u};         // 6 s = 1.5 * 2^(k+2)
}

// The bf16 bits of RN(f) for a non-NaN f (the host emulation's rounding).
DSV41_HD uint32_t f32_to_bf16_rn_bits(float f) {
    const uint32_t u = f2u(f);
    return ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & 0xffffu;
}

#ifdef __CUDA_ARCH__
DSV41_HD uint32_t bf16x2_min(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("min.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
DSV41_HD uint32_t bf16x2_max(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
DSV41_HD uint32_t bf16x2_fma_rn(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
#else
// Host emulation, per half, for the operands of the Q3 / Q2 pair paths only: non-negative
// non-NaN min / max operands except a NaN first operand of min; fma(M0, +-64, c) with c in
// [0, 2 M0) (a + 64 M0: exact in f32 unless a < q / 512, where no f32 rounding can reach the
// bf16 midpoint; A - 64 M0: exact); fma(s, T, 0) with an exact bf16 product (q2_pair).
inline float bf16_half_f32(uint32_t h) { return u2f((h & 0xffffu) << 16); }
template <class F> inline uint32_t bf16x2_host(uint32_t a, uint32_t b, F&& f) {
    return f(a & 0xffffu, b & 0xffffu) | (f(a >> 16, b >> 16) << 16);
}
inline uint32_t bf16x2_min(uint32_t a, uint32_t b) {
    return bf16x2_host(a, b, [](uint32_t x, uint32_t y) {
        const float fx = bf16_half_f32(x), fy = bf16_half_f32(y);
        return isnan(fx) ? y : (isnan(fy) ? x : (fy < fx ? y : x));
    });
}
inline uint32_t bf16x2_max(uint32_t a, uint32_t b) {
    return bf16x2_host(a, b, [](uint32_t x, uint32_t y) {
        const float fx = bf16_half_f32(x), fy = bf16_half_f32(y);
        return isnan(fx) ? y : (isnan(fy) ? x : (fy > fx ? y : x));
    });
}
inline uint32_t bf16x2_fma_rn(uint32_t a, uint32_t b, uint32_t c) {
    const uint32_t lo = f32_to_bf16_rn_bits(add_rn(mul_rn(bf16_half_f32(a), bf16_half_f32(b)), bf16_half_f32(c)));
    const uint32_t hi =
        f32_to_bf16_rn_bits(add_rn(mul_rn(bf16_half_f32(a >> 16), bf16_half_f32(b >> 16)), bf16_half_f32(c >> 16)));
    return lo | (hi << 16);
}
#endif

// The shared steps: a = min(|x|, 6 s), M0, A = RN(a + 64 M0) of both halves.
struct Q3PairSteps {
    uint32_t m0;
    uint32_t a_rounded;  // A
};
DSV41_HD Q3PairSteps q3_pair_steps(uint32_t w, Q3Pair p) {
    constexpr uint32_t k64 = 0x42804280u;  // 64.0 in both halves
    const uint32_t a = bf16x2_min(w & 0x7fff7fffu, p.six2);
    const uint32_t m0 = bf16x2_max(a & 0x7f807f80u, p.s2);
    return {m0, bf16x2_fma_rn(m0, k64, a)};
}

// fq_Q3 of the two bf16 values of w with the block constants p (q3_pair_ok), as bf16 bits.
DSV41_HD uint32_t q3_fake_quant_pair(uint32_t w, Q3Pair p) {
    constexpr uint32_t km64 = 0xc280c280u;  // -64.0 in both halves
    const Q3PairSteps t = q3_pair_steps(w, p);
    return bf16x2_fma_rn(t.m0, km64, t.a_rounded) | (w & 0x80008000u);
}

// The e2m1 code magnitudes (0..7, no sign) of the two values of w, in bits 0..2 and 16..18.
DSV41_HD uint32_t q3_mag_pair(uint32_t w, Q3Pair p) {
    const Q3PairSteps t = q3_pair_steps(w, p);
    return (t.a_rounded & 0x00070007u) + ((t.m0 - p.s2) >> 6);
}

// The e2m1 codes (bit 3 = sign) of the two values of w, in bits 0..3 and 16..19.
DSV41_HD uint32_t q3_code_pair(uint32_t w, Q3Pair p) { return q3_mag_pair(w, p) | ((w >> 12) & 0x00080008u); }

// ------------------------------------------------------ Q2 codes on bf16 pairs (format B rows)
//
// For a bf16 x and an e4m3 block scale s (an e4m3 value in [2^-9, 448], not a power of two in
// general) the e2m1 code of RN(x / s) is found without the quotient, by comparing |x| with the
// seven scaled tie points of the e2m1 grid, two values per 32-bit word:
//
//   n = [|x| > 0.25 s] + [|x| >= 0.75 s] + [|x| > 1.25 s] + [|x| >= 1.75 s]
//     + [|x| > 2.5 s]  + [|x| >= 3.5 s]  + [|x| > 5 s]          (code = n | sign(x) << 3)
//
// (ties at 0.25, 1.25, 2.5, 5 go down and at 0.75, 1.75, 3.5 up: ties to the even code). Exact:
// T s has at most 4 + 3 significant bits, so it is a bf16 value (>= 2^-11, normal) and the
// products below are exact; and RN(x / s) compares with T as x / s does (if x != T s, the
// quotient differs from T by more than an f32 ulp: x has 8 significant bits, T s 7), so
// comparing x with T s decides what the rounded quotient's code does. NaN |x| compares
// "unordered" (geu / gtu are true), giving n = 7 like the saturated code; +inf gives 7.
// The count is a two-level search: g4 = [|x| >= 1.75 s] picks the three remaining tie points
// (0.25, 0.75, 1.25 or 2.5, 3.5, 5 times s) per half, whose three flags form a thermometer, so
// n = 4 g4 + 2 g_mid + (g_lo ^ g_mid ^ g_hi): 10 instructions per pair (set.*.u32.bf16x2 gives
// 0xffff / 0 per half), plus ~1 per pair for the signs and the packing into bytes (q2_codes8).
// Checked for every bf16 x (both halves, every position of q2_codes8) and every e4m3 scale
// against quant_code and the division-based definition (kernels/check/quant_exhaustive.cu).

// The tie points T s as bf16 in both halves.
struct Q2Pair {
    uint32_t t025, t075, t125, t175, t25, t35, t5;
};

#ifdef __CUDA_ARCH__
DSV41_HD uint32_t bf16x2_geu_mask(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("set.geu.u32.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
DSV41_HD uint32_t bf16x2_gtu_mask(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("set.gtu.u32.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
#else
inline uint32_t bf16x2_geu_mask(uint32_t a, uint32_t b) {
    auto f = [](uint32_t x, uint32_t y) -> uint32_t {
        const float fx = u2f((x & 0xffffu) << 16), fy = u2f((y & 0xffffu) << 16);
        return (isnan(fx) || isnan(fy) || fx >= fy) ? 0xffffu : 0u;
    };
    return f(a, b) | (f(a >> 16, b >> 16) << 16);
}
inline uint32_t bf16x2_gtu_mask(uint32_t a, uint32_t b) {
    auto f = [](uint32_t x, uint32_t y) -> uint32_t {
        const float fx = u2f((x & 0xffffu) << 16), fy = u2f((y & 0xffffu) << 16);
        return (isnan(fx) || isnan(fy) || fx > fy) ? 0xffffu : 0u;
    };
    return f(a, b) | (f(a >> 16, b >> 16) << 16);
}
#endif

// The tie points of the block scale s (an e4m3 value in [2^-9, 448]): exact bf16 products of
// s (bf16 bits in both halves) with the tie constants.
DSV41_HD Q2Pair q2_pair(float s) {
    const uint32_t s2 = (f2u(s) >> 16) * 0x10001u;
    auto t = [&](uint32_t c) { return bf16x2_fma_rn(s2, c * 0x10001u, 0u); };
    return {t(0x3e80u), t(0x3f40u), t(0x3fa0u), t(0x3fe0u), t(0x4020u), t(0x4060u), t(0x40a0u)};
}

// The e2m1 code magnitudes n (0..7) of the two values of w with the block's tie points p: the
// low value's in bits 0..2, the high value's in bits 20..22, all other bits 0.
DSV41_HD uint32_t q2_mag_pair(uint32_t w, const Q2Pair& p) {
    const uint32_t a = w & 0x7fff7fffu;
    const uint32_t g4 = bf16x2_geu_mask(a, p.t175);
    const uint32_t gm = bf16x2_geu_mask(a, (p.t35 & g4) | (p.t075 & ~g4));
    const uint32_t gl = bf16x2_gtu_mask(a, (p.t25 & g4) | (p.t025 & ~g4));
    const uint32_t gh = bf16x2_gtu_mask(a, (p.t5 & g4) | (p.t125 & ~g4));
    const uint32_t x = ((gl ^ gh) & 0x00100001u) ^ (gm & 0x00300003u);  // bit 0: gl^gm^gh, bit 1: gm
    return x | (g4 & 0x00400004u);
}

// prmt.b32 (default mode): byte i of the result is byte (sel >> 4 i) & 7 of {b, a} (a = bytes
// 0..3), or that byte's sign bit replicated when (sel >> 4 i) & 8.
#ifdef __CUDA_ARCH__
DSV41_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
#else
inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    const uint64_t bytes = a | (static_cast<uint64_t>(b) << 32);
    uint32_t d = 0;
    for (int i = 0; i < 4; ++i) {
        const uint32_t n = (sel >> (4 * i)) & 0xfu;
        uint32_t v = static_cast<uint32_t>(bytes >> (8 * (n & 7u))) & 0xffu;
        if (n & 8u) v = (v & 0x80u) ? 0xffu : 0u;
        d |= v << (8 * i);
    }
    return d;
}
#endif

// The e2m1 codes (bit 3 = sign) of the 8 values of w[0..4) (low half first) as the 8 nibbles
// of one word, value k in bits 4 k .. 4 k + 3 (the byte order of the packed rows). Per two
// words: magnitudes at bits 0 / 20 (w0) and 8 / 28 (w1), the four signs by one prmt that
// replicates the bf16 sign bits into bytes 0..3 (bits 3, 11, 23, 31 kept), then the high
// halves of both pairs of words folded down by one prmt each.
DSV41_HD uint32_t q2_codes8(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, const Q2Pair& p) {
    const uint32_t v01 = (q2_mag_pair(w0, p) | (q2_mag_pair(w1, p) << 8)) | (prmt(w0, w1, 0xfbd9u) & 0x80800808u);
    const uint32_t v23 = (q2_mag_pair(w2, p) | (q2_mag_pair(w3, p) << 8)) | (prmt(w2, w3, 0xfbd9u) & 0x80800808u);
    return prmt(v01, v23, 0x5410u) | prmt(v01, v23, 0x7632u);
}

// The Q2 block scale by the hardware e4m3 conversion: its e4m3 byte (cvt.rn.satfinite.e4m3x2
// of the correctly rounded quotient max(amax, 6 * 2^-9) / 6; +inf saturates to 448) and its
// value (cvt.rn.f16x2.e4m3x2, exact). Equal to e4m3_code_sat / q2_scale_value for every
// non-negative non-NaN amax (kernels/check/quant_exhaustive.cu compares CUDA's host emulation
// of the conversion).
struct Q2Scale {
    uint32_t code;
    float s;
};
#ifdef __CUDA_ARCH__
DSV41_HD Q2Scale q2_scale_hw(float amax) {
    const float q = q2_scale_quotient(amax);
    uint16_t c;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(c) : "f"(0.0f), "f"(q));
    uint32_t h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(c));
    float s;
    asm("{ .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, lo; }" : "=f"(s) : "r"(h));
    return {static_cast<uint32_t>(c) & 0xffu, s};
}
#else
// Host: CUDA's host emulation of the two conversions (the exhaustive check compares this).
inline Q2Scale q2_scale_hw(float amax) {
    const uint32_t code = __nv_cvt_float_to_fp8(q2_scale_quotient(amax), __NV_SATFINITE, __NV_E4M3);
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
    return {code, __half2float(__half(h))};
}
#endif

// ------------------------------------- Q3 block scales and 4-element codes from bf16 pairs (row 128)
//
// The row-128 kernels reduce the block maxima as bf16 pairs (two blocks per word, one shuffle and
// one max.bf16x2 per level for both): a block's max of the bf16-ROUNDED values, floored at
// 6 * 2^-126 (a bf16 value, 0x01c0; the floor also replaces an all-NaN block's NaN, as the
// fmaxf fold from 0 does), is round_bf16 of the f32 max (rounding is monotone), so its Q3
// scale k = q3_scale_exp(a) = E - 2 + (M > 1.5) comes straight from the 16 bits:
// k + 127 = ((a + 0x3f) >> 7) - 2 (the 7-bit mantissa field exceeds 0x40 exactly when adding 0x3f
// carries). q3_scale_bits2 gives (k + 127) << 7 (= bits(s) as bf16) for both halves at once:
// (a + 0x3f - 0x100) & 0xff80 = ((a + 0x3f) & 0xff80) - 0x100, with a >= 0x01c0 no half borrows.
// Valid where the pair path is (k <= 119, i.e. a half <= 0x7b00: q3_scale_bits2_ok); +inf (k =
// 128 by q3_scale_exp) gives 0x7e80, which fails the test. Checked for every bf16 amax in both
// halves (kernels/check/quant_exhaustive.cu).
constexpr uint32_t kQ3AmaxFloor2 = 0x01c001c0u;  // 6 * 2^-126 in both halves
DSV41_HD uint32_t q3_scale_bits2(uint32_t amax2) { return (amax2 - 0x00c100c1u) & 0xff80ff80u; }
DSV41_HD bool q3_scale_bits2_ok(uint32_t sb2) { return ((sb2 + 0x04800480u) & 0x80008000u) == 0; }
// The Q3Pair of the block in the low (hi = false) or high half of q3_scale_bits2's word.
DSV41_HD Q3Pair q3_pair_from_bits2(uint32_t sb2, bool hi) {
    const uint32_t s2 = prmt(sb2, 0u, hi ? 0x3232u : 0x1010u);
    return {s2, s2 + 0x01400140u};
}

// The e2m1 codes (bit 3 = sign) of the 4 values of w0 (low half first), w1 as the 4 nibbles of
// the low 16 bits, value i in bits 4 i .. 4 i + 3 (the packed row's byte order). The magnitudes
// of both words meet at bytes 0, 2 (w0) and 1, 3 (w1), one prmt replicates the four bf16 sign
// bits into bytes in that order (bit 3 of each kept), and one shift-add folds the high bytes
// down. Checked for every bf16 value in each of the 4 positions and every k in [-126, 119].
// q3_codes4_raw: the same in the low 16 bits, the high 16 bits unspecified (for 16-bit stores).
DSV41_HD uint32_t q3_codes4_raw(uint32_t w0, uint32_t w1, Q3Pair p) {
    const uint32_t v = (q3_mag_pair(w0, p) + (q3_mag_pair(w1, p) << 8)) | (prmt(w0, w1, 0xfbd9u) & 0x08080808u);
    return v + (v >> 12);
}
DSV41_HD uint32_t q3_codes4(uint32_t w0, uint32_t w1, Q3Pair p) { return q3_codes4_raw(w0, w1, p) & 0xffffu; }
// q3_codes4_raw with the magnitudes by integer steps on the bf16 bits (the same 32 bits; the
// format E row-128 kernel's form). Per half: A = RN(64 m0 + a) with 0 <= a < 2 m0 lies in
// [64 m0, 66 m0], so A - m0 = 0x300 + (A & 7) (the mantissa is at most 4), and (m0 - s2) >> 6 =
// (m0 >> 6) - (s2 >> 6) (the low 7 bits of m0 and s2 are zero, m0 >= s2); hence q3_mag_pair =
// A - m0 + (m0 >> 6) - K with K = 0x03000300 + (s2 >> 6). Both words at once, mod 2^32 (m1 = word
// 1's m0; (m1 >> 6) << 8 = m1 << 2 as its low 6 bits are zero):
//   mag0 + (mag1 << 8) = A0 - m0 + (m0 >> 6) + (A1 << 8) - 252 m1 - 257 K,
// kc = 257 K per block (q3_codes4_kc): 4 integer steps per chunk and 2 per block instead of 7 per
// chunk (format E at G = 32768: 6.72 -> 6.69 us on the H200). Checked against q3_codes4_raw, all
// 32 bits, for every bf16 value in each of the 4 positions and every k in [-126, 119]
// (kernels/check/quant_exhaustive.cu).
DSV41_HD uint32_t q3_codes4_kc(Q3Pair p) { return 257u * (0x03000300u + (p.s2 >> 6)); }
DSV41_HD uint32_t q3_codes4_raw_kc(uint32_t w0, uint32_t w1, Q3Pair p, uint32_t kc) {
    const Q3PairSteps t0 = q3_pair_steps(w0, p), t1 = q3_pair_steps(w1, p);
    const uint32_t m = (t0.a_rounded - t0.m0 + (t1.a_rounded << 8) - 252u * t1.m0 - kc) + (t0.m0 >> 6);
    const uint32_t v = m | (prmt(w0, w1, 0xfbd9u) & 0x08080808u);
    return v + (v >> 12);
}

// bf16 pairs: the RN bf16 rounding of two f32 as one bf16x2 word (low half = lo).
__device__ __forceinline__ uint32_t pack_bf16x2_rn(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// f32 -> bf16 -> f32, round to nearest even (half::bf16::from_f32 / candle's to_dtype).
__device__ __forceinline__ float round_bf16(float x) {
    return __bfloat162float(__float2bfloat16_rn(x));
}

// GPT-J rotation of one pair exactly as candle-nn's CPU `rope_i`:
//   y0 = x0*c - x1*s,  y1 = x0*s + x1*c   (two roundings per product, one per sum, no FMA).
__device__ __forceinline__ void rotate_pair(float& x0, float& x1, float c, float s) {
    const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    const float y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    x0 = y0;
    x1 = y1;
}

// Sum over a warp of the per-lane partial sums `p[L] = sum_k v[32k + L]` (each accumulated
// sequentially from 0 by its lane) in the association of candle's CPU f32 `vec_sum` on x86-64
// with AVX2 (candle-core src/cpu/avx.rs: 4 accumulators of 8 lanes over steps of 32 elements,
// then `vec_reduce`): ((p[L] + p[L^8]) + (..^16)), then the 128-bit halves (^4), then two
// horizontal adds (^1, then ^2). Every lane returns the same value. Valid for lengths that are
// multiples of 32 (no scalar tail). On hosts without AVX2 candle sums sequentially instead and
// results can differ from the CPU by an ulp.
__device__ __forceinline__ float warp_sum_candle_avx_order(float p) {
    p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, 8));
    p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, 16));
    p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, 4));
    p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, 1));
    p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, 2));
    return __shfl_sync(0xffffffffu, p, 0);
}

}  // namespace dsv41
