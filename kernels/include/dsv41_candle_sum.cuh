// Candle's f32 row reduction on a CUDA device, reproduced operation by operation for the kernels
// that replace Candle op sequences ending in a row sum (kernels/decoder_ops.cu, kernels/mhc_norm.cu):
// the order is described in decoder_ops.cu's header comment ("the row sum is candle's reduction
// of the contiguous [rows, n] f32 squares").
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dsv41_float_io.cuh"

namespace dsv41 {

template <typename T>
__device__ __forceinline__ float sq(const T* x, int64_t i) {
    const float v = load_f32(x, i);
    return __fmul_rn(v, v);
}

// Σ elem(j) over j in 0..n in the order of candle's reduction of a contiguous f32 tensor whose
// row starts at element `start` (see the header comment); the result is returned to every
// thread of the block. blockDim.x is candle's block size for n (32 when n ≤ 32). Calls may
// follow each other in one kernel (the leading barrier protects the shared result).
template <typename F>
__device__ float candle_row_sum(int64_t start, int n, F elem) {
    __shared__ float shr[32];
    __shared__ float total;
    __syncthreads();
    const int tid = threadIdx.x;
    const int64_t stop = start + n;
    if (n <= 32) {
        if (tid == 0) {
            float s = 0.0f;
            for (int64_t i = start; i < stop; ++i) s = __fadd_rn(s, elem(i - start));
            total = s;
        }
        __syncthreads();
        return total;
    }
    const int64_t b = blockDim.x;
    float local = 0.0f;
    const int64_t vec_start = (start + 3) / 4, vec_stop = stop / 4;
    const int64_t head_end = min(vec_start * 4, stop);
    for (int64_t i = start + tid; i < head_end; i += b) local = __fadd_rn(local, elem(i - start));
    if (vec_start < vec_stop) {
        for (int64_t v = vec_start + tid; v < vec_stop; v += b) {
            const int64_t j = 4 * v - start;
            const float s = __fadd_rn(__fadd_rn(__fadd_rn(elem(j), elem(j + 1)), elem(j + 2)), elem(j + 3));
            local = __fadd_rn(local, s);
        }
    } else {
        for (int64_t i = head_end + tid; i < vec_stop * 4; i += b) local = __fadd_rn(local, elem(i - start));
    }
    for (int64_t i = vec_stop * 4 + tid; i < stop; i += b) local = __fadd_rn(local, elem(i - start));
    for (int offset = 16; offset > 0; offset >>= 1) local = __fadd_rn(local, __shfl_xor_sync(0xffffffffu, local, offset));
    const int warp = tid / 32, lane = tid % 32;
    if (lane == 0) shr[warp] = local;
    __syncthreads();
    if (tid < 32) {
        local = tid < static_cast<int>(b / 32) ? shr[tid] : 0.0f;
        for (int offset = 16; offset > 0; offset >>= 1) local = __fadd_rn(local, __shfl_xor_sync(0xffffffffu, local, offset));
        if (tid == 0) total = local;
    }
    __syncthreads();
    return total;
}

// Σ x[row·n + j]² of a contiguous [rows, n] tensor (candle's squares then its sum).
template <typename T>
__device__ float row_sum_sq(const T* __restrict__ x, int64_t row, int n) {
    return candle_row_sum(row * n, n, [&](int64_t j) { return sq(x, row * n + j); });
}

// sqrt(mean + eps) of a row's sum of squares, as candle's affine, affine, sqrt.
__device__ __forceinline__ float rms_root(float sum, float mean_mul, float eps) {
    const float mean = __fmaf_rn(sum, mean_mul, 0.0f);
    return __fsqrt_rn(__fmaf_rn(mean, 1.0f, eps));
}

// candle's reduction block size for rows of n elements (32 for its one-thread small sums).
inline unsigned norm_block(int n) {
    if (n <= 32) return 32;
    unsigned b = 1;
    while (b < static_cast<unsigned>(n < 1024 ? n : 1024)) b <<= 1;
    return b;
}

}  // namespace dsv41
