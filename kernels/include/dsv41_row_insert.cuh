// dsv41_row_insert.cuh: the kernel and launch dispatch shared by the row insert launchers
// (window_insert.cu, compressed_insert.cu, index_key_insert.cu).
//
// rope_insert_kernel<D, ROWS, N, Q>: one warp per row, ROWS rows per warp (warp_rows of
// dsv41_row.cuh): load, optional weighted RMSNorm (N), RoPE of the last dims, optional fake quant
// (Q), store of the bf16 row into cache[slot] (skipped for slot < 0). The launchers differ only in
// which N and quantizer they accept.
//
// launch_rope_insert<N, QOn>(p, s): grid = insert_blocks(T, ROWS), kInsertThreads threads, D =
// p.head_dim, ROWS = with_insert_rows<D>(T, memory bound), Q = Quant::None when p.quant is
// DSV41_QUANT_NONE, else QOn. The caller has validated p (check_insert_params, quant, norm).
#pragma once

#include "dsv41_row.cuh"

namespace dsv41 {

// grid.x = ceil(T / (8 * ROWS)), block = 256 threads (8 warps, ROWS rows each); with
// N = Norm::Weighted 8*D*4 bytes of shared memory (the squares of the norm).
template <int D, int ROWS, Norm N, Quant Q>
__global__ void __launch_bounds__(kInsertThreads) rope_insert_kernel(const Dsv41RowInsertParams p) {
    auto finish = [&](const RowIn<D>& r, float (&x)[D / 32]) {
        if constexpr (Q != Quant::None) fake_quant_row<D, Q>(x);
        __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.cache) + r.slot * p.cache_row_stride;
        if (r.slot >= 0) store_bf16<D / 32>(dst + (threadIdx.x & 31) * (D / 32), x);
    };
    if constexpr (N == Norm::None) {
        warp_rows<D, ROWS, N>(p, nullptr, finish);
    } else {
        __shared__ float squares[kInsertWarps][D];
        warp_rows<D, ROWS, N>(p, squares[threadIdx.x / 32], finish);
    }
}

template <Norm N, Quant QOn>
int launch_rope_insert(const Dsv41RowInsertParams& p, cudaStream_t s) {
    return with_head_dim(p.head_dim, [&](auto d) -> int {
        constexpr int D = decltype(d)::value;
        return with_insert_rows<D>(p.num_tokens, true, [&](auto rows) -> int {
            constexpr int ROWS = decltype(rows)::value;
            const dim3 grid(insert_blocks(p.num_tokens, ROWS));
            if (p.quant == DSV41_QUANT_NONE)
                rope_insert_kernel<D, ROWS, N, Quant::None><<<grid, kInsertThreads, 0, s>>>(p);
            else
                rope_insert_kernel<D, ROWS, N, QOn><<<grid, kInsertThreads, 0, s>>>(p);
            return static_cast<int>(cudaGetLastError());
        });
    });
}

}  // namespace dsv41
