// packed_insert: the three cache inserts (window, compressed, index keys) into the PACKED cache
// formats of spec §7.2 instead of bf16 rows: format A (window, 528 B per 512-wide row), B
// (compressed, 288 B) and E (MXFP4 index keys, 68 B per 128-wide row), in pages of `page_size`
// tokens with segregated data and scale regions (layout in dsv41_params.h).
//
//   [RMSNorm] -> RoPE -> quantize per block -> element codes + one scale byte per block
//
// The stored codes dequantize to exactly the values the bf16 inserts store (code * scale), so a
// packed cache holds the same numbers in 26% (A), 28% (B) or 27% (E) of the bytes.
//
// Design: the warp-per-row pipeline of dsv41_row.cuh up to RoPE; then each lane quantizes its
// D/32 contiguous elements with its block's scale (amax by xor shuffles across the block's
// lanes), writes its codes with one vector store (D/32 bytes of e4m3, or D/64 bytes of e2m1
// pairs, even element in the low nibble) and the first lane of each block writes the block's
// scale byte (ue8m0 = exponent + 127, or the e4m3 code of the Q2 scale).
//
// Numerics: identical to quant::packed::pack_row applied to the CPU reference rows (IEEE x/s,
// clamp, RNE to e4m3 / ties-to-even-code e2m1, the sign of zero kept in the code).
#include <string.h>

#include "include/dsv41_row.cuh"

namespace dsv41 {

template <int N> struct ByteVec;
template <> struct ByteVec<2> { using T = uint16_t; };
template <> struct ByteVec<4> { using T = uint32_t; };
template <> struct ByteVec<8> { using T = uint2; };
template <> struct ByteVec<16> { using T = uint4; };

// Stores N bytes at an N-byte aligned address with one access.
template <int N>
__device__ __forceinline__ void store_bytes(uint8_t* dst, const uint8_t (&b)[N]) {
    if constexpr (N == 1) {
        *dst = b[0];
    } else {
        typename ByteVec<N>::T v;
        memcpy(&v, b, N);
        *reinterpret_cast<typename ByteVec<N>::T*>(dst) = v;
    }
}

template <Quant Q> __device__ __forceinline__ uint8_t scale_code(float s) {
    if constexpr (Q == Quant::Fp4E4m3B16) return e4m3_code(s);
    else return static_cast<uint8_t>((__float_as_uint(s) >> 23) & 0xff);  // s = 2^k, normal: k + 127
}

// Quantizes the warp's row and stores codes at `data` (the row's data bytes) and scale bytes at
// `scales` (the row's scale bytes).
template <int D, Quant Q>
__device__ __forceinline__ void pack_row(const float (&x)[D / 32], int lane, uint8_t* data, uint8_t* scales) {
    constexpr int EPL = D / 32;
    constexpr int B = QuantTraits<Q>::kBlock;
    constexpr float m = QuantTraits<Q>::kElemMax;
    constexpr bool kFp4 = Q != Quant::Fp8Ue8m0B32;
    const float s = block_scale<D, Q>(x);
    uint8_t codes[EPL];
#pragma unroll
    for (int k = 0; k < EPL; ++k) {
        float y = __fdiv_rn(x[k], s);
        y = y > m ? m : (y < -m ? -m : y);
        codes[k] = kFp4 ? e2m1_code(y) : e4m3_code(y);
    }
    if constexpr (kFp4) {
        uint8_t pairs[EPL / 2];
#pragma unroll
        for (int k = 0; k < EPL / 2; ++k) pairs[k] = static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
        store_bytes<EPL / 2>(data + lane * (EPL / 2), pairs);
    } else {
        store_bytes<EPL>(data + lane * EPL, codes);
    }
    if ((lane * EPL) % B == 0) scales[lane * EPL / B] = scale_code<Q>(s);
}

// grid.x = ceil(T / 4), block = 128 threads (4 warps, one token each).
template <int D, Quant Q, Norm N>
__global__ void __launch_bounds__(kThreadsPerBlock) packed_insert_kernel(const Dsv41PackedInsertParams p) {
    __shared__ float squares[N != Norm::None ? kWarpsPerBlock : 1][N != Norm::None ? D : 1];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int t = blockIdx.x * kWarpsPerBlock + warp;
    if (t >= p.num_tokens) return;
    const int64_t slot = p.slots[t];
    if (slot < 0 || slot >= p.num_slots) return;
    float x[D / 32];
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.src) + t * p.src_row_stride;
    load_bf16<D / 32>(src + lane * (D / 32), x);
    if constexpr (N != Norm::None) rms_norm_row<D, N>(x, lane, squares[warp], p.norm_weight, p.norm_eps, p.norm_inv_dim);
    const int64_t half = p.rope_dim / 2;
    rope_row<D>(x, lane, p.rope_dim, p.cos + t * half, p.sin + t * half);
    constexpr int kDataBytes = Q == Quant::Fp8Ue8m0B32 ? D : D / 2;
    constexpr int kScaleBytes = D / QuantTraits<Q>::kBlock;
    const int64_t page = slot / p.page_size;
    const int64_t row = slot % p.page_size;
    uint8_t* base = p.cache + page * p.page_stride;
    pack_row<D, Q>(x, lane, base + row * kDataBytes,
                   base + static_cast<int64_t>(p.page_size) * kDataBytes + row * kScaleBytes);
}

}  // namespace dsv41

