// The per-row pipeline shared by the insert kernels and the query RoPE kernel:
//
//   load bf16 row -> [RMSNorm, f32, then bf16] -> GPT-J RoPE of the last R dims (f32, then bf16)
//   -> [QAT fake quant per block, exact in bf16] -> store bf16 row
//
// Thread mapping: one warp per row of D = 64..512 elements; lane L holds the D/32 contiguous
// elements [L*D/32, (L+1)*D/32) in registers, loaded and stored with one to two 4/8/16-byte
// vector accesses, so a warp moves the row in fully coalesced transactions. A quant block of 16
// or 32 elements spans 1..16 consecutive lanes; its amax is a lane-local max followed by xor
// shuffles within the block. RoPE pairs (2i, 2i+1) never straddle lanes (D/32 and D-R are even).
//
// Numerics mirror the CPU composition the crate uses as reference (see dsv41_numerics.cuh):
// every intermediate that the CPU rounds to bf16 (norm output, RoPE output) is rounded to bf16
// here too, and fake quant works on those bf16 values.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>

#include "dsv41_numerics.cuh"
#include "dsv41_params.h"

namespace dsv41 {

constexpr int kWarpsPerBlock = 4;
constexpr int kThreadsPerBlock = 32 * kWarpsPerBlock;

template <int D> struct RowShape {
    static_assert(D == 64 || D == 128 || D == 256 || D == 512, "head_dim must be 64, 128, 256 or 512");
    static constexpr int kEpl = D / 32;                       // elements per lane: 2, 4, 8, 16
    static constexpr int kChunk = kEpl < 8 ? kEpl : 8;        // elements per vector access
    static constexpr int kAlignBytes = 2 * kChunk;            // required row alignment
};

template <int N> struct VecOf;
template <> struct VecOf<2> { using T = uint32_t; };
template <> struct VecOf<4> { using T = uint2; };
template <> struct VecOf<8> { using T = uint4; };

// x[0..EPL) = row[0..EPL) as f32 (EPL bf16 at a 2*min(EPL,8)-byte aligned address).
template <int EPL>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* row, float (&x)[EPL]) {
    constexpr int C = EPL < 8 ? EPL : 8;
    using V = typename VecOf<C>::T;
#pragma unroll
    for (int c = 0; c < EPL; c += C) {
        const V v = *reinterpret_cast<const V*>(row + c);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int k = 0; k < C / 2; ++k) {
            const float2 f = __bfloat1622float2(h[k]);
            x[c + 2 * k] = f.x;
            x[c + 2 * k + 1] = f.y;
        }
    }
}

// row[0..EPL) = bf16(x[0..EPL)) (round to nearest even; exact when x is already bf16).
template <int EPL>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* row, const float (&x)[EPL]) {
    constexpr int C = EPL < 8 ? EPL : 8;
    using V = typename VecOf<C>::T;
#pragma unroll
    for (int c = 0; c < EPL; c += C) {
        V v;
        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
        for (int k = 0; k < C / 2; ++k) h[k] = __floats2bfloat162_rn(x[c + 2 * k], x[c + 2 * k + 1]);
        *reinterpret_cast<V*>(row + c) = v;
    }
}

enum class Norm { None, Weightless, Weighted };

// RMSNorm of the warp's row as candle computes `x / sqrt(mean(x^2) + eps) [* w]` in f32 on the
// CPU, then rounded to bf16: squares are staged in `smem` (D floats per warp) so that lane L can
// accumulate elements L, L+32, L+64, ... sequentially, then the warp combines the 32 partial
// sums in candle's AVX2 order.
template <int D, Norm N>
__device__ __forceinline__ void rms_norm_row(float (&x)[D / 32], int lane, float* smem, const float* weight,
                                             float eps, float inv_dim) {
    constexpr int EPL = D / 32;
#pragma unroll
    for (int k = 0; k < EPL; ++k) smem[lane * EPL + k] = __fmul_rn(x[k], x[k]);
    __syncwarp();
    float p = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; ++k) p = __fadd_rn(p, smem[32 * k + lane]);
    __syncwarp();  // smem is reused by the warp's next row
    const float sum = warp_sum_candle_avx_order(p);
    // mean_keepdim = affine(sum, 1/D, 0); `+ eps` = affine(ms, 1, eps); then sqrt.
    const float ms = __fadd_rn(__fmul_rn(sum, inv_dim), 0.0f);
    const float r = __fsqrt_rn(__fadd_rn(__fmul_rn(ms, 1.0f), eps));
#pragma unroll
    for (int k = 0; k < EPL; ++k) {
        float y = __fdiv_rn(x[k], r);
        if constexpr (N == Norm::Weighted) y = __fmul_rn(y, weight[lane * EPL + k]);
        x[k] = round_bf16(y);
    }
}

