// engram_next: the inputs of a decode step that follows the last one on the device
// (model::engram_next, ModelDecodeStep::update_next; spec §9.4 for the hash): for row r of the
// first `rows`, with t = sampled[r] and c = map[t] (its compressed id),
//   buf[r]                              = t
//   ids of Engram layer l, column (s−1)·heads + k, s = 1 .. ngram−1:
//       rolling_s = (c·m_0) ^ (h_{g−1}·m_1) ^ ... ^ (h_{g−s}·m_s)   (u64, wrapping; g = ngram − 1)
//       id        = rolling_s mod prime[col] + offset[col]
//   history h (the row's last g compressed ids, oldest first, pads before the sequence start)
//       shifted by one, c last.
// The CPU reference is model::engram_next::next_ids_ref (itself checked against the host hash,
// EngramHasher::hash); tests/cuda_engram_next.rs compares the two bit for bit.
//
// Why a kernel: without it the host must read every step's sampled ids before it can hash the
// next step's Engram ids, and the GPU waits for that round trip between two steps.
//
// Design: one CTA per row, one thread per (layer, column) output, at least one warp. Each thread
// reads the lookback it needs (c and the history) before a CTA barrier; threads 0 .. g−1 then
// write the shifted history (the value each writes was read before the barrier), thread 0 the
// token. Integer arithmetic only: bit for bit the reference.
#include <cuda_runtime.h>

#include "include/dsv41_engram_next.h"

namespace dsv41 {

constexpr int kEngramNextMaxThreads = 1024;

__global__ void engram_next_kernel(const Dsv41EngramNextParams p) {
    const int r = blockIdx.x, t = threadIdx.x;
    const uint32_t tok = p.sampled[r];
    if (p.layers == 0) {
        if (t == 0) p.buf[r] = tok;
        return;
    }
    const int g = p.ngram - 1;
    uint32_t* hist = p.buf + p.batch + static_cast<int64_t>(p.layers) * p.batch * p.cols + static_cast<int64_t>(r) * g;
    const uint32_t c = p.map[tok < static_cast<uint32_t>(p.vocab) ? tok : p.vocab - 1];
    uint32_t id = 0;
    const bool computes = t < p.layers * p.cols;
    int l = 0, col = 0;
    if (computes) {
        l = t / p.cols;
        col = t - l * p.cols;
        const int s_max = col / p.heads + 1;
        const int64_t* tab = p.tables + static_cast<int64_t>(l) * (p.ngram + 2 * p.cols);
        uint64_t rolling = static_cast<uint64_t>(c) * static_cast<uint64_t>(tab[0]);
        for (int s = 1; s <= s_max; ++s) rolling ^= static_cast<uint64_t>(hist[g - s]) * static_cast<uint64_t>(tab[s]);
        id = static_cast<uint32_t>(rolling % static_cast<uint64_t>(tab[p.ngram + col]) + static_cast<uint64_t>(tab[p.ngram + p.cols + col]));
    }
    const uint32_t shifted = t < g ? (t + 1 < g ? hist[t + 1] : c) : 0u;
    __syncthreads();  // every read of the history is done
    if (computes) p.buf[p.batch + (static_cast<int64_t>(l) * p.batch + r) * p.cols + col] = id;
    if (t < g) hist[t] = shifted;
    if (t == 0) p.buf[r] = tok;
}

}  // namespace dsv41

extern "C" int dsv41_engram_next(const Dsv41EngramNextParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41EngramNextParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->rows < 0 || p->batch < p->rows || p->layers < 0) return DSV41_ERR_SHAPE;
    if (p->layers > 0 && (p->ngram < 2 || p->heads < 1 || p->cols != (p->ngram - 1) * p->heads || p->vocab < 1)) return DSV41_ERR_SHAPE;
    const int64_t work = static_cast<int64_t>(p->layers) * p->cols;
    if (work > kEngramNextMaxThreads || work < 0) return DSV41_ERR_SHAPE;
    if (p->rows == 0) return DSV41_OK;
    if (!p->sampled || !p->buf || (p->layers > 0 && (!p->map || !p->tables))) return DSV41_ERR_NULL;
    int threads = static_cast<int>((work + 31) / 32 * 32);
    const int hist_threads = p->layers > 0 ? (p->ngram - 1 + 31) / 32 * 32 : 32;
    if (threads < hist_threads) threads = hist_threads;
    if (threads > kEngramNextMaxThreads) return DSV41_ERR_SHAPE;
    engram_next_kernel<<<p->rows, threads, 0, static_cast<cudaStream_t>(stream)>>>(*p);
    return static_cast<int>(cudaGetLastError());
}