// ------------------------------------------------------------------------------------ launcher

namespace {

template <int D, dsv41::Quant Q>
int launch_packed(const Dsv41PackedInsertParams* p, dim3 grid, cudaStream_t s) {
    using namespace dsv41;
    if (p->apply_norm) packed_insert_kernel<D, Q, Norm::Weighted><<<grid, kThreadsPerBlock, 0, s>>>(*p);
    else packed_insert_kernel<D, Q, Norm::None><<<grid, kThreadsPerBlock, 0, s>>>(*p);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int dsv41_packed_insert(const Dsv41PackedInsertParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41PackedInsertParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_tokens < 0 || p->num_slots < 0 || p->page_size < 1) return DSV41_ERR_SHAPE;
    const int d = p->head_dim;
    if (d != 64 && d != 128 && d != 256 && d != 512) return DSV41_ERR_HEAD_DIM;
    if (p->rope_dim <= 0 || p->rope_dim % 2 != 0 || p->rope_dim > d) return DSV41_ERR_ROPE_DIM;
    int data, scales;
    switch (p->quant) {
        case DSV41_QUANT_FP8_UE8M0_B32: data = d; scales = d / 32; break;
        case DSV41_QUANT_FP4_E4M3_B16: data = d / 2; scales = d / 16; break;
        case DSV41_QUANT_FP4_UE8M0_B32: data = d / 2; scales = d / 32; break;
        default: return DSV41_ERR_QUANT;
    }
    if (p->page_stride < static_cast<int64_t>(p->page_size) * (data + scales)) return DSV41_ERR_SHAPE;
    if (p->num_tokens == 0) return DSV41_OK;
    if (!p->src || !p->cos || !p->sin || !p->slots || !p->cache) return DSV41_ERR_NULL;
    if (p->apply_norm && !p->norm_weight) return DSV41_ERR_NULL;
    const int align = 2 * (d / 32 < 8 ? d / 32 : 8);
    if (p->src_row_stride < d || !aligned_rows(p->src, p->src_row_stride, align)) return DSV41_ERR_ALIGNMENT;
    if (reinterpret_cast<uintptr_t>(p->cache) % 16 != 0 || p->page_stride % 16 != 0) return DSV41_ERR_ALIGNMENT;
    const dim3 grid(blocks_for_rows(p->num_tokens));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return with_head_dim(d, [&](auto dd) -> int {
        constexpr int D = decltype(dd)::value;
        switch (p->quant) {
            case DSV41_QUANT_FP8_UE8M0_B32: return launch_packed<D, Quant::Fp8Ue8m0B32>(p, grid, s);
            case DSV41_QUANT_FP4_E4M3_B16: return launch_packed<D, Quant::Fp4E4m3B16>(p, grid, s);
            default: return launch_packed<D, Quant::Fp4Ue8m0B32>(p, grid, s);
        }
    });
}
