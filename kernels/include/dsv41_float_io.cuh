// Element loads as f32 and round-to-nearest-even stores of bf16 / f32 buffers, overloaded on the
// pointer type: the kernels that reproduce Candle's f32 op sequences on bf16 or f32 tensors
// (kernels/decoder_ops.cu, kernels/swiglu.cu) are templates over the element type.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace dsv41 {

__device__ __forceinline__ float load_f32(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store_as(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_as(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
// v as store_as would store it into a buffer of p's type, read back as f32.
__device__ __forceinline__ float rounded_as(const float*, float v) { return v; }
__device__ __forceinline__ float rounded_as(const __nv_bfloat16*, float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

}  // namespace dsv41
