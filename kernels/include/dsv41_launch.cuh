// Host-side launch helpers shared by the launchers (the sparse attention ones, kernels/fp8_linear*.cu,
// fp8_gemm.cu, moe_experts*.cu): scratch alignment and the SM count, the dynamic shared-memory limit raised
// once per device and thread, resident CTAs per SM, the diagnostic trace buffer cleared, a launch with programmatic
// dependent launch (the grid may start while the previous kernel of the stream finishes; every
// kernel launched this way waits in griddepcontrol.wait before its first global access) and an
// optional thread-block cluster, and a persistent grid (a CTA per SM) launched that way.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <utility>

namespace dsv41_launch {

// 256-byte alignment of scratch offsets.
inline int64_t align256(int64_t v) { return (v + 255) & ~int64_t{255}; }

// The current device's SM count (132 if the query fails).
inline int sm_count() {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) {
        cudaGetLastError();
        return 132;
    }
    return sms;
}


// Raises `kernel`'s dynamic shared-memory limit to `max_smem` bytes when `configured_dev` (the
// caller's thread_local memo for this kernel) is not `dev`; per-device attributes are re-applied
// when a later call runs on another device.
template <class Kernel>
inline cudaError_t set_max_dynamic_smem(Kernel* kernel, int dev, int max_smem, int& configured_dev) {
    if (configured_dev == dev) return cudaSuccess;
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
    if (e == cudaSuccess) configured_dev = dev;
    return e;
}

// Resident CTAs per SM of `Kernel` with `threads` threads and `smem` bytes of dynamic shared
// memory (its limit raised to `smem` once per device and thread); 1 if a query fails.
template <auto Kernel>
inline int resident_per_sm(int threads, int smem) {
    static thread_local int configured_dev = -1, per_sm = 1;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        cudaGetLastError();
        return 1;
    }
    if (configured_dev != dev) {
        int n = 0;
        if (set_max_dynamic_smem(Kernel, dev, smem, configured_dev) != cudaSuccess ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, smem) != cudaSuccess) {
            cudaGetLastError();
            configured_dev = -1;
            return 1;
        }
        per_sm = n > 0 ? n : 1;
    }
    return per_sm;
}

// Zeroes `bytes` of the device symbol `trace` on `stream` (diagnostics: errors are ignored, the
// trace then shows stale stamps).
template <class Symbol>
inline void clear_trace(const Symbol& trace, size_t bytes, cudaStream_t stream) {
    void* buf = nullptr;
    if (cudaGetSymbolAddress(&buf, trace) == cudaSuccess) cudaMemsetAsync(buf, 0, bytes, stream);
}

// Copies the trace symbol `trace` (`bytes`) into `h` after synchronising `stream` and returns the
// clock rate of device `dev` in kHz, or 0 when any step failed (the caller then prints nothing).
template <class Symbol>
inline int read_trace(const Symbol& trace, long long* h, size_t bytes, cudaStream_t stream, int dev) {
    int khz = 0;
    if (cudaStreamSynchronize(stream) != cudaSuccess || cudaMemcpyFromSymbol(h, trace, bytes) != cudaSuccess ||
        cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) != cudaSuccess || khz <= 0)
        return 0;
    return khz;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization
// allowed, as a cluster of (1, cluster_y, 1) CTAs when cluster_y > 1. Returns the launch error,
// else the last error.
template <class... Params, class... Args>
inline cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int cluster_y,
                              Args&&... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    int nattr = 0;
    if (cluster_y > 1) {
        attr[nattr].id = cudaLaunchAttributeClusterDimension;
        attr[nattr].val.clusterDim.x = 1;
        attr[nattr].val.clusterDim.y = cluster_y;
        attr[nattr].val.clusterDim.z = 1;
        ++nattr;
    }
    attr[nattr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[nattr].val.programmaticStreamSerializationAllowed = 1;
    ++nattr;
    cfg.attrs = attr;
    cfg.numAttrs = nattr;
    cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
    if (e == cudaSuccess) e = cudaGetLastError();
    return e;
}

// Launches the persistent kernel `Kernel` (one CTA of `block` threads per SM, `smem` bytes of
// dynamic shared memory) with launch_pdl, its dynamic shared-memory limit raised to `max_smem`
// first on each device and thread (the memo is per kernel: one per instantiation).
template <auto Kernel, class... Args>
inline cudaError_t launch_persistent(dim3 block, size_t smem, int max_smem, cudaStream_t stream, Args&&... args) {
    static thread_local int configured_dev = -1;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = set_max_dynamic_smem(Kernel, dev, max_smem, configured_dev);
    if (e != cudaSuccess) return e;
    return launch_pdl(Kernel, dim3(sm_count()), block, smem, stream, 1, std::forward<Args>(args)...);
}

}  // namespace dsv41_launch
