// group_diagonal: the diagonal blocks of a grouped product computed as one stacked product.
// nn::GroupedLinear multiplies G groups of T rows stacked group-major, y = [G·T, G·og], with the
// whole weight (one weight stream at decode sizes); group g's outputs are the block at rows g·T..,
// columns g·og... This gathers them into out[t, g·og + j] = y[g·T + t, g·og + j] — a copy, bit
// exact — in one launch instead of G narrow + concatenation copies (V4.1-Flash's wo_a: G = 8).
//
// Design: one thread per output element (T·G·og of them), 2-byte or 4-byte elements.
#include <cuda_runtime.h>
#include <stdint.h>

#include "include/dsv41_group_diagonal.h"


namespace dsv41 {

constexpr int kDiagThreads = 256;

template <typename E>
__global__ void __launch_bounds__(kDiagThreads) group_diagonal_kernel(Dsv41GroupDiagonalParams p) {
    const int64_t e = static_cast<int64_t>(blockIdx.x) * kDiagThreads + threadIdx.x;
    const int64_t width = p.groups * p.og;
    if (e >= p.t * width) return;
    const int64_t t = e / width, c = e % width, g = c / p.og;
    static_cast<E*>(p.out)[e] = static_cast<const E*>(p.y)[(g * p.t + t) * width + c];
}

}  // namespace dsv41

extern "C" int dsv41_group_diagonal(const Dsv41GroupDiagonalParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41GroupDiagonalParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->t < 1 || p->og < 1 || p->groups < 1 || (p->elem != 2 && p->elem != 4)) return DSV41_ERR_SHAPE;
    if (p->og > INT64_MAX / p->groups / p->t) return DSV41_ERR_SHAPE;
    const int64_t n = p->t * p->groups * p->og;
    if (n / kDiagThreads >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    if (!p->y || !p->out) return DSV41_ERR_NULL;
    const dim3 grid(static_cast<unsigned>((n + kDiagThreads - 1) / kDiagThreads));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (p->elem == 2) group_diagonal_kernel<uint16_t><<<grid, kDiagThreads, 0, s>>>(*p);
    else group_diagonal_kernel<uint32_t><<<grid, kDiagThreads, 0, s>>>(*p);
    return static_cast<int>(cudaGetLastError());
}
