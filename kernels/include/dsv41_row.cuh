// The per-row pipeline shared by the insert kernels and the query RoPE kernel:
//
//   load bf16 row -> [RMSNorm, f32, then bf16] -> GPT-J RoPE of the last R dims (f32, then bf16)
//   -> [QAT fake quant per block, exact in bf16] -> store bf16 row (or packed codes + scales)
//
// Thread mapping: one warp per row of D = 64..512 elements; lane L holds the D/32 contiguous
// elements [L*D/32, (L+1)*D/32) in registers, loaded and stored with one to two 4/8/16-byte
// vector accesses, so a warp moves the row in fully coalesced transactions. A quant block of 16
// or 32 elements spans 1..16 consecutive lanes; its amax is a lane-local max followed by xor
// shuffles within the block. RoPE pairs (2i, 2i+1) never straddle lanes (D/32 and D-R are even).
//
// Insert kernels (warp_rows): each warp owns ROWS consecutive tokens and issues ALL their loads
// (row vectors, cos/sin, slot) before the first row's arithmetic, so that ROWS rows per warp are
// in flight; then it finishes the rows one by one. For R <= 64 the token's R/2 cos and sin
// values are loaded one per lane (coalesced) and the rotated dims go through shared memory so
// that lane i rotates pair i; larger R read cos/sin from global memory in the arithmetic phase.
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

// The row kernels of q_rope: 4 warps per block, one row per warp.
constexpr int kWarpsPerBlock = 4;
constexpr int kThreadsPerBlock = 32 * kWarpsPerBlock;
// The insert kernels (warp_rows): 8 warps per block, ROWS rows per warp.
constexpr int kInsertWarps = 8;
constexpr int kInsertThreads = 32 * kInsertWarps;
constexpr unsigned kFullMask = 0xffffffffu;

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

// x[k] = RN(x[k] / r) (IEEE division) for a lane's elements and its row's norm divisor r: with
// one reciprocal per row and three operations per element when r and the lane's smallest |x|
// are in the range where that is exact (dsv41_numerics.cuh, `div_by_rcp`), else __fdiv_rn.
template <int N>
__device__ __forceinline__ void norm_divide(float (&x)[N], float r) {
    float mn = fabsf(x[0]);
#pragma unroll
    for (int k = 1; k < N; ++k) mn = fminf(mn, fabsf(x[k]));
    if (norm_div_row_ok(r) && norm_div_x_ok(mn)) {
        const float y = __frcp_rn(r);
#pragma unroll
        for (int k = 0; k < N; ++k) x[k] = div_by_rcp(x[k], r, y);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) x[k] = __fdiv_rn(x[k], r);
    }
}

