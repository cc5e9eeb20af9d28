// Warp-level scans shared by the kernels (the indexer's balanced grid and top-k, the sparse
// attention's index compaction). Header-only, inlined: each use compiles to the same five
// shuffle-up steps as a hand-written loop.
#pragma once
#include <cuda_runtime.h>

namespace dsv41_warp {

// Inclusive prefix sum of `v` over the lanes of a full warp (all 32 lanes must call it):
// lane l gets v[0] + … + v[l]. `lane` = threadIdx.x % 32. T: an integer type.
template <typename T>
__device__ __forceinline__ T inclusive_sum(T v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xFFFFFFFFu, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

}  // namespace dsv41_warp
