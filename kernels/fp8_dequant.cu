// fp8_dequant: the exact dequantization of the release's dense FP8 weights (spec §2.4):
// W[n, k] = e4m3(codes[n, k]) * 2^(S[n/32, k/32] - 127) into bf16 or f32 (`dsv41_fp8_dequant`,
// params in include/dsv41_fp8_linear.h). Bit for bit the host's loader::dequant_fp8_block32
// (-0 as +0, scale byte 255 NaN; e4m3 x 2^k is exact in bf16 within its range); used by
// Fp8Weight::dequantize on CUDA and by the FP8 linear's large-m path (dequantize, then cuBLAS).
// GPU test: tests/cuda_fp8_linear.rs (dequantize_bit_exact).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "include/dsv41_fp8.cuh"
#include "include/dsv41_fp8_linear.h"
#include "include/dsv41_params.h"

namespace dsv41 {
namespace fp8 {

// Exact dequantization, 8 codes per thread (VEC: k % 8 == 0, aligned) or one.
template <bool F32, bool VEC>
__global__ void __launch_bounds__(256) fp8_dequant_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, void* out,
                                                          int n, int k) {
    constexpr int E = VEC ? 8 : 1;
    const int64_t i = (static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x) * E;
    if (i >= static_cast<int64_t>(n) * k) return;
    const int r = static_cast<int>(i / k), c = static_cast<int>(i % k);
    const int kbn = (k + 31) / 32;
    const float sc = e8m0_f32(__ldg(scales + static_cast<int64_t>(r / 32) * kbn + c / 32));
    uint2 w = make_uint2(0u, 0u);
    if constexpr (VEC) w = __ldg(reinterpret_cast<const uint2*>(codes + i));
    else w.x = codes[i];
    float v[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const uint32_t byte = ((e < 4 ? w.x : w.y) >> (8 * (e & 3))) & 0xffu;
        const uint32_t h = e4m3x2_f16x2(static_cast<uint16_t>(byte));
        // + 0: a stored -0 dequantizes to +0 (loader::dequant_fp8_block32).
        v[e] = __fadd_rn(__fmul_rn(__half2float(__ushort_as_half(static_cast<uint16_t>(h & 0xffffu))), sc), 0.0f);
    }
    if constexpr (F32) {
        float* o = static_cast<float*>(out) + i;
#pragma unroll
        for (int e = 0; e < E; ++e) o[e] = v[e];
    } else {
        __nv_bfloat16* o = static_cast<__nv_bfloat16*>(out) + i;
        if constexpr (VEC) {
            uint4 w;
            uint32_t* wp = reinterpret_cast<uint32_t*>(&w);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const __nv_bfloat162 p = __floats2bfloat162_rn(v[2 * e], v[2 * e + 1]);
                wp[e] = *reinterpret_cast<const uint32_t*>(&p);
            }
            *reinterpret_cast<uint4*>(o) = w;
        } else {
            o[0] = __float2bfloat16_rn(v[0]);
        }
    }
}

}  // namespace fp8
}  // namespace dsv41

extern "C" int dsv41_fp8_dequant(const Dsv41Fp8DequantParams* p, size_t params_size, void* stream) {
    using namespace dsv41::fp8;
    if (params_size != sizeof(Dsv41Fp8DequantParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->n < 1 || p->k < 1) return DSV41_ERR_SHAPE;
    if (!p->codes || !p->scales || !p->out) return DSV41_ERR_NULL;
    const int64_t total = static_cast<int64_t>(p->n) * p->k;
    const bool vec = p->k % 8 == 0 && (reinterpret_cast<uintptr_t>(p->codes) & 7) == 0 &&
                     (reinterpret_cast<uintptr_t>(p->out) & (p->out_f32 ? 3 : 15)) == 0;
    const int64_t threads = vec ? total / 8 : total;
    if ((threads + 255) / 256 >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    const unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (p->out_f32) {
        if (vec) fp8_dequant_kernel<true, true><<<blocks, 256, 0, st>>>(p->codes, p->scales, p->out, p->n, p->k);
        else fp8_dequant_kernel<true, false><<<blocks, 256, 0, st>>>(p->codes, p->scales, p->out, p->n, p->k);
    } else {
        if (vec) fp8_dequant_kernel<false, true><<<blocks, 256, 0, st>>>(p->codes, p->scales, p->out, p->n, p->k);
        else fp8_dequant_kernel<false, false><<<blocks, 256, 0, st>>>(p->codes, p->scales, p->out, p->n, p->k);
    }
    return static_cast<int>(cudaGetLastError());
}
