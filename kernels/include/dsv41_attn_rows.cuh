// KV row sources of the sparse attention kernel (kernels/sparse_attention.cu): bf16 rows, or
// the packed cache rows of spec §7.2 dequantized to bf16 on their way into shared memory.
//
// Formats (DSV41_KV_* in dsv41_sparse_attention.h), all D = 512 wide, pages of `page_size`
// tokens laid out as [page_size x data][page_size x scales] (crate `cuda::PackedLayout`):
//   bf16       rows of 512 bf16 at `base + row * row_stride` (elements);
//   packed A   window KV (Q1): 512 e4m3 bytes + 16 UE8M0 scale bytes (one per 32 dims) = 528 B;
//   packed B   compressed KV (Q2): 256 bytes of e2m1 pairs (even dim in the low nibble) + 32
//              e4m3 scale bytes (one per 16 dims) = 288 B.
//
// Dequantization is exact: an e4m3 code is converted to f16 by the hardware (cvt e4m3x2 ->
// f16x2, exact), widened to f32 (exact) and multiplied by its block scale (a power of two for
// A; an e4m3 value for B, whose product with an e2m1 value has at most 6 significant bits), so
// the bf16 rounding of the product is exact: the tile holds bit for bit the values the bf16
// inserts store (the fake-quantized rows). An e2m1 code s|eem becomes the e4m3 byte s|00|eem|00,
// which is the same value times 2^-6 (the subnormal 0.5 included: e4m3 E = 0, M = 4); the
// 2^6 is folded into the block factor.
//
// In-place expansion (no staging buffer: the kernel's shared memory is full). A 64-row stage
// tile is 8 planes x 64 rows x 128 bytes (bf16 dims 64p .. 64p + 63 of row r in slot (r, p),
// 16-byte chunks swizzled). The producer copies row r's packed codes for plane p into the
// upper half of slot (r, p) (bytes 64..127: 64 e4m3 bytes for A, 32 code bytes for B) and the
// row's scale bytes into bytes 0..31 of slot (r, 0); once the copies have landed, the thread
// owning slot (r, p) reads its codes and the two (A) / four (B) scale bytes it needs, the 8
// threads of row r synchronise (slot (r, 0)'s scales are overwritten by its owner), and each
// writes its 8 bf16 chunks into its own slot. A slot's writer is its only reader of codes.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "dsv41_numerics.cuh"
#include "dsv41_sparse_attention.h"

namespace dsv41_rows {

constexpr int PLANE_BYTES = 64 * 128;  // one plane of a 64-row stage tile

// Where one source's rows live.
struct RowSource {
    const unsigned char* base;  // the packed pages (bf16 rows are addressed by the kernel's row_ptr)
    int32_t format;             // DSV41_KV_*
    int32_t page_size;          // packed: tokens per page
};

__device__ __forceinline__ int data_bytes(int format) { return format == DSV41_KV_PACKED_A ? 512 : 256; }
__device__ __forceinline__ int scale_bytes(int format) { return format == DSV41_KV_PACKED_A ? 16 : 32; }

// Packed row `row` of `s`: its code bytes and its scale bytes.
__device__ __forceinline__ void packed_row(const RowSource& s, uint32_t row, const unsigned char*& data,
                                           const unsigned char*& scales) {
    const uint32_t page = row / static_cast<uint32_t>(s.page_size), in = row - page * static_cast<uint32_t>(s.page_size);
    const int db = data_bytes(s.format), sb = scale_bytes(s.format);
    const unsigned char* pg = s.base + static_cast<int64_t>(page) * s.page_size * (db + sb);
    data = pg + static_cast<int64_t>(in) * db;
    scales = pg + static_cast<int64_t>(s.page_size) * db + static_cast<int64_t>(in) * sb;
}

// Two e4m3 codes (low 16 bits of `w`) times `f` -> bf16x2 (exact, see the header).
__device__ __forceinline__ uint32_t e4m3x2_scaled(uint32_t w, float f) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return dsv41::pack_bf16x2_rn(v.x * f, v.y * f);
}

// Four e4m3 codes -> 4 bf16 (two words), times `f`.
__device__ __forceinline__ uint2 e4m3x4_scaled(uint32_t w, float f) {
    return make_uint2(e4m3x2_scaled(w, f), e4m3x2_scaled(w >> 16, f));
}

// Eight e2m1 codes (dims 0..7 in nibbles 0..7 of `w`) -> their e4m3 bytes (value x 2^-6),
// dims 0..3 in .x, 4..7 in .y.
__device__ __forceinline__ uint2 e2m1x8_to_e4m3(uint32_t w) {
    const uint32_t ev = w & 0x0f0f0f0fu, od = (w >> 4) & 0x0f0f0f0fu;  // dims 0,2,4,6 / 1,3,5,7
    const uint32_t e = ((ev & 0x07070707u) << 2) | ((ev & 0x08080808u) << 4);
    const uint32_t o = ((od & 0x07070707u) << 2) | ((od & 0x08080808u) << 4);
    return make_uint2(__byte_perm(e, o, 0x5140), __byte_perm(e, o, 0x7362));
}

