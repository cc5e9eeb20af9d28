// Runs every kernel of kernels/*.cu in the host simulator (sim.h) on random data and compares
// the results bit for bit with an independent scalar reference written from the Rust CPU code:
// e4m3 / e2m1 rounding by brute force over the code tables, log2 through frexp, RMSNorm in the
// summation order of candle's AVX2 CPU sum, GPT-J RoPE with separate roundings. Driven by
// tools/kernel_hostsim/run.sh.
#include "sim.h"
#include "window_insert.inc"
#include "compressed_insert.inc"
#include "index_key_insert.inc"
#include "q_rope.inc"
#include "packed_insert.inc"
#include <cstdio>
#include <random>
#include <algorithm>
#include <map>

using bf16 = __nv_bfloat16;
static int failures = 0;
#define CHECK(c, ...) do { if (!(c)) { ++failures; printf("FAIL: " __VA_ARGS__); printf("\n"); } } while (0)

// ------------------------------------------------------------------ independent reference
static float bfr(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
static float mul(float a, float b) { volatile float r = a * b; return r; }
static float add(float a, float b) { volatile float r = a + b; return r; }
static float sub(float a, float b) { volatile float r = a - b; return r; }
static float dvd(float a, float b) { volatile float r = a / b; return r; }
static int ceil_log2_ref(float v) { int e; float m = std::frexp(v, &e); return m == 0.5f ? e - 1 : e; }
static float e4m3_decode(int b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    float mag = e == 0 ? std::ldexp((float)m / 8, -6) : std::ldexp(1 + (float)m / 8, e - 7);
    return s ? -mag : mag;
}
static float round_e4m3_ref(float x) {  // nearest e4m3 magnitude, ties to even code, saturate
    if (std::isnan(x)) return x;
    float a = std::fabs(x);
    int best = 0; float bd = INFINITY;
    for (int c = 0; c < 127; ++c) {  // 0x00..0x7e
        float d = std::fabs(e4m3_decode(c) - a);
        if (d < bd || (d == bd && (c % 2 == 0))) { bd = d; best = c; }
    }
    return std::copysign(e4m3_decode(best), x);
}
static const float E2[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
static int e2m1_mag_ref(float a) {
    int best = 0; float bd = INFINITY;
    for (int c = 0; c < 8; ++c) { float d = std::fabs(E2[c] - a); if (d < bd || (d == bd && c % 2 == 0)) { bd = d; best = c; } }
    if (std::isnan(a)) best = 7;
    return best;
}
static float round_e2m1_ref(float x) { float m = E2[e2m1_mag_ref(std::fabs(x))]; return std::signbit(x) ? -m : m; }
static int e4m3_code_ref(float x) {
    int sign = std::signbit(x) ? 0x80 : 0;
    float r = std::fabs(round_e4m3_ref(x));
    for (int c = 0; c < 127; ++c) if (e4m3_decode(c) == r) return sign | c;
    return -1;
}
enum Q { NONE = 0, Q1 = 1, Q2 = 2, Q3 = 3 };
static int blk(int q) { return q == Q2 ? 16 : 32; }
static float scale_ref(int q, float amax) {
    if (q == Q1) return std::ldexp(1.0f, ceil_log2_ref(dvd(std::max(amax, 1e-4f), 448.f)));
    if (q == Q2) return std::min(round_e4m3_ref(dvd(std::max(amax, std::ldexp(6.0f, -9)), 6.f)), 448.f);
    return std::ldexp(1.0f, ceil_log2_ref(dvd(std::max(amax, std::ldexp(6.0f, -126)), 6.f)));
}
static float elem_ref(int q, float y) {
    float m = q == Q1 ? 448.f : 6.f;
    y = y > m ? m : (y < -m ? -m : y);
    return q == Q1 ? round_e4m3_ref(y) : round_e2m1_ref(y);
}
// RMSNorm as candle's CPU (AVX2 vec_sum order), weight optional; returns bf16-rounded values.
static void norm_ref(std::vector<float>& x, const float* w, float eps) {
    int D = x.size();
    float acc[4][8] = {};
    for (int i = 0; i < D; i += 32)
        for (int j = 0; j < 4; ++j)
            for (int l = 0; l < 8; ++l) acc[j][l] = add(acc[j][l], mul(x[i + 8 * j + l], x[i + 8 * j + l]));
    float x0[8], t0[4];
    for (int l = 0; l < 8; ++l) x0[l] = add(add(acc[0][l], acc[1][l]), add(acc[2][l], acc[3][l]));
    for (int k = 0; k < 4; ++k) t0[k] = add(x0[k], x0[k + 4]);
    float sum = add(add(t0[0], t0[1]), add(t0[2], t0[3]));
    float ms = add(mul(sum, (float)(1.0 / D)), 0.0f);
    float r = std::sqrt(add(mul(ms, 1.0f), eps));
    for (int i = 0; i < D; ++i) { float y = dvd(x[i], r); if (w) y = mul(y, w[i]); x[i] = bfr(y); }
}
static void rope_ref(std::vector<float>& x, int R, const float* c, const float* s) {
    int first = x.size() - R;
    for (int i = 0; i < R / 2; ++i) {
        float a = x[first + 2 * i], b = x[first + 2 * i + 1];
        x[first + 2 * i] = bfr(sub(mul(a, c[i]), mul(b, s[i])));
        x[first + 2 * i + 1] = bfr(add(mul(a, s[i]), mul(b, c[i])));
    }
}
static void fq_ref(std::vector<float>& x, int q) {
    int B = blk(q);
    for (size_t b = 0; b < x.size(); b += B) {
        float amax = 0; for (int i = 0; i < B; ++i) amax = std::fmax(amax, std::fabs(x[b + i]));
        float s = scale_ref(q, amax);
        for (int i = 0; i < B; ++i) x[b + i] = mul(elem_ref(q, dvd(x[b + i], s)), s);
    }
}
static void pack_ref(const std::vector<float>& x, int q, uint8_t* data, uint8_t* scales) {
    int B = blk(q);
    for (size_t b = 0; b < x.size(); b += B) {
        float amax = 0; for (int i = 0; i < B; ++i) amax = std::fmax(amax, std::fabs(x[b + i]));
        float s = scale_ref(q, amax);
        int sb = q == Q2 ? e4m3_code_ref(s) : ceil_log2_ref(s) + 127;
        scales[b / B] = (uint8_t)sb;
        for (int i = 0; i < B; ++i) {
            float m = q == Q1 ? 448.f : 6.f;
            float y = dvd(x[b + i], s); y = y > m ? m : (y < -m ? -m : y);
            size_t e = b + i;
            if (q == Q1) data[e] = (uint8_t)e4m3_code_ref(y);
            else { int code = (std::signbit(y) ? 8 : 0) | e2m1_mag_ref(std::fabs(y));
                   if (e % 2 == 0) data[e / 2] = code; else data[e / 2] |= code << 4; }
        }
    }
}

// ------------------------------------------------------------------ data
static std::mt19937 rng(1234);
static float rnd() { return std::normal_distribution<float>(0, 1.7f)(rng); }
static std::vector<bf16> rows(int n, int d) {
    std::vector<bf16> v(n * d);
    for (int i = 0; i < n * d; i += 16) { int e = (int)(rng() % 29) - 20; for (int k = 0; k < 16 && i + k < n * d; ++k) v[i + k] = __float2bfloat16_rn(rnd() * std::ldexp(1.0f, e)); }
    return v;
}
static void angles(int n, int R, std::vector<float>& c, std::vector<float>& s) {
    c.resize(n * R / 2); s.resize(n * R / 2);
    for (int i = 0; i < n * R / 2; ++i) { float a = (float)(rng() % 100000) * 0.37f; c[i] = std::cos(a); s[i] = std::sin(a); }
}
static uint16_t bits(bf16 b) { uint16_t u; memcpy(&u, &b, 2); return u; }

// ------------------------------------------------------------------ tests
template <int D, dsv41::Quant QQ, bool NORM>
static void test_insert(const char* name, int T, int S, int R, void (*kernel)(const Dsv41RowInsertParams)) {
    auto src = rows(T, D);
    std::vector<float> c, s; angles(T, R, c, s);
    std::vector<int64_t> slots(T);
    std::vector<int64_t> perm(S); for (int i = 0; i < S; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), rng);
    for (int t = 0; t < T; ++t) slots[t] = perm[t];
    if (T > 2) slots[1] = -1;
    if (T > 3) slots[2] = S + 5;
    std::vector<float> w(D); for (auto& x : w) x = 0.5f + (rng() % 1000) / 1000.f;
    std::vector<bf16> cache(S * D, __float2bfloat16_rn(NAN)), want = cache;
    Dsv41RowInsertParams p{};
    p.src = src.data(); p.cos = c.data(); p.sin = s.data(); p.slots = slots.data(); p.norm_weight = NORM ? w.data() : nullptr;
    p.cache = cache.data(); p.src_row_stride = D; p.cache_row_stride = D; p.num_slots = S; p.num_tokens = T; p.head_dim = D;
    p.rope_dim = R; p.quant = (int)QQ; p.apply_norm = NORM; p.norm_eps = 1e-20f; p.norm_inv_dim = (float)(1.0 / D);
    CHECK(dsv41::check_insert_params(&p, sizeof p) == 0, "%s params", name);
    sim_launch(dsv41::blocks_for_rows(T), 128, [&] { kernel(p); });
    for (int t = 0; t < T; ++t) {
        if (slots[t] < 0 || slots[t] >= S) continue;
        std::vector<float> x(D); for (int i = 0; i < D; ++i) x[i] = __bfloat162float(src[t * D + i]);
        if (NORM) norm_ref(x, w.data(), 1e-20f);
        rope_ref(x, R, &c[t * R / 2], &s[t * R / 2]);
        if ((int)QQ) fq_ref(x, (int)QQ);
        for (int i = 0; i < D; ++i) want[slots[t] * D + i] = __float2bfloat16_rn(x[i]);
    }
    int bad = 0;
    for (int i = 0; i < S * D; ++i) if (bits(cache[i]) != bits(want[i])) { if (bad < 5) printf("  %s [%d,%d] got %g want %g\n", name, i / D, i % D, __bfloat162float(cache[i]), __bfloat162float(want[i])); ++bad; }
    CHECK(bad == 0, "%s: %d mismatches", name, bad);
    printf("%s: %s\n", name, bad ? "FAIL" : "ok");
}

template <int D>
static void test_qrope(const char* name, int T, int H, int R, bool norm, bool inplace) {
    auto q = rows(T * H, D);
    std::vector<float> c, s; angles(T, R, c, s);
    std::vector<bf16> out = inplace ? q : std::vector<bf16>(T * H * D);
    Dsv41QRopeParams p{};
    p.q = inplace ? out.data() : q.data(); p.out = out.data(); p.cos = c.data(); p.sin = s.data();
    p.q_token_stride = H * D; p.q_head_stride = D; p.out_token_stride = H * D; p.out_head_stride = D;
    p.num_tokens = T; p.num_heads = H; p.head_dim = D; p.rope_dim = R; p.apply_norm = norm; p.norm_eps = 1e-6f; p.norm_inv_dim = (float)(1.0 / D);
    if (inplace && !norm) {
        int C = (R % 8 == 0 && (D - R) % 8 == 0) ? 8 : 2;
        long threads = (long)T * H * (R / C);
        unsigned grid = (threads + 127) / 128;
        if (C == 8) sim_launch(grid, 128, [&] { dsv41::q_rope_tail_kernel<8>(p); });
        else sim_launch(grid, 128, [&] { dsv41::q_rope_tail_kernel<2>(p); });
    } else if (norm) sim_launch(dsv41::blocks_for_rows(T * H), 128, [&] { dsv41::q_rope_row_kernel<D, true>(p); });
    else sim_launch(dsv41::blocks_for_rows(T * H), 128, [&] { dsv41::q_rope_row_kernel<D, false>(p); });
    int bad = 0;
    for (int t = 0; t < T; ++t) for (int h = 0; h < H; ++h) {
        std::vector<float> x(D); for (int i = 0; i < D; ++i) x[i] = __bfloat162float(q[(t * H + h) * D + i]);
        if (norm) norm_ref(x, nullptr, 1e-6f);
        rope_ref(x, R, &c[t * R / 2], &s[t * R / 2]);
        for (int i = 0; i < D; ++i) if (bits(out[(t * H + h) * D + i]) != bits(__float2bfloat16_rn(x[i]))) ++bad;
    }
    CHECK(bad == 0, "%s: %d mismatches", name, bad);
    printf("%s: %s\n", name, bad ? "FAIL" : "ok");
}

template <int D, dsv41::Quant QQ, bool NORM>
static void test_packed(const char* name, int T, int page, int pages, int R) {
    int q = (int)QQ, data = q == Q1 ? D : D / 2, sc = D / blk(q), pb = page * (data + sc);
    int S = page * pages;
    auto src = rows(T, D);
    std::vector<float> c, s; angles(T, R, c, s);
    std::vector<int64_t> perm(S); for (int i = 0; i < S; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int64_t> slots(perm.begin(), perm.begin() + T);
    if (T > 2) slots[1] = -1;
    std::vector<float> w(D); for (auto& x : w) x = 0.5f + (rng() % 1000) / 1000.f;
    std::vector<uint8_t> cache(pages * pb, 0xAB), want = cache;
    Dsv41PackedInsertParams p{};
    p.src = src.data(); p.cos = c.data(); p.sin = s.data(); p.slots = slots.data(); p.norm_weight = NORM ? w.data() : nullptr;
    p.cache = cache.data(); p.src_row_stride = D; p.page_stride = pb; p.num_slots = S; p.num_tokens = T; p.head_dim = D; p.rope_dim = R;
    p.quant = q; p.apply_norm = NORM; p.page_size = page; p.norm_eps = 1e-20f; p.norm_inv_dim = (float)(1.0 / D);
    sim_launch(dsv41::blocks_for_rows(T), 128, [&] { dsv41::packed_insert_kernel<D, QQ, NORM ? dsv41::Norm::Weighted : dsv41::Norm::None>(p); });
    for (int t = 0; t < T; ++t) {
        if (slots[t] < 0) continue;
        std::vector<float> x(D); for (int i = 0; i < D; ++i) x[i] = __bfloat162float(src[t * D + i]);
        if (NORM) norm_ref(x, w.data(), 1e-20f);
        rope_ref(x, R, &c[t * R / 2], &s[t * R / 2]);
        int pg = slots[t] / page, r = slots[t] % page;
        pack_ref(x, q, &want[pg * pb + r * data], &want[pg * pb + page * data + r * sc]);
    }
    int bad = 0;
    for (size_t i = 0; i < cache.size(); ++i) if (cache[i] != want[i]) { if (bad < 5) printf("  %s byte %zu got %02x want %02x\n", name, i, cache[i], want[i]); ++bad; }
    CHECK(bad == 0, "%s: %d mismatches", name, bad);
    printf("%s: %s\n", name, bad ? "FAIL" : "ok");
}

int main() {
    using dsv41::Quant;
    test_insert<512, Quant::Fp8Ue8m0B32, false>("window Q1 D512", 9, 12, 64, dsv41::window_insert_kernel<512, Quant::Fp8Ue8m0B32>);
    test_insert<512, Quant::None, false>("window none D512", 5, 8, 64, dsv41::window_insert_kernel<512, Quant::None>);
    test_insert<128, Quant::Fp8Ue8m0B32, false>("window Q1 D128", 6, 8, 64, dsv41::window_insert_kernel<128, Quant::Fp8Ue8m0B32>);
    test_insert<64, Quant::Fp8Ue8m0B32, false>("window Q1 D64 R32", 5, 6, 32, dsv41::window_insert_kernel<64, Quant::Fp8Ue8m0B32>);
    test_insert<256, Quant::Fp8Ue8m0B32, false>("window Q1 D256 R256", 4, 6, 256, dsv41::window_insert_kernel<256, Quant::Fp8Ue8m0B32>);
    test_insert<512, Quant::Fp4E4m3B16, false>("compressed Q2 D512", 9, 10, 64, dsv41::compressed_insert_kernel<512, Quant::Fp4E4m3B16>);
    test_insert<128, Quant::Fp4E4m3B16, false>("compressed Q2 D128", 5, 8, 64, dsv41::compressed_insert_kernel<128, Quant::Fp4E4m3B16>);
    test_insert<128, Quant::Fp4Ue8m0B32, true>("index Q3 D128", 9, 12, 64, dsv41::index_key_insert_kernel<128, Quant::Fp4Ue8m0B32>);
    test_insert<512, Quant::Fp4Ue8m0B32, true>("index Q3 D512", 5, 6, 64, dsv41::index_key_insert_kernel<512, Quant::Fp4Ue8m0B32>);
    test_insert<128, Quant::None, true>("index none D128", 5, 6, 64, dsv41::index_key_insert_kernel<128, Quant::None>);
    test_qrope<512>("q tail in place D512 H4", 3, 4, 64, false, true);
    test_qrope<64>("q tail2 in place D64 R6", 3, 4, 6, false, true);
    test_qrope<512>("q row out of place D512", 2, 4, 64, false, false);
    test_qrope<128>("q row norm in place D128", 3, 4, 64, true, true);
    test_qrope<512>("q row norm out of place D512", 2, 3, 64, true, false);
    test_packed<512, Quant::Fp8Ue8m0B32, false>("packed A D512", 9, 4, 3, 64);
    test_packed<512, Quant::Fp4E4m3B16, false>("packed B D512", 9, 4, 3, 64);
    test_packed<128, Quant::Fp4Ue8m0B32, true>("packed E D128", 9, 4, 3, 64);
    test_packed<64, Quant::Fp4E4m3B16, false>("packed B D64", 5, 8, 1, 32);
    printf("%s (%d failures)\n", failures ? "FAILED" : "ALL OK", failures);
    return failures != 0;
}
