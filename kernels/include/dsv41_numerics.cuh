// Bit-exact device versions of the crate's CPU numerics (crates/deepseek-v41/src/quant/ and
// src/nn/): e4m3 / e2m1 rounding, the three QAT block scales of spec §2.3, the GPT-J rotation,
// and the f32 reduction order of candle's CPU `sum` over a last dim.
//
// Every floating-point operation whose rounding matters is written with an explicit `_rn`
// intrinsic (__fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn): those are never contracted
// into FMAs and never replaced by approximations, whatever -fmad / --use_fast_math say. That is
// what makes the GPU results equal the CPU ones bit for bit (Rust never contracts a*b+c).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace dsv41 {

constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;

// 2^e as an f32 for e in [-149, 127] (subnormals included), like quant::formats::pow2.
__device__ __forceinline__ float pow2(int e) {
    if (e > 127) return __int_as_float(0x7f800000);
    if (e >= -126) return __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
    if (e >= -149) return __uint_as_float(1u << (e + 149));
    return 0.0f;
}

// ceil(log2(v)) of a positive finite f32, exactly from its bits (quant::formats::ceil_log2).
__device__ __forceinline__ int ceil_log2(float v) {
    const uint32_t bits = __float_as_uint(v);
    const int exp = static_cast<int>((bits >> 23) & 0xff);
    const uint32_t man = bits & 0x7fffff;
    if (exp == 0) {  // subnormal: v = man * 2^-149
        const int bitlen = 32 - __clz(man);
        const int fl = bitlen - 1 - 149;
        return (man & (man - 1)) == 0 ? fl : fl + 1;
    }
    return exp - 127 + (man != 0 ? 1 : 0);
}

// Nearest e4m3fn value, ties to even, saturating at +-448; NaN stays NaN, the sign of zero is
// kept (quant::formats::round_to_e4m3).
__device__ __forceinline__ float round_e4m3(float x) {
    if (isnan(x)) return x;
    const float a = fabsf(x);
    if (a >= kE4m3Max) return copysignf(kE4m3Max, x);
    if (a == 0.0f) return x;
    // Normal e4m3 exponents go down to -6; below that the quantum stays 2^-9 (subnormals).
    const int e = max(static_cast<int>((__float_as_uint(a) >> 23) & 0xff) - 127, -6);
    const float quantum = pow2(e - 3);
    const float q = __fmul_rn(rintf(__fdiv_rn(a, quantum)), quantum);  // rintf: ties to even
    return copysignf(fminf(q, kE4m3Max), x);
}

// Nearest e2m1 value with ties to the even code (quant::formats::round_to_e2m1): ties at 0.25,
// 1.25, 2.5 and 5 go down, 0.75, 1.75 and 3.5 go up; saturates at +-6; NaN gives +-6; the sign
// is always kept (negative values rounding to zero give -0.0).
__device__ __forceinline__ float round_e2m1(float x) {
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
    return (__float_as_uint(x) >> 31) ? -m : m;
}

// e2m1 code (bit 3 = sign) of round_e2m1(x), as quant::formats::f32_to_e2m1.
__device__ __forceinline__ uint8_t e2m1_code(float x) {
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
    return static_cast<uint8_t>(((__float_as_uint(x) >> 31) << 3) | m);
}

// e4m3fn byte of round_e4m3(x) (quant::formats::f32_to_e4m3); NaN gives 0x7f | sign.
__device__ __forceinline__ uint8_t e4m3_code(float x) {
    const uint8_t sign = (__float_as_uint(x) >> 31) ? 0x80 : 0x00;
    if (isnan(x)) return sign | 0x7f;
    const float a = fabsf(round_e4m3(x));
    if (a == 0.0f) return sign;
    const uint32_t bits = __float_as_uint(a);
    const int e = static_cast<int>(bits >> 23) - 127;
    if (e < -6) return sign | static_cast<uint8_t>(__fmul_rn(a, 512.0f));  // subnormal m * 2^-9
    return sign | static_cast<uint8_t>((e + 7) << 3) | static_cast<uint8_t>((bits >> 20) & 0x7);
}

// The QAT formats of spec §2.3 (values equal enum Dsv41Quant).
enum class Quant : int { None = 0, Fp8Ue8m0B32 = 1, Fp4E4m3B16 = 2, Fp4Ue8m0B32 = 3 };

template <Quant Q> struct QuantTraits;
template <> struct QuantTraits<Quant::Fp8Ue8m0B32> {
    static constexpr int kBlock = 32;
    static constexpr float kElemMax = kE4m3Max;
    // s = 2^ceil(log2(max(amax, 1e-4) / 448))
    __device__ static float scale(float amax) {
        return pow2(ceil_log2(__fdiv_rn(fmaxf(amax, 1e-4f), kE4m3Max)));
    }
    __device__ static float round(float y) { return round_e4m3(y); }
};
template <> struct QuantTraits<Quant::Fp4E4m3B16> {
    static constexpr int kBlock = 16;
    static constexpr float kElemMax = kE2m1Max;
    // s = min(e4m3(max(amax, 6 * 2^-9) / 6), 448)
    __device__ static float scale(float amax) {
        return fminf(round_e4m3(__fdiv_rn(fmaxf(amax, 0.01171875f), kE2m1Max)), kE4m3Max);
    }
    __device__ static float round(float y) { return round_e2m1(y); }
};
template <> struct QuantTraits<Quant::Fp4Ue8m0B32> {
    static constexpr int kBlock = 32;
    static constexpr float kElemMax = kE2m1Max;
    // s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6))
    __device__ static float scale(float amax) {
        return pow2(ceil_log2(__fdiv_rn(fmaxf(amax, 6.0f * 1.17549435e-38f), kE2m1Max)));
    }
    __device__ static float round(float y) { return round_e2m1(y); }
};

// One fake-quantized element: round(clamp(x / s, +-max)) * s. The clamp keeps NaN (as Rust's
// f32::clamp does); the division is IEEE (exact ties stay ties).
template <Quant Q> __device__ __forceinline__ float fake_quant_element(float x, float s) {
    constexpr float m = QuantTraits<Q>::kElemMax;
    float y = __fdiv_rn(x, s);
    y = y > m ? m : (y < -m ? -m : y);
    return __fmul_rn(QuantTraits<Q>::round(y), s);
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