// A UE8M0 scale byte as f32 (2^(b - 127); b = 0 is the subnormal 2^-127).
__device__ __forceinline__ float ue8m0(uint32_t b) { return __uint_as_float(b ? b << 23 : 0x00400000u); }

// An e4m3 scale byte as f32 (exact).
__device__ __forceinline__ float e4m3_value(uint32_t b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b & 0xffu), __NV_E4M3);
    return __half2float(*reinterpret_cast<const __half*>(&h));
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint2 a, uint2 b) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a.x), "r"(a.y), "r"(b.x), "r"(b.y) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

// Issues the cp.async copies of packed row `row` into stage tile `tile` (row r of the tile):
// the 8 threads q = 0..7 of the row's group share the work. Codes of plane p go to the upper
// half of slot (r, p), the row's scales to the start of slot (r, 0).
template <typename Copy>
__device__ __forceinline__ void copy_packed_row(const RowSource& s, uint32_t row, uint32_t tile, int r, int q, Copy copy16) {
    const unsigned char *data, *scales;
    packed_row(s, row, data, scales);
    const uint32_t slot0 = tile + r * 128;
    if (s.format == DSV41_KV_PACKED_A) {
        // 32 chunks of 16 codes: chunk k -> plane k / 4, quarter k % 4.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int k = q + 8 * i;
            copy16(slot0 + (k >> 2) * PLANE_BYTES + 64 + (k & 3) * 16, data + 16 * k);
        }
        if (q == 0) copy16(slot0, scales);
    } else {
        // 16 chunks of 32 codes: chunk k -> plane k / 2, half k % 2.
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int k = q + 8 * i;
            copy16(slot0 + (k >> 1) * PLANE_BYTES + 64 + (k & 1) * 16, data + 16 * k);
        }
        if (q < 2) copy16(slot0 + 16 * q, scales + 16 * q);
    }
}

// Expands slot (r, p = q) of a stage tile whose packed copies have landed. Every thread of the
// warp calls it (`active` false: nothing to expand, it only joins the warp synchronisation).
__device__ __forceinline__ void expand_packed_slot(int format, bool active, uint32_t tile, int r, int q) {
    const uint32_t slot = tile + q * PLANE_BYTES + r * 128, slot0 = tile + r * 128;
    uint4 c0 = make_uint4(0, 0, 0, 0), c1 = c0, c2 = c0, c3 = c0;
    uint32_t sc = 0;
    if (active) {
        if (format == DSV41_KV_PACKED_A) {
            sc = ld_shared_u32(slot0 + ((2 * q) & ~3)) >> (16 * (q & 1));  // scale bytes 2q, 2q + 1
            c2 = ld_shared_v4(slot + 64 + 32);
            c3 = ld_shared_v4(slot + 64 + 48);
        } else {
            sc = ld_shared_u32(slot0 + 4 * q);  // scale bytes 4q .. 4q + 3
        }
        c0 = ld_shared_v4(slot + 64);
        c1 = ld_shared_v4(slot + 64 + 16);
    }
    __syncwarp();  // all scale bytes of the row read before slot (r, 0) is overwritten
    if (!active) return;
    const int sw = r & 7;
    if (format == DSV41_KV_PACKED_A) {
        // Output chunk c (dims 8c .. 8c + 7 of the plane) = code bytes 8c .. 8c + 7; block c / 4.
        const uint32_t w[16] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w, c2.x, c2.y, c2.z, c2.w, c3.x, c3.y, c3.z, c3.w};
        const float f0 = ue8m0(sc & 0xffu), f1 = ue8m0((sc >> 8) & 0xffu);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const float f = c < 4 ? f0 : f1;
            st_shared_v4(slot + ((c ^ sw) << 4), e4m3x4_scaled(w[2 * c], f), e4m3x4_scaled(w[2 * c + 1], f));
        }
    } else {
        // Output chunk c = code word c (8 nibbles); block c / 2; the e4m3 bytes carry 2^-6.
        const uint32_t w[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const float f = e4m3_value((sc >> (8 * (c >> 1))) & 0xffu) * 64.f;
            const uint2 e = e2m1x8_to_e4m3(w[c]);
            st_shared_v4(slot + ((c ^ sw) << 4), e4m3x4_scaled(e.x, f), e4m3x4_scaled(e.y, f));
        }
    }
}

}  // namespace dsv41_rows