// RMSNorm of the warp's row as candle computes `x / sqrt(mean(x^2) + eps) [* w]` in f32 on the
// CPU, then rounded to bf16: squares are staged in `smem` (D floats per warp) so that lane L can
// accumulate elements L, L+32, L+64, ... sequentially, then the warp combines the 32 partial
// sums in candle's AVX2 order.
// `weight(k)` returns the weight of this lane's element k (only called for Norm::Weighted).
template <int D, Norm N, class W>
__device__ __forceinline__ void rms_norm_row(float (&x)[D / 32], int lane, float* smem, W&& weight, float eps,
                                             float inv_dim) {
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
    norm_divide(x, r);
#pragma unroll
    for (int k = 0; k < EPL; ++k) {
        float y = x[k];
        if constexpr (N == Norm::Weighted) y = __fmul_rn(y, weight(k));
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
__device__ __forceinline__ BlockScale block_scale(const float (&x)[D / 32]) {
    constexpr int EPL = D / 32;
    constexpr int B = QuantTraits<Q>::kBlock;
    static_assert(B % EPL == 0, "a quant block must cover whole lanes");
    constexpr int LPB = B / EPL;  // lanes per block: 1..16, a power of two
    float amax = 0.0f;  // fmaxf ignores NaN, like the CPU's f32::max fold
#pragma unroll
    for (int k = 0; k < EPL; ++k) amax = fmaxf(amax, fabsf(x[k]));
#pragma unroll
    for (int off = 1; off < LPB; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
    return QuantTraits<Q>::scale(amax);
}

// Fake quant of the warp's row, block by block (spec §2.3): rewrites x with the dequantized
// values (exact in bf16).
template <int D, Quant Q>
__device__ __forceinline__ void fake_quant_row(float (&x)[D / 32]) {
    const BlockScale b = block_scale<D, Q>(x);
#pragma unroll
    for (int k = 0; k < D / 32; ++k) x[k] = fake_quant_element<Q>(x[k], b);
}

// --------------------------------------------------------------------- insert row scheduling

// Global loads through the read-only (non-coherent) path: the inputs are never written during a
// launch (candle refuses a source sharing the cache's storage).
__device__ __forceinline__ void ld_nc(uint32_t& v, const void* p) {
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
}
__device__ __forceinline__ void ld_nc(uint2& v, const void* p) {
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
}
__device__ __forceinline__ void ld_nc(uint4& v, const void* p) {
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
}
__device__ __forceinline__ float ld_nc_f32(const float* p) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float2 ld_nc_f32x2(const float* p) {
    float2 v;
    asm volatile("ld.global.nc.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ int64_t ld_nc_s64(const int64_t* p) {
    int64_t v;
    asm volatile("ld.global.nc.s64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

// One token's inputs in this lane's registers, as loaded (before any arithmetic).
template <int D> struct RowIn {
    static constexpr int kEpl = D / 32;
    static constexpr int kChunk = kEpl < 8 ? kEpl : 8;
    using V = typename VecOf<kChunk>::T;
    V raw[kEpl / kChunk];  // the lane's kEpl bf16 elements
    float cos, sin;        // R <= 64: cos/sin of pair `lane` of the token (0 past R/2)
    int64_t slot;          // destination row / slot, or -1: nothing to write
    int64_t t;             // the token (clamped into [0, T) for the loads)
};

// Issues this lane's loads of token t's row and cos/sin (t >= T: clamped), not the slot.
template <int D, class P>
__device__ __forceinline__ void load_row_data(const P& p, int64_t t, int lane, RowIn<D>& r) {
    constexpr int EPL = D / 32;
    constexpr int C = RowIn<D>::kChunk;
    r.t = t < p.num_tokens ? t : p.num_tokens - 1;
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.src) + r.t * p.src_row_stride + lane * EPL;
#pragma unroll
    for (int c = 0; c < EPL / C; ++c) ld_nc(r.raw[c], src + c * C);
    const int half = p.rope_dim >> 1;
    r.cos = 0.0f;
    r.sin = 0.0f;
    if (half <= 32 && lane < half) {
        r.cos = ld_nc_f32(p.cos + r.t * half + lane);
        r.sin = ld_nc_f32(p.sin + r.t * half + lane);
    }
}

// Issues this lane's loads of token t (t >= T: a clamped, discarded row with slot -1). `P` is
// Dsv41RowInsertParams or Dsv41PackedInsertParams.
template <int D, class P>
__device__ __forceinline__ void load_row(const P& p, int64_t t, int lane, RowIn<D>& r) {
    load_row_data<D>(p, t, lane, r);
    const int64_t slot = ld_nc_s64(p.slots + r.t);
    r.slot = t < p.num_tokens && slot >= 0 && slot < p.num_slots ? slot : -1;
}

// The lane's elements of a loaded row as f32.
template <int D>
__device__ __forceinline__ void unpack_row(const RowIn<D>& r, float (&x)[D / 32]) {
    constexpr int C = RowIn<D>::kChunk;
#pragma unroll
    for (int c = 0; c < D / 32 / C; ++c) {
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r.raw[c]);
#pragma unroll
        for (int k = 0; k < C / 2; ++k) {
            const float2 f = __bfloat1622float2(h[k]);
            x[c * C + 2 * k] = f.x;
            x[c * C + 2 * k + 1] = f.y;
        }
    }
}

// Copies this lane's elements in the rotated dims [first, D) to or from buf[e - first]:
// vector accesses when the lane lies entirely in them at an aligned offset, else per element.
template <int D, bool kToBuf>
__device__ __forceinline__ void stage_rope_dims(float (&x)[D / 32], int lane, int first, float* buf) {
    constexpr int EPL = D / 32;
    constexpr int VW = EPL < 4 ? EPL : 4;
    using FV = typename std::conditional<VW == 4, float4, float2>::type;
    const int e0 = lane * EPL;
    if (e0 + EPL <= first) return;
    if (e0 >= first && (first % VW) == 0) {
        FV* b = reinterpret_cast<FV*>(buf + (e0 - first));
#pragma unroll
        for (int v = 0; v < EPL / VW; ++v) {
            if constexpr (kToBuf) b[v] = *reinterpret_cast<const FV*>(&x[v * VW]);
            else *reinterpret_cast<FV*>(&x[v * VW]) = b[v];
        }
    } else {
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
            if (e0 + k >= first) {
                if constexpr (kToBuf) buf[e0 + k - first] = x[k];
                else x[k] = buf[e0 + k - first];
            }
        }
    }
}

// GPT-J RoPE of dims [D-R, D) of a loaded row (rounded to bf16). R <= 64: the rotated dims go
// through `buf` (R floats of this warp's shared memory) so that lane i rotates pair i with the
// cos/sin it loaded (every lane works, instead of the few holding the tail dims); larger R read
// cos/sin from global memory in the lanes holding the dims.
template <int D, class P>
__device__ __forceinline__ void rope_loaded_row(const P& p, const RowIn<D>& r, int lane, float (&x)[D / 32],
                                                float* buf) {
    const int half = p.rope_dim >> 1;
    if (half > 32) {
        rope_row<D>(x, lane, p.rope_dim, p.cos + r.t * half, p.sin + r.t * half);
        return;
    }
    const int first = D - p.rope_dim;
    stage_rope_dims<D, true>(x, lane, first, buf);
    __syncwarp();
    if (lane < half) {
        float2 v = reinterpret_cast<float2*>(buf)[lane];
        rotate_pair(v.x, v.y, r.cos, r.sin);
        v.x = round_bf16(v.x);
        v.y = round_bf16(v.y);
        reinterpret_cast<float2*>(buf)[lane] = v;
    }
    __syncwarp();
    stage_rope_dims<D, false>(x, lane, first, buf);
    __syncwarp();  // buf is reused by the warp's next row
}

// The insert kernels' body: the warp's ROWS tokens are loaded first, then `finish(row, x)` runs
// for each of them, with x = the row after [norm] and RoPE (f32 holding bf16 values); `finish`
// stores only when row.slot >= 0. Rows without a destination (padding, t >= T) are computed
// anyway: branching around them lets the compiler sink every row load below the slot test,
// which serializes the slot load and the row load. `smem`: D floats of this warp (only used
// when N != Norm::None).
template <int D, int ROWS, Norm N, class P, class F>
__device__ __forceinline__ void warp_rows(const P& p, float* smem, F&& finish) {
    __shared__ __align__(16) float rope_buf[kInsertWarps][64];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x / 32;
    const int64_t t0 = (static_cast<int64_t>(blockIdx.x) * kInsertWarps + warp) * ROWS;
    if (t0 >= p.num_tokens) return;
    RowIn<D> in[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) load_row<D>(p, t0 + r, lane, in[r]);
    float w[N == Norm::Weighted ? D / 32 : 1];  // the lane's norm weights, loaded once per warp
    if constexpr (N == Norm::Weighted) {
#pragma unroll
        for (int k = 0; k < D / 32; ++k) w[k] = ld_nc_f32(p.norm_weight + lane * (D / 32) + k);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float x[D / 32];
        unpack_row<D>(in[r], x);
        if constexpr (N != Norm::None)
            rms_norm_row<D, N>(x, lane, smem, [&](int k) { return w[k]; }, p.norm_eps, p.norm_inv_dim);
        rope_loaded_row<D>(p, in[r], lane, x, rope_buf[warp]);
        finish(in[r], x);
    }
}

// Rows per warp of the insert kernels, as measured on the H200 (bench_insert): one
// 512-wide row per warp keeps the most warps resident, which is what the compute-heavier calls
// need (the packed formats, grids of a few waves); a second row per warp pays off only for
// memory-bound bf16 inserts of at least 65536 rows. 128-wide rows: 2 per warp; 64-wide: 4.
template <int D, typename F> int with_insert_rows(int64_t rows, bool memory_bound, F&& f) {
    if constexpr (D >= 256) {
        if (memory_bound && rows >= 65536) return f(std::integral_constant<int, 2>{});
        return f(std::integral_constant<int, 1>{});
    } else {
        return f(std::integral_constant<int, D == 128 ? 2 : 4>{});
    }
}

inline unsigned insert_blocks(int64_t rows, int rows_per_warp) {
    const int64_t per_block = static_cast<int64_t>(kInsertWarps) * rows_per_warp;
    return static_cast<unsigned>((rows + per_block - 1) / per_block);
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
