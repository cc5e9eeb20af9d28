// Exhaustive host check of the fast fake-quant element path of dsv41_numerics.cuh against the
// division-based definitions (the numerics the CPU reference and the first kernels use):
//
//   definition:  y = x / s (IEEE); y = clamp(y, +-max) keeping NaN; value = round(y) * s,
//                code = e4m3_code(y) / e2m1_code(y)
//   fast path:   fake_quant_element<Q>(x, scale) and quant_code<Q>(x, scale)
//
// for EVERY bf16 x (all 65536 bit patterns, NaN / inf / subnormals included) and EVERY block
// scale the format can produce (Q1: 2^k, k in [-22, 128]; Q3: 2^k, k in [-126, 128]; Q2: every
// e4m3 value in [2^-9, 448]). It also checks that the scale functions only produce those
// scales for every bf16 amax. The kernels' element inputs are always bf16 values (loaded rows,
// or RoPE / norm outputs rounded to bf16), so this covers every case the kernels meet.
//
// Not part of the build (build.rs compiles kernels/*.cu only). Run on any host with nvcc:
//
//   nvcc -std=c++17 -O2 -Xcompiler -ffp-contract=off -I kernels/include \
//        kernels/check/quant_exhaustive.cu -o /tmp/quant_exhaustive && /tmp/quant_exhaustive
#include <stdio.h>

#include "dsv41_numerics.cuh"

using namespace dsv41;

static float bf16_bits_to_f32(uint32_t b) { return u2f(b << 16); }

template <Quant Q> static float round_def(float y) {
    if constexpr (Q == Quant::Fp8Ue8m0B32) return round_e4m3(y);
    else return round_e2m1(y);
}
template <Quant Q> static uint8_t code_def(float y) {
    if constexpr (Q == Quant::Fp8Ue8m0B32) return e4m3_code(y);
    else return e2m1_code(y);
}
template <Quant Q> static float clamp_def(float x, float s) {
    constexpr float m = QuantTraits<Q>::kElemMax;
    float y = x / s;
    return y > m ? m : (y < -m ? -m : y);
}

static bool same(float a, float b) { return f2u(a) == f2u(b) || (isnan(a) && isnan(b)); }

template <Quant Q> static long check_scale(BlockScale b, const char* name) {
    long bad = 0;
    for (uint32_t xb = 0; xb < 65536; ++xb) {
        const float x = bf16_bits_to_f32(xb);
        const float y = clamp_def<Q>(x, b.s);
        const float want = round_def<Q>(y) * b.s;
        const float got = fake_quant_element<Q>(x, b);
        const uint8_t want_code = code_def<Q>(y), got_code = quant_code<Q>(x, b);
        if (!same(want, got) || want_code != got_code) {
            if (bad < 5)
                printf("%s: x=%a (0x%04x) s=%a: value %a vs %a, code %02x vs %02x\n", name, x, xb, b.s, got, want,
                       got_code, want_code);
            ++bad;
        }
    }
    return bad;
}

template <Quant Q> static long check_pow2(int kmin, const char* name) {
    long bad = 0, n = 0;
    // Every bf16 amax gives a scale 2^k with k in [kmin, 128].
    for (uint32_t ab = 0; ab < 0x7f81; ++ab) {
        const BlockScale b = QuantTraits<Q>::scale(bf16_bits_to_f32(ab));
        const int k = ceil_log2(b.s);
        const float want = pow2(ceil_log2(div_rn(fmaxf(bf16_bits_to_f32(ab), Q == Quant::Fp8Ue8m0B32 ? 1e-4f : 6.0f * 1.17549435e-38f),
                                                 QuantTraits<Q>::kElemMax)));
        if (k < kmin || k > 128 || b.s != pow2(k) || b.s != want) {
            if (bad < 5) printf("%s: amax 0x%04x gives scale %a outside the checked set\n", name, ab, b.s);
            ++bad;
        }
    }
    for (int k = kmin; k <= 128; ++k, ++n) {
        const BlockScale b = pow2_scale(k);
        if (b.s != pow2(k) || !(b.inv == 1.0f / b.s)) {
            printf("%s: pow2_scale(%d) = {%a, %a}\n", name, k, b.s, b.inv);
            ++bad;
        }
        bad += check_scale<Q>(b, name);
    }
    printf("%s: %ld scales x 65536 bf16 values: %ld mismatches\n", name, n, bad);
    return bad;
}

static long check_q2() {
    const char* name = "Q2 fp4 e4m3-scale b16";
    long bad = 0, n = 0;
    bool is_scale[256] = {};
    for (uint32_t c = 1; c < 0x7f; ++c) {  // positive finite e4m3 codes
        const uint32_t e = c >> 3, m = c & 7;
        const float s = e == 0 ? m * 0.001953125f : pow2(static_cast<int>(e) - 7) * (1.0f + m / 8.0f);
        is_scale[c] = true;
        bad += check_scale<Quant::Fp4E4m3B16>({s, 1.0f / s}, name);
        ++n;
    }
    for (uint32_t ab = 0; ab < 0x7f81; ++ab) {
        const BlockScale b = QuantTraits<Quant::Fp4E4m3B16>::scale(bf16_bits_to_f32(ab));
        if (!(b.s >= 0.001953125f && b.s <= 448.0f) || !is_scale[e4m3_code(b.s)] || b.inv != 1.0f / b.s) {
            if (bad < 5) printf("%s: amax 0x%04x gives scale %a outside the checked set\n", name, ab, b.s);
            ++bad;
        }
    }
    printf("%s: %ld scales x 65536 bf16 values: %ld mismatches\n", name, n, bad);
    return bad;
}

int main() {
    long bad = check_pow2<Quant::Fp8Ue8m0B32>(-22, "Q1 fp8 ue8m0 b32");
    bad += check_q2();
    bad += check_pow2<Quant::Fp4Ue8m0B32>(-126, "Q3 fp4 ue8m0 b32");
    printf("%s\n", bad == 0 ? "all equal" : "MISMATCHES");
    return bad == 0 ? 0 : 1;
}
