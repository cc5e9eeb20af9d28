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
// It also checks the division-free block-scale functions against their division-based
// definitions for every non-negative non-NaN f32 amax, the norm quotient x * RN(1/r) + one FMA
// residual step against IEEE x / r (every bf16 x in a binade against every f32 r in a binade,
// the base case of the scaling argument in dsv41_numerics.cuh, plus the ends of its range), and
// the Q1 codes against CUDA's host emulation of the hardware e4m3 conversion the packed kernel
// uses, and the bf16-pair Q3 path of the 128-wide kernels (q3_fake_quant_pair, q3_code_pair,
// q3_codes4, the block scale bits from bf16 pair maxima q3_scale_bits2, the exactness of the
// bf16 squares the norm sums by FMA) against the element path, with a host emulation of the three bf16x2
// instructions it uses (min, max, fma.rn), exact for its operands, and the bf16-pair Q2 codes of
// the format B kernel (q2_mag_pair / q2_codes8: tie-point comparisons) against the element path
// and the definition, with host emulations of set.geu / set.gtu.u32.bf16x2 and prmt, and its
// block scale by the hardware e4m3 conversion (q2_scale_hw) against q2_scale_value.
//
// Not part of the build (build.rs compiles kernels/*.cu only). Run on any host with nvcc (a few
// minutes; -mfma makes the host fmaf a single instruction, drop it on CPUs without FMA):
//
//   nvcc -std=c++17 -O2 -Xcompiler -ffp-contract=off -Xcompiler -mfma -I kernels/include \
//        kernels/check/quant_exhaustive.cu -o /tmp/quant_exhaustive && /tmp/quant_exhaustive
//
// `/tmp/quant_exhaustive q3-pair` (~30 s), `... q2`, `... q2-pair` or `... q3-row128` (seconds)
// runs one part only.
#include <stdio.h>
#include <string.h>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

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
        // Q1 codes: the kernels use the hardware e4m3 conversion (cvt.rn.satfinite.e4m3x2.f32)
        // for non-NaN quotients; compare with CUDA's host emulation of that conversion.
        bool hw_ok = true;
        if constexpr (Q == Quant::Fp8Ue8m0B32) {
            const float yq = QuantTraits<Q>::quotient(x, b);
            if (!isnan(yq)) hw_ok = __nv_cvt_float_to_fp8(yq, __NV_SATFINITE, __NV_E4M3) == got_code;
        }
        if (!same(want, got) || want_code != got_code || !hw_ok) {
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

// The division-free scale functions against their division-based definitions (`scale_def`)
// for EVERY non-negative, non-NaN f32 amax bit pattern (zero, subnormals, normals, +inf): equal
// scale and reciprocal, and for Q2 equal scale code. (A block's amax is never NaN on the device:
// it is an fmaxf fold from 0, and the device fmaxf drops NaN operands.)
template <Quant Q> static long check_scale_fn(const char* name) {
    long bad = 0;
    for (uint32_t ab = 0; ab <= 0x7f800000u; ++ab) {
        const float a = u2f(ab);
        const BlockScale got = QuantTraits<Q>::scale(a), want = QuantTraits<Q>::scale_def(a);
        bool ok = f2u(got.s) == f2u(want.s) && f2u(got.inv) == f2u(want.inv);
        if constexpr (Q == Quant::Fp4E4m3B16) ok = ok && QuantTraits<Q>::scale_code(got.s) == e4m3_code(want.s);
        if (!ok) {
            if (bad < 5) printf("%s scale: amax %a (0x%08x): %a vs %a\n", name, a, ab, got.s, want.s);
            ++bad;
        }
    }
    printf("%s: scale function on all 0x7f800001 non-negative non-NaN amax patterns: %ld mismatches\n", name, bad);
    return bad;
}

// The norm quotient div_by_rcp(x, r, RN(1/r)) against IEEE x / r: every bf16 x of magnitude in
// [2^i, 2^(i+1)) against every f32 r in [2^j, 2^(j+1)). (0, 0) is the base case the scaling
// argument of dsv41_numerics.cuh extends; the others are spot checks at the ends of the fast
// path's range (|x| >= 2^-64, r in [2^-60, 2^60)).
static long check_norm_div(int i, int j, bool both_signs) {
    long bad = 0, n = 0;
    const float sx = pow2(i), sr = pow2(j);
    for (uint32_t rb = 0x3f800000u; rb < 0x40000000u; ++rb) {
        const float r = mul_rn(u2f(rb), sr);
        if (!norm_div_row_ok(r)) {
            printf("norm div: r = %a fails the row test\n", r);
            return 1;
        }
        const float y = rcp_rn(r);
        for (uint32_t xb = 0x3f80; xb < 0x4000; ++xb) {
            for (int sign = 0; sign < (both_signs ? 2 : 1); ++sign) {
                const float x = mul_rn(bf16_bits_to_f32(xb | (sign ? 0x8000u : 0u)), sx);
                if (!norm_div_x_ok(fabsf(x))) {
                    printf("norm div: x = %a fails the lane test\n", x);
                    return 1;
                }
                const float got = div_by_rcp(x, r, y), want = div_rn(x, r);
                ++n;
                if (f2u(got) != f2u(want)) {
                    if (bad < 5) printf("norm div: x=%a r=%a: %a vs %a\n", x, r, got, want);
                    ++bad;
                }
            }
        }
    }
    printf("norm div x in [2^%d, 2^%d), r in [2^%d, 2^%d): %ld cases, %ld mismatches\n", i, i + 1, j, j + 1, n, bad);
    return bad;
}

// The bf16-pair Q3 path (q3_fake_quant_pair / q3_code_pair) against fake_quant_element /
// quant_code of the f32 path for every bf16 x in BOTH halves of the word (the high half holds
// a permutation of the values, so a carry or borrow across the halves would show) and every
// scale 2^k with q3_pair_ok(k), k in [-126, 119]. NaN x: value +-6 s and code 7 by x's sign.
static long check_q3_pair() {
    constexpr Quant Q = Quant::Fp4Ue8m0B32;
    long bad = 0, n = 0;
    for (int k = -126; q3_pair_ok(k); ++k, ++n) {
        const BlockScale b = pow2_scale(k);
        const Q3Pair p = q3_pair(k);
        for (uint32_t lo = 0; lo < 65536; ++lo) {
            const uint32_t hi = (lo * 40503u + 12345u) & 0xffffu;  // odd multiplier: a permutation
            const uint32_t w = lo | (hi << 16);
            const uint32_t v = q3_fake_quant_pair(w, p), c = q3_code_pair(w, p);
            for (int h = 0; h < 2; ++h) {
                const uint32_t xb = h ? hi : lo;
                const float x = bf16_bits_to_f32(xb);
                const float want = fake_quant_element<Q>(x, b);
                const uint8_t want_code = quant_code<Q>(x, b);
                const float got = bf16_bits_to_f32((v >> (16 * h)) & 0xffffu);
                const uint32_t got_code = (c >> (16 * h)) & 0xffffu;
                if (f2u(want) != f2u(got) || want_code != got_code || (f2u(want) & 0xffffu) != 0) {
                    if (bad < 5)
                        printf("Q3 pair: k=%d x=%a (0x%04x): value %a vs %a, code %02x vs %02x\n", k, x, xb, got, want,
                               got_code, want_code);
                    ++bad;
                }
            }
        }
    }
    printf("Q3 bf16 pairs: %ld scales x 65536 x 2 bf16 values: %ld mismatches\n", n, bad);
    return bad;
}

// The bf16-pair Q2 codes of the format B kernel (q2_pair, q2_mag_pair, q2_codes8) against
// quant_code (the f32 element path) AND the division-based definition e2m1_code(clamp(x / s))
// for every bf16 x in every position of q2_codes8's four words (each word holds x in its low
// half and a permutation of the values in its high half; the four words are rotations of each
// other, so every value meets every nibble position) and every e4m3 scale s in [2^-9, 448] (all
// the scales q2_scale_value produces, check_q2). Also checks that the tie points are the exact
// products T s and that q2_mag_pair leaves the bits outside its two fields zero.
static long check_q2_pair() {
    constexpr Quant Q = Quant::Fp4E4m3B16;
    const float ties[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    long bad = 0, n = 0;
    auto perm = [](uint32_t v) { return (v * 40503u + 12345u) & 0xffffu; };  // odd multiplier: a permutation
    for (uint32_t c = 1; c < 0x7f; ++c, ++n) {
        const uint32_t e = c >> 3, m = c & 7;
        const float s = e == 0 ? m * 0.001953125f : pow2(static_cast<int>(e) - 7) * (1.0f + m / 8.0f);
        const BlockScale b{s, 1.0f / s};
        const Q2Pair p = q2_pair(s);
        const uint32_t got_t[7] = {p.t025, p.t075, p.t125, p.t175, p.t25, p.t35, p.t5};
        for (int i = 0; i < 7; ++i) {
            const float want = s * ties[i];
            if ((f2u(want) & 0xffffu) != 0 || got_t[i] != (f2u(want) >> 16) * 0x10001u) {
                printf("Q2 pair: s=%a tie %g: %08x vs %a\n", s, ties[i], got_t[i], want);
                ++bad;
            }
        }
        uint8_t want[65536];
        for (uint32_t xb = 0; xb < 65536; ++xb) {
            const float x = bf16_bits_to_f32(xb);
            want[xb] = quant_code<Q>(x, b);
            if (want[xb] != e2m1_code(clamp_def<Q>(x, s))) {
                if (bad < 5) printf("Q2 element path: s=%a x=%a: %02x vs %02x\n", s, x, want[xb], e2m1_code(clamp_def<Q>(x, s)));
                ++bad;
            }
        }
        for (uint32_t lo = 0; lo < 65536; ++lo) {
            uint32_t xs[8];  // the 8 values in nibble order: w[k] = xs[2k] | xs[2k+1] << 16
            for (int k = 0; k < 8; ++k) xs[k] = k % 2 == 0 ? (lo + 9973u * (k / 2)) & 0xffffu : perm((lo + 9973u * (k / 2)) & 0xffffu);
            uint32_t w[4];
            for (int k = 0; k < 4; ++k) w[k] = xs[2 * k] | (xs[2 * k + 1] << 16);
            const uint32_t mag = q2_mag_pair(w[0], p);
            if ((mag & ~0x00700007u) != 0 || (mag & 7u) != (want[xs[0]] & 7u) || ((mag >> 20) & 7u) != (want[xs[1]] & 7u)) {
                if (bad < 5) printf("Q2 pair magnitudes: s=%a w=%08x: %08x\n", s, w[0], mag);
                ++bad;
            }
            const uint32_t codes = q2_codes8(w[0], w[1], w[2], w[3], p);
            for (int k = 0; k < 8; ++k) {
                const uint32_t got = (codes >> (4 * k)) & 0xfu;
                if (got != want[xs[k]]) {
                    if (bad < 5)
                        printf("Q2 codes8: s=%a x=%a (0x%04x) nibble %d: %x vs %x\n", s, bf16_bits_to_f32(xs[k]), xs[k], k, got,
                               want[xs[k]]);
                    ++bad;
                }
            }
        }
    }
    printf("Q2 bf16 pairs: %ld scales x 65536 x 8 positions: %ld mismatches\n", n, bad);
    return bad;
}

// The format B kernel's block scale by the hardware e4m3 conversion (q2_scale_hw: the byte of
// cvt.rn.satfinite.e4m3x2 of q2_scale_quotient, the value back by cvt.rn.f16x2.e4m3x2),
// emulated with CUDA's host conversions, against q2_scale_value and its e4m3_code_sat for
// EVERY non-negative non-NaN f32 amax.
static long check_q2_scale_hw() {
    long bad = 0;
    for (uint32_t ab = 0; ab <= 0x7f800000u; ++ab) {
        const float a = u2f(ab);
        const Q2Scale hw = q2_scale_hw(a);  // the host version: CUDA's emulation of the conversions
        const uint32_t code = hw.code;
        const float s = hw.s;
        const float want = q2_scale_value(a);
        if (code != e4m3_code_sat(want) || f2u(s) != f2u(want)) {
            if (bad < 5) printf("Q2 hw scale: amax %a (0x%08x): code %02x value %a vs %02x %a\n", a, ab, code, s, e4m3_code_sat(want), want);
            ++bad;
        }
    }
    printf("Q2 hw scale on all 0x7f800001 non-negative non-NaN amax patterns: %ld mismatches\n", bad);
    return bad;
}

// The row-128 kernels' Q3 block scales from bf16 pairs of block maxima:
// q3_scale_bits2 of max(a, floor) (max.bf16x2, NaN -> floor) against q3_scale_exp of the block's
// max for every non-negative bf16 pattern a (NaN patterns stand for an all-NaN block, whose
// f32 fold from 0 gives 0) in both halves (the other half a permutation), q3_scale_bits2_ok
// exactly where q3_pair_ok, q3_pair_from_bits2 equal to q3_pair, and the kernel's scale bytes
// (prmt of the two words shifted by 7) equal to k + 127.
static long check_q3_scale_bits2() {
    long bad = 0;
    auto perm = [](uint32_t v) { return (v * 40503u + 12345u) & 0x7fffu; };  // odd multiplier: a permutation of [0, 2^15)
    auto want_k = [](uint32_t a) {
        const float f = bf16_bits_to_f32(a);
        return q3_scale_exp(isnan(f) ? 0.0f : f);
    };
    for (uint32_t lo = 0; lo < 0x8000u; ++lo) {
        const uint32_t hi = perm(lo), lo2 = perm(hi), hi2 = perm(lo2);
        const uint32_t w = bf16x2_max(lo | (hi << 16), kQ3AmaxFloor2), w2 = bf16x2_max(lo2 | (hi2 << 16), kQ3AmaxFloor2);
        const uint32_t sb = q3_scale_bits2(w), sb2 = q3_scale_bits2(w2);
        const uint32_t a[4] = {lo, hi, lo2, hi2};
        const uint32_t half[4] = {sb & 0xffffu, sb >> 16, sb2 & 0xffffu, sb2 >> 16};
        bool all_ok = true;
        for (int i = 0; i < 4; ++i) {
            const int k = want_k(a[i]);
            const bool ok = q3_pair_ok(k);
            all_ok = all_ok && ok;
            const bool ok_got = q3_scale_bits2_ok(i < 2 ? (i == 0 ? sb & 0xffffu : sb & 0xffff0000u) : (i == 2 ? sb2 & 0xffffu : sb2 & 0xffff0000u));
            bool good = ok_got == ok;
            if (ok) {
                const Q3Pair got = q3_pair_from_bits2(i < 2 ? sb : sb2, i % 2 == 1), want = q3_pair(k);
                good = good && half[i] == (static_cast<uint32_t>(k + 127) << 7) && got.s2 == want.s2 && got.six2 == want.six2;
            }
            if (!good) {
                if (bad < 5) printf("Q3 scale bits2: amax 0x%04x: half %04x ok %d, k %d\n", a[i], half[i], ok_got, k);
                ++bad;
            }
        }
        const bool both = (((sb + 0x04800480u) | (sb2 + 0x04800480u)) & 0x80008000u) == 0;  // q3_blocks_v2's test
        if (both != all_ok) {
            if (bad < 5) printf("Q3 scale bits2: joint test %d vs %d at 0x%04x\n", both, all_ok, lo);
            ++bad;
        }
        if (all_ok) {
            const uint32_t bytes = prmt(sb >> 7, sb2 >> 7, 0x6420u);
            for (int i = 0; i < 4; ++i)
                if (((bytes >> (8 * i)) & 0xffu) != static_cast<uint32_t>(want_k(a[i]) + 127)) {
                    if (bad < 5) printf("Q3 scale bytes: 0x%08x at 0x%04x\n", bytes, lo);
                    ++bad;
                }
        }
    }
    printf("Q3 scale bits from bf16 pair maxima (4 x 32768 patterns): %ld mismatches\n", bad);
    return bad;
}

// q3_codes4 / the low 16 bits of q3_codes4_raw (4 e2m1 codes of two bf16 pairs as one 16-bit
// value; q3_codes4_raw_kc, the format E kernel's form, must equal q3_codes4_raw in all 32 bits)
// against quant_code of the f32 path for every bf16 x in each of the 4 positions (the other positions shifted permutations)
// and every k in [-126, 119]; also the squares of the norm's FMA path: x^2 exact in f32 for
// every finite bf16 x with |x| >= 2^-64 (norm_div_x_ok), so fma(x, x, p) = RN(p + RN(x^2)).
static long check_q3_codes4() {
    constexpr Quant Q = Quant::Fp4Ue8m0B32;
    long bad = 0, n = 0;
    auto perm = [](uint32_t v) { return (v * 40503u + 12345u) & 0xffffu; };
    for (int k = -126; q3_pair_ok(k); ++k, ++n) {
        const BlockScale b = pow2_scale(k);
        const Q3Pair p = q3_pair(k);
        static uint8_t want[65536];
        for (uint32_t xb = 0; xb < 65536; ++xb) want[xb] = quant_code<Q>(bf16_bits_to_f32(xb), b);
        for (uint32_t lo = 0; lo < 65536; ++lo) {
            const uint32_t xs[4] = {lo, perm(lo), perm(perm(lo)), perm(perm(perm(lo)))};
            for (int r = 0; r < 4; ++r) {  // x = lo in position r
                uint32_t v[4];
                for (int i = 0; i < 4; ++i) v[i] = xs[(i + 4 - r) % 4];
                const uint32_t raw = q3_codes4_raw(v[0] | (v[1] << 16), v[2] | (v[3] << 16), p);
                const uint32_t got = q3_codes4(v[0] | (v[1] << 16), v[2] | (v[3] << 16), p);
                if ((raw & 0xffffu) != got) ++bad;
                const uint32_t rk = q3_codes4_raw_kc(v[0] | (v[1] << 16), v[2] | (v[3] << 16), p, q3_codes4_kc(p));
                if (rk != raw) {  // the integer-step form: the same 32 bits
                    if (bad < 5) printf("Q3 codes4 kc form: k=%d x=%04x %04x %04x %04x: %08x vs %08x\n", k, v[0], v[1], v[2], v[3], rk, raw);
                    ++bad;
                }
                uint32_t w = 0;
                for (int i = 0; i < 4; ++i) w |= static_cast<uint32_t>(want[v[i]]) << (4 * i);
                if (got != w) {
                    if (bad < 5) printf("Q3 codes4: k=%d x=%04x %04x %04x %04x: %04x vs %04x\n", k, v[0], v[1], v[2], v[3], got, w);
                    ++bad;
                }
            }
        }
    }
    long sq = 0;
    for (uint32_t xb = 0; xb < 65536; ++xb) {
        const float x = bf16_bits_to_f32(xb);
        if (!isfinite(x) || !norm_div_x_ok(fabsf(x))) continue;
        const float q = mul_rn(x, x);
        const double e = static_cast<double>(x) * static_cast<double>(x);
        if (isfinite(q) ? static_cast<double>(q) != e : e < 3.4028234663852886e38) {
            if (sq < 5) printf("square of bf16 %a not exact: %a\n", x, q);
            ++sq;
        }
    }
    printf("Q3 codes4: %ld scales x 65536 x 4 positions: %ld mismatches; inexact bf16 squares: %ld\n", n, bad, sq);
    return bad + sq;
}

int main(int argc, char** argv) {
    if (argc > 1) {  // one part only: "q3-pair" (~30 s) or "q2" (seconds)
        long b = -1;
        if (strcmp(argv[1], "q3-pair") == 0) b = check_q3_pair();
        if (strcmp(argv[1], "q2") == 0) b = check_q2();
        if (strcmp(argv[1], "q2-pair") == 0) b = check_q2_pair() + check_q2_scale_hw();
        if (strcmp(argv[1], "q3-row128") == 0) b = check_q3_scale_bits2() + check_q3_codes4();
        if (b < 0) {
            printf("unknown part %s (q3-pair, q2, q2-pair, q3-row128)\n", argv[1]);
            return 2;
        }
        printf("%s\n", b == 0 ? "all equal" : "MISMATCHES");
        return b == 0 ? 0 : 1;
    }
    long bad = check_scale_fn<Quant::Fp8Ue8m0B32>("Q1");
    bad += check_scale_fn<Quant::Fp4E4m3B16>("Q2");
    bad += check_scale_fn<Quant::Fp4Ue8m0B32>("Q3");
    bad += check_norm_div(0, 0, true);
    const int ends[][2] = {{-64, 59}, {-64, -60}, {63, -60}, {63, 59}, {-20, 33}};
    for (const auto& e : ends) bad += check_norm_div(e[0], e[1], false);
    bad += check_pow2<Quant::Fp8Ue8m0B32>(-22, "Q1 fp8 ue8m0 b32");
    bad += check_q2();
    bad += check_pow2<Quant::Fp4Ue8m0B32>(-126, "Q3 fp4 ue8m0 b32");
    bad += check_q3_pair();
    bad += check_q2_pair();
    bad += check_q2_scale_hw();
    bad += check_q3_scale_bits2();
    bad += check_q3_codes4();
    printf("%s\n", bad == 0 ? "all equal" : "MISMATCHES");
    return bad == 0 ? 0 : 1;
}
