// page_rows: the batched decode step's top-k entries mapped to rows of the kv source's page pool
// (attention::page_rows; docs/architecture.md, "The cache pool"): entry j of sequence b lives at
//   table[b][j / P]·P + j mod P,   −1 (no entry) kept,
// in one launch instead of the Candle gather and its nine integer kernels (with their allocations
// and shape uploads) per index source and step; bit for bit those ops (attention::page_rows_ref)
// for every entry inside the pages a sequence holds, checked in tests/cuda_decoder_ops.rs. An
// entry past the table's width (which the step never selects) gives −1 instead of reading past
// the row.
//
// Design: one thread per (b, i), rows·k threads. Integer arithmetic only.
#include <cuda_runtime.h>

#include "include/dsv41_page_rows.h"

namespace dsv41 {

constexpr int kPageRowsThreads = 256;

__global__ void __launch_bounds__(kPageRowsThreads) page_rows_kernel(Dsv41PageRowsParams p) {
    const int64_t e = static_cast<int64_t>(blockIdx.x) * kPageRowsThreads + threadIdx.x;
    if (e >= p.rows * p.k) return;
    const int64_t b = e / p.k;
    const int64_t j = p.topk[e];
    const int64_t page = j / p.page;
    p.out[e] = (j < 0 || page >= p.max_pages) ? -1 : p.page_table[b * p.max_pages + page] * p.page + (j - page * p.page);
}

}  // namespace dsv41

extern "C" int dsv41_page_rows(const Dsv41PageRowsParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41PageRowsParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->rows < 0 || p->k < 1 || p->max_pages < 1 || p->page < 1) return DSV41_ERR_SHAPE;
    const int64_t n = p->rows * p->k;
    if (n / kPageRowsThreads >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    if (n == 0) return DSV41_OK;
    if (!p->topk || !p->page_table || !p->out) return DSV41_ERR_NULL;
    const dim3 grid(static_cast<unsigned>((n + kPageRowsThreads - 1) / kPageRowsThreads));
    page_rows_kernel<<<grid, kPageRowsThreads, 0, static_cast<cudaStream_t>(stream)>>>(*p);
    return static_cast<int>(cudaGetLastError());
}
