// f32_linear: the f32-weight linears at decode sizes, y[m, n] = Σ_k f32(x[m, k])·W[n, k], m ≤ 16
// rows of bf16 or f32 input — V4.1's LinearKind::F32 products (the MoE router, the compressor's
// wkv and wgate, the output head) in the decode step.
//
// Why a kernel: through Candle these are a cast of x to f32 and a cuBLAS SGEMM / GEMV of one to
// sixteen rows (one to three kernels: gemv, split-K reduce), each with its allocations; the
// decode step of a small model is bound by its launch count (docs/perf.md). Here: one launch,
// x read in its own dtype.
//
// Design: one warp per output feature j (8 per CTA of 256 threads); lane l reads W[j] as float4
// at k = 4l, 4l + 128, … (coalesced, streamed past L1) and, per row, the four x values at the
// same k (L1/L2-resident: x is a few KB), into one FMA chain per row; the lanes combine by an xor
// butterfly (16 … 1) and lane 0 writes the m outputs. A k that is not a multiple of 4, or an
// unaligned row, takes a scalar loop (lane l: k = l, l + 32, …). The weight is read once: at
// V4.1-Flash's head (129280 × 5120 f32) the design reads at HBM speed (not yet measured).
//
// Numerics: f32 products summed in the kernel's order (per lane in k order, then the butterfly),
// not cuBLAS's and not the CPU's: within the golden README's tolerance of the CPU reference
// (tests/cuda_f32_linear.rs). A row's result does not depend on m or on the other rows.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "include/dsv41_f32_linear.h"
#include "include/dsv41_float_io.cuh"

namespace dsv41 {

constexpr int kLinThreads = 256;
constexpr int kLinWarps = kLinThreads / 32;

__device__ __forceinline__ float4 load_w4(const float* p) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float4 load_x4(const float* x) { return *reinterpret_cast<const float4*>(x); }

__device__ __forceinline__ float4 load_x4(const __nv_bfloat16* x) {
    const uint2 u = *reinterpret_cast<const uint2*>(x);
    const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&u.x);
    const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&u.y);
    return make_float4(__low2float(a), __high2float(a), __low2float(b), __high2float(b));
}

template <typename T, int MT, bool VEC>
__global__ void __launch_bounds__(kLinThreads) f32_linear_kernel(Dsv41F32LinearParams p) {
    const int lane = threadIdx.x % 32;
    const int64_t j = static_cast<int64_t>(blockIdx.x) * kLinWarps + threadIdx.x / 32;
    if (j >= p.n) return;  // the whole warp
    const T* x = static_cast<const T*>(p.x);
    const float* w = p.w + j * p.k;
    float acc[MT];
#pragma unroll
    for (int r = 0; r < MT; ++r) acc[r] = 0.0f;
    if constexpr (VEC) {
        for (int64_t k = 4 * lane; k < p.k; k += 128) {
            const float4 wv = load_w4(w + k);
#pragma unroll
            for (int r = 0; r < MT; ++r) {
                if (r < p.m) {
                    const float4 xv = load_x4(x + r * p.x_stride + k);
                    acc[r] = __fmaf_rn(xv.x, wv.x, acc[r]);
                    acc[r] = __fmaf_rn(xv.y, wv.y, acc[r]);
                    acc[r] = __fmaf_rn(xv.z, wv.z, acc[r]);
                    acc[r] = __fmaf_rn(xv.w, wv.w, acc[r]);
                }
            }
        }
    } else {
        for (int64_t k = lane; k < p.k; k += 32) {
            const float wv = w[k];
#pragma unroll
            for (int r = 0; r < MT; ++r)
                if (r < p.m) acc[r] = __fmaf_rn(load_f32(x, r * p.x_stride + k), wv, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < MT; ++r) {
        float s = acc[r];
#pragma unroll
        for (int mask = 16; mask > 0; mask >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, mask));
        if (lane == 0 && r < p.m) p.y[r * p.n + j] = s;
    }
}

template <typename T, int MT>
cudaError_t launch_rows(const Dsv41F32LinearParams& p, bool vec, cudaStream_t s) {
    const dim3 grid(static_cast<unsigned>((p.n + kLinWarps - 1) / kLinWarps));
    if (vec) f32_linear_kernel<T, MT, true><<<grid, kLinThreads, 0, s>>>(p);
    else f32_linear_kernel<T, MT, false><<<grid, kLinThreads, 0, s>>>(p);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dtype(const Dsv41F32LinearParams& p, cudaStream_t s) {
    const int xalign = p.x_f32 ? 16 : 8;
    const bool vec = p.k % 4 == 0 && p.x_stride % 4 == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(p.x) % xalign == 0;
    if (p.m == 1) return launch_rows<T, 1>(p, vec, s);
    if (p.m <= 2) return launch_rows<T, 2>(p, vec, s);
    if (p.m <= 4) return launch_rows<T, 4>(p, vec, s);
    if (p.m <= 8) return launch_rows<T, 8>(p, vec, s);
    return launch_rows<T, 16>(p, vec, s);
}

}  // namespace dsv41

extern "C" int dsv41_f32_linear(const Dsv41F32LinearParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41F32LinearParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->m < 1 || p->m > DSV41_F32_LINEAR_MAX_M || p->n < 1 || p->k < 1 || p->x_stride < p->k || p->x_f32 < 0 ||
        p->x_f32 > 1)
        return DSV41_ERR_SHAPE;
    if ((p->n + kLinWarps - 1) / kLinWarps >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    if (!p->x || !p->w || !p->y) return DSV41_ERR_NULL;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const cudaError_t e = p->x_f32 ? launch_dtype<float>(*p, s) : launch_dtype<__nv_bfloat16>(*p, s);
    return static_cast<int>(e);
}
