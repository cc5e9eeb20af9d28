// mxfp4: the exact dequantization of an MXFP4 weight (the release's routed experts, spec §2.4)
// kept packed on the device: out[n, k] = e2m1(code(n, k)) * 2^(S[n, k/32] - 127) in f32 or bf16.
// Layout and format: kernels/include/dsv41_mxfp4.h. CPU reference: quant::Mxfp4Weight::dequantize
// (= loader::dequant_mxfp4, then a cast); GPU test: tests/cuda_mxfp4.rs (bit for bit).
//
// Until a grouped expert kernel computes with the packed codes, an MXFP4 linear on CUDA
// (nn::LinearWeight::Mxfp4) dequantizes its weight with this kernel into a bf16 scratch for every
// product and runs the dense path's cuBLAS matmul: the numbers of the dequantized-at-load weights.
//
// Design: one thread per 32-input block of a row (16 code bytes, one scale byte, 32 outputs):
// K is a multiple of 32, so a row is a whole number of 16-byte chunks and block t of the
// flattened weight reads codes[16t .. 16t + 16), scales[t] and writes out[32t .. 32t + 32).
// VEC (codes 16-byte aligned, out 16-byte aligned): one 16-byte load, 16-byte stores; else
// byte loads and element stores. Memory-bound: 0.56 bytes read per output element.
//
// Numerics (bit for bit the host): the code's value is built from its bits (exact), multiplied
// by the scale 2^(s - 127) in f32 (__fmul_rn: exact, including the f32 subnormal 2^-127 of s = 0
// and 0.5 * 2^-127 = 2^-128; +-inf where the product overflows, as on the host: codes >= 2 under
// s = 254, codes 4 and 6 under s = 253), then + 0.0f so that code 8 ("-0") gives +0 as
// loader::dequant_mxfp4 does. Every finite value has at most two significant bits and bf16 has
// f32's exponent range, so the bf16 rounding (RNE) is exact. Scale byte 255 is NaN: the host's
// NaN (f32::NAN times a code, + 0.0) is 0x7fc00000 and its bf16 cast 0x7fc0, written as such
// (the device's own NaN arithmetic would give 0x7fffffff).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "include/dsv41_mxfp4.h"

namespace dsv41 {
namespace mxfp4 {

constexpr int kThreads = 256;
constexpr uint32_t kNanF32 = 0x7fc00000u;
constexpr uint16_t kNanBf16 = 0x7fc0u;

// e8m0 byte -> 2^(b - 127) for b < 255 (b = 0: the f32 subnormal 2^-127).
__device__ __forceinline__ float e8m0_f32(uint32_t b) { return __uint_as_float(b == 0 ? 0x00400000u : b << 23); }

// e2m1 code (bit 3 = sign) -> f32, from the bits: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; code 8 is -0.
__device__ __forceinline__ float e2m1_f32(uint32_t c) {
    const uint32_t m = c & 7u;
    const uint32_t mag = m < 2u ? (m == 1u ? 0x3f000000u : 0u) : (((m >> 1) + 126u) << 23) | ((m & 1u) << 22);
    return __uint_as_float(mag | ((c & 8u) << 28));
}

template <bool F32, bool VEC>
__global__ void __launch_bounds__(kThreads) mxfp4_dequant_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                                                 void* __restrict__ out, int64_t blocks) {
    const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    if (t >= blocks) return;
    const uint32_t sb = __ldg(scales + t);
    uint32_t w[4];
    if constexpr (VEC) {
        const uint4 q = __ldg(reinterpret_cast<const uint4*>(codes) + t);
        w[0] = q.x;
        w[1] = q.y;
        w[2] = q.z;
        w[3] = q.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint8_t* c = codes + 16 * t + 4 * i;
            w[i] = static_cast<uint32_t>(c[0]) | (static_cast<uint32_t>(c[1]) << 8) | (static_cast<uint32_t>(c[2]) << 16) |
                   (static_cast<uint32_t>(c[3]) << 24);
        }
    }
    // Input e of the block: byte e/2 (word e/8), low nibble for even e: bits 4 * (e % 8) of word e/8.
    float v[32];
    if (sb == 255u) {
#pragma unroll
        for (int e = 0; e < 32; ++e) v[e] = __uint_as_float(kNanF32);
    } else {
        const float sc = e8m0_f32(sb);
#pragma unroll
        for (int e = 0; e < 32; ++e) v[e] = __fadd_rn(__fmul_rn(e2m1_f32((w[e / 8] >> (4 * (e % 8))) & 0xfu), sc), 0.0f);
    }
    if constexpr (F32) {
        float* o = static_cast<float*>(out) + 32 * t;
        if constexpr (VEC) {
#pragma unroll
            for (int i = 0; i < 8; ++i) reinterpret_cast<float4*>(o)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
        } else {
#pragma unroll
            for (int e = 0; e < 32; ++e) o[e] = v[e];
        }
    } else {
        uint16_t h[32];
#pragma unroll
        for (int e = 0; e < 32; ++e) h[e] = sb == 255u ? kNanBf16 : __bfloat16_as_ushort(__float2bfloat16_rn(v[e]));
        uint16_t* o = static_cast<uint16_t*>(out) + 32 * t;
        if constexpr (VEC) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                uint4 q;
                q.x = h[8 * i] | (static_cast<uint32_t>(h[8 * i + 1]) << 16);
                q.y = h[8 * i + 2] | (static_cast<uint32_t>(h[8 * i + 3]) << 16);
                q.z = h[8 * i + 4] | (static_cast<uint32_t>(h[8 * i + 5]) << 16);
                q.w = h[8 * i + 6] | (static_cast<uint32_t>(h[8 * i + 7]) << 16);
                reinterpret_cast<uint4*>(o)[i] = q;
            }
        } else {
#pragma unroll
            for (int e = 0; e < 32; ++e) o[e] = h[e];
        }
    }
}

}  // namespace mxfp4
}  // namespace dsv41

extern "C" int dsv41_mxfp4_dequant(const Dsv41Mxfp4DequantParams* p, size_t params_size, void* stream) {
    using namespace dsv41::mxfp4;
    if (params_size != sizeof(Dsv41Mxfp4DequantParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->n < 1 || p->k < 32 || p->k % 32 != 0) return DSV41_ERR_SHAPE;
    if (!p->codes || !p->scales || !p->out) return DSV41_ERR_NULL;
    const int64_t blocks = static_cast<int64_t>(p->n) * (p->k / 32);
    if ((blocks + kThreads - 1) / kThreads >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    const unsigned grid = static_cast<unsigned>((blocks + kThreads - 1) / kThreads);
    const bool vec = (reinterpret_cast<uintptr_t>(p->codes) & 15) == 0 && (reinterpret_cast<uintptr_t>(p->out) & 15) == 0;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (p->out_f32) {
        if (vec) mxfp4_dequant_kernel<true, true><<<grid, kThreads, 0, st>>>(p->codes, p->scales, p->out, blocks);
        else mxfp4_dequant_kernel<true, false><<<grid, kThreads, 0, st>>>(p->codes, p->scales, p->out, blocks);
    } else {
        if (vec) mxfp4_dequant_kernel<false, true><<<grid, kThreads, 0, st>>>(p->codes, p->scales, p->out, blocks);
        else mxfp4_dequant_kernel<false, false><<<grid, kThreads, 0, st>>>(p->codes, p->scales, p->out, blocks);
    }
    return static_cast<int>(cudaGetLastError());
}