// GPT-J RoPE of dims [D-R, D) of the warp's row with this token's cos/sin ([R/2] f32 each),
// rounded to bf16.
template <int D>
__device__ __forceinline__ void rope_row(float (&x)[D / 32], int lane, int rope_dim, const float* cos_t,
                                         const float* sin_t) {
    constexpr int EPL = D / 32;
    const int first = D - rope_dim;
#pragma unroll
    for (int k = 0; k < EPL; k += 2) {
        const int e = lane * EPL + k;
        if (e >= first) {
            const int i = (e - first) >> 1;
            rotate_pair(x[k], x[k + 1], cos_t[i], sin_t[i]);
            x[k] = round_bf16(x[k]);
            x[k + 1] = round_bf16(x[k + 1]);
        }
    }
}

// The scale of the quant block holding this lane's elements (spec §2.3): lane-local amax, then
// an xor-shuffle max over the block's consecutive lanes, then the format's scale rule.
template <int D, Quant Q>
__device__ __forceinline__ float block_scale(const float (&x)[D / 32]) {
    constexpr int EPL = D / 32;
    constexpr int B = QuantTraits<Q>::kBlock;
    static_assert(B % EPL == 0, "a quant block must cover whole lanes");
    constexpr int LPB = B / EPL;  // lanes per block: 1..16, a power of two
    float amax = 0.0f;  // fmaxf ignores NaN, like the CPU's f32::max fold
#pragma unroll
    for (int k = 0; k < EPL; ++k) amax = fmaxf(amax, fabsf(x[k]));
#pragma unroll
    for (int off = 1; off < LPB; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    return QuantTraits<Q>::scale(amax);
}

// Fake quant of the warp's row, block by block (spec §2.3): rewrites x with the dequantized
// values (exact in bf16).
template <int D, Quant Q>
__device__ __forceinline__ void fake_quant_row(float (&x)[D / 32]) {
    const float s = block_scale<D, Q>(x);
#pragma unroll
    for (int k = 0; k < D / 32; ++k) x[k] = fake_quant_element<Q>(x[k], s);
}

// The insert pipeline for the warp's token `t` (the whole warp calls it; warp-uniform exits).
template <int D, Quant Q, Norm N>
__device__ __forceinline__ void insert_row(const Dsv41RowInsertParams& p, int t, int lane, float* smem) {
    const int64_t slot = p.slots[t];
    if (slot < 0 || slot >= p.num_slots) return;  // skipped token (padding / outside the cache)
    float x[D / 32];
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.src) + t * p.src_row_stride;
    load_bf16<D / 32>(src + lane * (D / 32), x);
    if constexpr (N != Norm::None) rms_norm_row<D, N>(x, lane, smem, p.norm_weight, p.norm_eps, p.norm_inv_dim);
    const int64_t half = p.rope_dim / 2;
    rope_row<D>(x, lane, p.rope_dim, p.cos + t * half, p.sin + t * half);
    if constexpr (Q != Quant::None) fake_quant_row<D, Q>(x);
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.cache) + slot * p.cache_row_stride;
    store_bf16<D / 32>(dst + lane * (D / 32), x);
}

// ---------------------------------------------------------------------------------------------
// Host-side helpers shared by the launchers.

// Calls f(std::integral_constant<int, D>) for the supported head dims.
template <typename F> int with_head_dim(int d, F&& f) {
    switch (d) {
        case 64: return f(std::integral_constant<int, 64>{});
        case 128: return f(std::integral_constant<int, 128>{});
        case 256: return f(std::integral_constant<int, 256>{});
        case 512: return f(std::integral_constant<int, 512>{});
        default: return DSV41_ERR_HEAD_DIM;
    }
}

inline bool aligned_rows(const void* base, int64_t stride_elems, int align_bytes) {
    return reinterpret_cast<uintptr_t>(base) % align_bytes == 0 && (stride_elems * 2) % align_bytes == 0;
}

// Checks shared by the three insert launchers; returns DSV41_OK or an error code.
inline int check_insert_params(const Dsv41RowInsertParams* p, size_t params_size) {
    if (params_size != sizeof(Dsv41RowInsertParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_tokens < 0 || p->num_slots < 0) return DSV41_ERR_SHAPE;
    const int d = p->head_dim;
    if (d != 64 && d != 128 && d != 256 && d != 512) return DSV41_ERR_HEAD_DIM;
    if (p->rope_dim <= 0 || p->rope_dim % 2 != 0 || p->rope_dim > d) return DSV41_ERR_ROPE_DIM;
    if (p->num_tokens == 0) return DSV41_OK;
    if (!p->src || !p->cos || !p->sin || !p->slots || !p->cache) return DSV41_ERR_NULL;
    if (p->apply_norm && !p->norm_weight) return DSV41_ERR_NULL;
    if (p->src_row_stride < d || p->cache_row_stride < d) return DSV41_ERR_SHAPE;
    const int align = 2 * (d / 32 < 8 ? d / 32 : 8);
    if (!aligned_rows(p->src, p->src_row_stride, align) || !aligned_rows(p->cache, p->cache_row_stride, align))
        return DSV41_ERR_ALIGNMENT;
    return DSV41_OK;
}

inline unsigned blocks_for_rows(int64_t rows) {
    return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace dsv41
