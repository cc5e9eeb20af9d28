// The release's FP8 codes on the device (spec §2.4): e8m0 scale bytes and e4m3 codes decoded
// exactly. Shared by kernels/fp8_linear.cu (weight streaming), kernels/fp8_dequant.cu (the exact
// dequantization) and kernels/fp8_gemm.cu (the wgmma GEMM).
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace dsv41 {
namespace fp8 {

// e8m0 byte -> 2^(b - 127) (b = 0: the subnormal 2^-127; 255: NaN).
__device__ __forceinline__ float e8m0_f32(uint32_t b) {
    return __uint_as_float(b == 0 ? 0x00400000u : (b == 255 ? 0x7fc00000u : b << 23));
}

// Two e4m3 codes (low / high byte of h) -> f16x2 (low half from the low byte); exact.
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint16_t h) {
    uint32_t d;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(h));
    return d;
}

}  // namespace fp8
}  // namespace dsv41
