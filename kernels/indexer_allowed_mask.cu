// indexer_allowed_mask: the allowed-block bitmask of a candidate consumer (spec §6.4) from the
// kept candidate blocks of its source: bit b of row t set iff block b is among row t's kept
// blocks (ids < 0 and ids past the mask are ignored). The scores kernel (indexer_scores.cu)
// reads it to leave disallowed entries at -inf.
//
// Design: one CTA of 256 threads per token; the row's mask is built in shared memory with
// atomicOr (kept ids may repeat) and then stored with one word per thread and iteration.
#include <cuda_runtime.h>
#include <stdint.h>

#include "include/dsv41_indexer.h"

namespace dsv41_ix {

__global__ void __launch_bounds__(256) allowed_mask_kernel(const Dsv41IndexerMaskParams p) {
    extern __shared__ uint32_t bits[];
    const int64_t t = blockIdx.x;
    for (int i = threadIdx.x; i < p.words; i += blockDim.x) bits[i] = 0u;
    __syncthreads();
    const int64_t* row = p.blocks + t * p.n_blocks;
    for (int i = threadIdx.x; i < p.n_blocks; i += blockDim.x) {
        const int64_t b = row[i];
        if (b >= 0 && b < 32LL * p.words) atomicOr(&bits[b / 32], 1u << (b % 32));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < p.words; i += blockDim.x) p.allowed[t * p.words + i] = bits[i];
}

}  // namespace dsv41_ix

extern "C" int dsv41_indexer_allowed_mask(const Dsv41IndexerMaskParams* p, size_t params_size, void* stream) {
    using namespace dsv41_ix;
    if (params_size != sizeof(Dsv41IndexerMaskParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_tokens < 0 || p->n_blocks < 0 || p->words < 1 || p->words > 12288) return DSV41_ERR_SHAPE;
    if (p->num_tokens == 0) return DSV41_OK;
    if (!p->allowed || (p->n_blocks > 0 && !p->blocks)) return DSV41_ERR_NULL;
    allowed_mask_kernel<<<p->num_tokens, 256, sizeof(uint32_t) * p->words, static_cast<cudaStream_t>(stream)>>>(*p);
    return static_cast<int>(cudaGetLastError());
}
