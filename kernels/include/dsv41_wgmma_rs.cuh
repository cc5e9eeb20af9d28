// wgmma (sm_90a) with the A operand in registers: d[0 .. N/2) += A (64 x 16 bf16, four b32
// registers per thread) * B (16 x N bf16, shared-memory descriptor, K-major), f32 accumulation
// (scale-d = 1: the caller zeroes d first), for N = 16, 32, ..., 128 (PTX ISA,
// "wgmma.mma_async", register A form: `d, a, b-desc, scale-d, imm-scale-a, imm-scale-b,
// imm-trans-b`). Register layout (PTX ISA, "Matrix Fragments for wgmma.mma_async.m64nNk16"):
// warp w of the warpgroup holds rows 16 (w % 4) .. +15; with g = lane / 4 and t = lane % 4,
// a[0] = (row g, k 2t, 2t + 1), a[1] = (row g + 8, k 2t, 2t + 1), a[2] = (row g, k 2t + 8, 2t + 9),
// a[3] = (row g + 8, k 2t + 8, 2t + 9), the lower k in the low half; accumulator d[4i + c] at row
// g + 8 (c / 2), column 8i + 2t + c % 2. The caller issues wgmma.fence (wg_fence) before a product
// whose A registers or accumulators it wrote, commits the group (wg_commit) and keeps a[]
// unchanged until the product's wgmma.wait_group (wg_wait; kernels/moe_experts_gemm.cu). The
// fences, the descriptors and the accumulator operand lists are dsv41_hopper.cuh's.
#pragma once
#include <stdint.h>

#include "dsv41_hopper.cuh"

namespace dsv41_ptx {

template <int NV>  // N = 16 NV
__device__ __forceinline__ void wg_rs_bf16(float* d, const uint32_t* a, uint64_t b);

template <>
__device__ __forceinline__ void wg_rs_bf16<1>(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{" DSV41_WG_ACC_STR(8) "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : DSV41_WG_ACC_OPS(8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wg_rs_bf16<2>(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{" DSV41_WG_ACC_STR(16) "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : DSV41_WG_ACC_OPS(16)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wg_rs_bf16<3>(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
        "{" DSV41_WG_ACC_STR(24) "}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
        : DSV41_WG_ACC_OPS(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wg_rs_bf16<4>(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{" DSV41_WG_ACC_STR(32) "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : DSV41_WG_ACC_OPS(32)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wg_rs_bf16<5>(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
        "{" DSV41_WG_ACC_STR(40) "}, {%40, %41, %42, %43}, %44, p, 1, 1, 0;\n}\n"
        : DSV41_WG_ACC_OPS(40)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wg_rs_bf16<6>(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
        "{" DSV41_WG_ACC_STR(48) "}, {%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"
        : DSV41_WG_ACC_OPS(48)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wg_rs_bf16<7>(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %61, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 "
        "{" DSV41_WG_ACC_STR(56) "}, {%56, %57, %58, %59}, %60, p, 1, 1, 0;\n}\n"
        : DSV41_WG_ACC_OPS(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wg_rs_bf16<8>(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{" DSV41_WG_ACC_STR(64) "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : DSV41_WG_ACC_OPS(64)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

}  // namespace dsv41_ptx
