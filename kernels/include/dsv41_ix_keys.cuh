// The key side of the indexer scores' bf16 tensor-core path (kernels/indexer_scores.cu): a lane's
// 32-dim slice of one key, fetched from bf16 rows or from a packed MXFP4 68 B row (format E,
// spec §7.2; data bytes + the row's scale word staged by the caller) and expanded into the 16
// bf16x2 B-fragment registers of an m16n8k16 product; the run-time page-size division used to
// find a packed row. The expansion is exact (e2m1 code x 2^(e-127) is a bf16 value for every
// scale byte but 255); the numerics are stated at KeySlice<DSV41_INDEX_KEYS_MXFP4>.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "dsv41_indexer.h"

namespace dsv41_ix {

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&a);
    __nv_bfloat162 y = *reinterpret_cast<__nv_bfloat162*>(&b);
    __nv_bfloat162 z = __hmul2(x, y);
    return *reinterpret_cast<uint32_t*>(&z);
}

// 2^(e-127) as bf16 bits (e = 0: the subnormal 2^-127; e = 255: NaN, as ue8m0 says).
__device__ __forceinline__ uint32_t ue8m0_bf16x2(uint32_t e) {
    const uint32_t b = e == 0 ? 0x0040u : (e == 255 ? 0x7FC0u : (e << 7));
    return b | (b << 16);
}

// n / d for 32-bit n and a run-time divisor d >= 2 (the page size) by multiply-high
// (round-up method): m = floor(2^32 (2^l - d) / d) + 1 with l = ceil(log2 d).
struct PageDiv {
    uint32_t m;
    int l;
    __device__ explicit PageDiv(uint32_t d) {
        l = 32 - __clz(d - 1);
        m = static_cast<uint32_t>(((1ull << 32) * ((1ull << l) - d)) / d + 1);
    }
    __device__ __forceinline__ uint32_t div(uint32_t n) const {
        const uint32_t t = __umulhi(m, n);
        return (t + ((n - t) >> 1)) >> (l - 1);
    }
};

// Raw bytes of one key slice of a lane and their expansion into the 16 bf16x2 B-fragment
// registers (dims [32c, 32c+32) of the lane's key).
template <int KF>
struct KeySlice;

// bf16 rows: 4 x 16 B.
template <>
struct KeySlice<DSV41_INDEX_KEYS_BF16> {
    uint4 v[4];
    __device__ __forceinline__ void fetch(const Dsv41IndexerScoresParams& p, const PageDiv&, int64_t row, int c) {
        const uint4* src = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.keys) +
                                                          row * p.key_row_stride + 32 * c);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = __ldg(src + i);
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ bool wide_scale(int) const { return false; }
    template <bool WIDE>
    __device__ __forceinline__ void expand(int, uint32_t (&k)[16]) const {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            k[4 * i + 0] = v[i].x;
            k[4 * i + 1] = v[i].y;
            k[4 * i + 2] = v[i].z;
            k[4 * i + 3] = v[i].w;
        }
    }
};

// Packed rows: the 16 data bytes of block c and the row's 4 scale bytes (staged in shared
// memory). Register 4i + p = dims (8i + p, 8i + p + 4) of the slice (nibbles p and p + 4 of word
// i) as bf16 bits code * 2^-126: the two nibbles (alone in x) are copied by one multiply to bits
// a..a+3 and a+6..a+9 (low half; +16 for the high one) with a = 6 - 4p (nibbles 2, 3: from
// w >> 8, a = 14 - 4p), and the mask keeps the magnitude at 6..8 and the sign at 15 (code 0.5 =
// the subnormal 2^-127). Then times 2^(e-1): one exact multiply for e <= 128, else
// (x * 2^126) * 2^(e-127); WIDE = false promises e <= 128 (the warp checked, so that the common
// case has no branch).
template <>
struct KeySlice<DSV41_INDEX_KEYS_MXFP4> {
    uint4 d;
    uint32_t s4;
    __device__ __forceinline__ uint32_t scale_byte(int c) const { return __byte_perm(s4, 0u, 0x4440u + c); }
    __device__ __forceinline__ bool wide_scale(int c) const { return scale_byte(c) > 128u; }
    // The first multiplier of block c (bf16x2 2^(e-1), or 2^126 when e > 128) and the second
    // (1, or 2^(e-127) when e > 128).
    __device__ __forceinline__ void scales(int c, uint32_t& sc, uint32_t& sc2) const {
        const uint32_t e = scale_byte(c);
        const bool one = e <= 128u;
        const uint32_t sb = one ? (e + 126u) << 7 : 0x7E80u;
        sc = sb * 0x10001u;
        sc2 = one ? 0x3F803F80u : ue8m0_bf16x2(e);
    }
    // The same when the warp checked that e <= 128 (WIDE = false): sc = 2^(e-1) without a select.
    template <bool WIDE>
    __device__ __forceinline__ void scales_for(int c, uint32_t& sc, uint32_t& sc2) const {
        if constexpr (WIDE) {
            scales(c, sc, sc2);
        } else {
            sc = scale_byte(c) * 0x00800080u + 0x3F003F00u;  // ((e + 126) << 7) in both halves
            sc2 = 0x3F803F80u;
        }
    }
    // k-step s (0..7): registers 2s, 2s + 1 of the order above.
    template <bool WIDE>
    __device__ __forceinline__ void step(int s, uint32_t sc, uint32_t sc2, uint32_t& k0, uint32_t& k1) const {
        const uint32_t w[4] = {d.x, d.y, d.z, d.w};
        const uint32_t x = (s & 1) ? (w[s / 2] >> 8) : w[s / 2];
        constexpr uint32_t M = 0x81C081C0u;
        k0 = bf16x2_mul(((x & 0x000F000Fu) * 0x1040u) & M, sc);
        k1 = bf16x2_mul(((x & 0x00F000F0u) * 0x0104u) & M, sc);
        if (WIDE) {
            k0 = bf16x2_mul(k0, sc2);
            k1 = bf16x2_mul(k1, sc2);
        }
    }
    template <bool WIDE>
    __device__ __forceinline__ void expand(int c, uint32_t (&k)[16]) const {
        uint32_t sc, sc2;
        scales_for<WIDE>(c, sc, sc2);
#pragma unroll
        for (int s = 0; s < 8; ++s) step<WIDE>(s, sc, sc2, k[2 * s], k[2 * s + 1]);
    }
};

}  // namespace dsv41_ix
