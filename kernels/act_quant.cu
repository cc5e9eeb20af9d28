// fake_quant: blockwise QAT fake quantization of a dense bf16 / f32 tensor (spec §2.3), used for
// the FP8 activation quantization of every FP8/FP4-weight linear's input (spec §0.1b.8, Q1 =
// 1x32 e4m3 with a UE8M0 scale) and for the other fake-quantized activations computed outside
// a fused insert (the index queries, Q3).
//
// Design: one thread per element; the block's lanes are consecutive lanes of one warp (32 for
// Q1/Q3, a half warp for Q2), so the block amax is a butterfly of xor shuffles inside the block
// and every load/store is coalesced. The kernel is bandwidth bound (read + write once);
// activations are small (T x K), so no vectorization beyond that.
//
// Numerics: exactly quant::fake_quant::fake_quant_block on the CPU, through the shared
// dsv41_numerics.cuh: amax = max |x| (NaN ignored, as fmaxf and Rust's f32::max), the format's
// scale, q = round(clamp(x / s)) * s with IEEE division and multiplication, stored in the input
// dtype (exact: q * s is representable in bf16).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "include/dsv41_act_quant.h"
#include "include/dsv41_numerics.cuh"

namespace dsv41 {

constexpr int kFqThreads = 256;

template <typename T> __device__ __forceinline__ float load_elem(const T* p, int64_t i);
template <> __device__ __forceinline__ float load_elem<float>(const float* p, int64_t i) { return p[i]; }
template <> __device__ __forceinline__ float load_elem<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
    return __bfloat162float(p[i]);
}
template <typename T> __device__ __forceinline__ void store_elem(T* p, int64_t i, float v);
template <> __device__ __forceinline__ void store_elem<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> __device__ __forceinline__ void store_elem<__nv_bfloat16>(__nv_bfloat16* p, int64_t i, float v) {
    p[i] = __float2bfloat16_rn(v);  // exact: v is a bf16 value
}

// grid.x = ceil(num_elems / 256), block = 256 threads; element i = global thread id. Threads past
// the end take part in the shuffles (with amax 0) but load and store nothing; since num_elems is
// a multiple of the block, a quantization block is either entirely inside or entirely outside.
template <typename T, Quant Q>
__global__ void __launch_bounds__(kFqThreads) fake_quant_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t n) {
    constexpr int B = QuantTraits<Q>::kBlock;
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kFqThreads + threadIdx.x;
    const bool live = i < n;
    const float v = live ? load_elem<T>(x, i) : 0.0f;
    float amax = fabsf(v);
#pragma unroll
    for (int off = B / 2; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (!live) return;
    const BlockScale s = QuantTraits<Q>::scale(amax);
    store_elem<T>(out, i, fake_quant_element<Q>(v, s));
}

template <typename T>
int launch_fake_quant(const Dsv41FakeQuantParams* p, cudaStream_t s) {
    const dim3 grid(static_cast<unsigned>((p->num_elems + kFqThreads - 1) / kFqThreads));
    const T* x = static_cast<const T*>(p->x);
    T* out = static_cast<T*>(p->out);
    switch (p->quant) {
        case DSV41_QUANT_FP8_UE8M0_B32:
            fake_quant_kernel<T, Quant::Fp8Ue8m0B32><<<grid, kFqThreads, 0, s>>>(x, out, p->num_elems);
            break;
        case DSV41_QUANT_FP4_E4M3_B16:
            fake_quant_kernel<T, Quant::Fp4E4m3B16><<<grid, kFqThreads, 0, s>>>(x, out, p->num_elems);
            break;
        case DSV41_QUANT_FP4_UE8M0_B32:
            fake_quant_kernel<T, Quant::Fp4Ue8m0B32><<<grid, kFqThreads, 0, s>>>(x, out, p->num_elems);
            break;
        default: return DSV41_ERR_QUANT;
    }
    return static_cast<int>(cudaGetLastError());
}

}  // namespace dsv41

extern "C" int dsv41_fake_quant(const Dsv41FakeQuantParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41FakeQuantParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_elems < 0) return DSV41_ERR_SHAPE;
    const int block = p->quant == DSV41_QUANT_FP4_E4M3_B16 ? 16 : 32;
    if (p->quant < DSV41_QUANT_FP8_UE8M0_B32 || p->quant > DSV41_QUANT_FP4_UE8M0_B32) return DSV41_ERR_QUANT;
    if (p->num_elems % block != 0) return DSV41_ERR_SHAPE;
    if (p->num_elems / kFqThreads >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    if (p->num_elems == 0) return DSV41_OK;
    if (!p->x || !p->out) return DSV41_ERR_NULL;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return p->is_f32 ? launch_fake_quant<float>(p, s) : launch_fake_quant<__nv_bfloat16>(p, s);
}
