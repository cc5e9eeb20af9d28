// Host simulation of the repository's CUDA kernels (kernels/*.cu) for machines without a GPU:
// the device code is compiled as host C++ with g++, each warp runs as 32 std::threads, and the
// warp primitives (__shfl_xor_sync, __shfl_sync, __syncwarp) are emulated with a barrier. The
// `_rn` intrinsics map to plain IEEE float operations (volatile, and -ffp-contract=off), which
// is what they are on the GPU. It checks the kernels' logic (lane mapping, shuffles, reduction
// order, packing) and numerics; it says nothing about performance or memory-access legality.
#pragma once
#include <cuda_bf16.h>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <functional>
using std::isnan;

#undef __global__
#define __global__
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)

struct SimDim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local SimDim3 threadIdx, blockIdx;
inline SimDim3 blockDim;

struct WarpSim {
    std::barrier<> bar{32};
    float vals[32];
};
inline thread_local int g_lane;
inline thread_local WarpSim* g_warp;

inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline int __clz(unsigned x) { return x == 0 ? 32 : __builtin_clz(x); }
inline int max(int a, int b) { return a > b ? a : b; }
inline void __syncwarp(unsigned = 0xffffffffu) { g_warp->bar.arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
    g_warp->vals[g_lane] = v;
    g_warp->bar.arrive_and_wait();
    float r = g_warp->vals[g_lane ^ off];
    g_warp->bar.arrive_and_wait();
    return r;
}
inline float __shfl_sync(unsigned, float v, int src) {
    g_warp->vals[g_lane] = v;
    g_warp->bar.arrive_and_wait();
    float r = g_warp->vals[src];
    g_warp->bar.arrive_and_wait();
    return r;
}

// Runs `kernel` for grid x block threads (block a multiple of 32), one warp at a time.
template <typename F>
void sim_launch(unsigned grid, unsigned block, F kernel) {
    for (unsigned b = 0; b < grid; ++b) {
        for (unsigned w = 0; w < block / 32; ++w) {
            WarpSim warp;
            std::vector<std::thread> ts;
            for (int l = 0; l < 32; ++l)
                ts.emplace_back([&, l] {
                    threadIdx.x = w * 32 + l;
                    blockIdx.x = b;
                    g_lane = l;
                    g_warp = &warp;
                    kernel();
                });
            for (auto& t : ts) t.join();
        }
    }
}
