// hbm_read: the read ceiling the weight-streaming kernels are measured against - how long a kernel
// that only reads a [n, k] u8 matrix from HBM takes, at the FP8 linear's V4.1-Flash shapes.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a examples/anchors/hbm_read.cu -o hbm_read && ./hbm_read
//
// Two readers, each timed as docs/perf.md "Card, method, ceilings" describes (CUDA graph of 4x
// `sets` calls rotating over copies that exceed the L2 several times, CUDA events, median of 7):
//   * flat: grid-stride 16-byte streaming loads (ld.global.cs), 256 threads, 8 CTAs per SM;
//   * units: the access pattern of the FP8 linear's stream-K variant (kernels/fp8_linear.cu) -
//     persistent CTAs of 128 threads, equal contiguous runs of 128-row x 128-byte units, cp.async
//     into a 4-stage shared-memory ring, 2 CTAs per SM - without any arithmetic.
// The difference between a kernel and "units" is what its arithmetic, synchronisation and
// epilogue cost; "flat" is the best plain read.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e = (x);                                                           \
        if (e != cudaSuccess) {                                                        \
            std::printf("CUDA error %s at line %d\n", cudaGetErrorString(e), __LINE__); \
            std::exit(1);                                                              \
        }                                                                              \
    } while (0)

__global__ void read_flat(const uint4* p, int64_t n16, unsigned* sink) {
    uint32_t acc = 0;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n16; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads
}

template <int ROWS, int COLB, int S>
__global__ void __launch_bounds__(128) read_units(const uint8_t* w, int n, int k, unsigned* sink) {
    extern __shared__ __align__(16) uint8_t smem[];
    constexpr int STAGE = ROWS * COLB, CH = STAGE / 16;
    const int nrg = (n + ROWS - 1) / ROWS, sk = (k + COLB - 1) / COLB;
    const int64_t units = static_cast<int64_t>(nrg) * sk;
    const int64_t u0 = blockIdx.x * units / gridDim.x, u1 = (blockIdx.x + 1) * units / gridDim.x;
    const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    auto load = [&](int slot, int64_t u) {
        const int st = static_cast<int>(u % sk), rg = static_cast<int>(u / sk);
        for (int c = threadIdx.x; c < CH; c += 128) {
            const int r = c / (COLB / 16), cc = c % (COLB / 16), row = rg * ROWS + r;
            const int64_t col = static_cast<int64_t>(st) * COLB + cc * 16;
            const bool ok = row < n && col < k;
            const uint8_t* src = w + (ok ? static_cast<int64_t>(row) * k + col : 0);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sa + slot * STAGE + c * 16), "l"(src), "r"(ok ? 16 : 0) : "memory");
        }
    };
    for (int d = 0; d < S - 1; ++d) {
        if (u0 + d < u1) load(d, u0 + d);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    uint32_t acc = 0;
    for (int64_t u = u0; u < u1; ++u) {
        const int i = static_cast<int>(u - u0);
        asm volatile("cp.async.wait_group %0;" ::"n"(S - 2) : "memory");
        __syncthreads();
        if (u + S - 1 < u1) load((i + S - 1) % S, u + S - 1);
        asm volatile("cp.async.commit_group;" ::: "memory");
        acc ^= reinterpret_cast<const uint32_t*>(smem + (i % S) * STAGE)[threadIdx.x * 4];
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

template <class F>
float median_us(F call, int sets) {
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    for (int i = 0; i < 3; ++i) call(i % sets, st);
    cudaGraph_t g;
    cudaGraphExec_t ge;
    const int calls = 4 * sets;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < calls; ++i) call(i % sets, st);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> v;
    for (int r = 0; r < 7; ++r) {
        CK(cudaEventRecord(a, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms = 0.0f;
        CK(cudaEventElapsedTime(&ms, a, b));
        v.push_back(ms * 1000.0f / calls);
    }
    std::sort(v.begin(), v.end());
    return v[3];
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, %d SMs\n| shape | reader | us | GB/s |\n|---|---|---|---|\n", prop.name, sms);
    unsigned* sink;
    CK(cudaMalloc(&sink, 4));
    const struct { const char* name; int n, k; } shapes[] = {{"wq_a", 1280, 5120}, {"wq_b", 32768, 1280}, {"wo_b", 5120, 8192}, {"w13", 2304, 5120}, {"w2", 5120, 2304}};
    constexpr int kUnitsSmem = 128 * 128 * 4;
    auto units = read_units<128, 128, 4>;
    CK(cudaFuncSetAttribute(units, cudaFuncAttributeMaxDynamicSharedMemorySize, kUnitsSmem));
    for (const auto& sh : shapes) {
        const int64_t bytes = static_cast<int64_t>(sh.n) * sh.k;
        const int sets = static_cast<int>(std::max<int64_t>(2, (400ll << 20) / bytes + 1));  // > 8x the 50 MB L2
        std::vector<uint8_t*> bufs(sets);
        for (auto& b : bufs) {
            CK(cudaMalloc(&b, bytes));
            CK(cudaMemset(b, 1, bytes));
        }
        const float flat = median_us([&](int s, cudaStream_t st) { read_flat<<<sms * 8, 256, 0, st>>>(reinterpret_cast<const uint4*>(bufs[s]), bytes / 16, sink); }, sets);
        const float un = median_us([&](int s, cudaStream_t st) { units<<<sms * 2, 128, kUnitsSmem, st>>>(bufs[s], sh.n, sh.k, sink); }, sets);
        std::printf("| %s | flat | %.2f | %.0f |\n| %s | units | %.2f | %.0f |\n", sh.name, flat, bytes / flat / 1e3, sh.name, un, bytes / un / 1e3);
        for (auto& b : bufs) CK(cudaFree(b));
    }
    return 0;
}
