// window_insert: the window (SWA) KV path of every layer (spec §4.3), fused:
//
//   k_w = fq_Q1( RoPE(p)(kv[t]) )  ->  cache[slot[t]]          (or no fake quant)
//
// for T tokens of any number of sequences in one launch. Each token brings its own slot (a row
// index into a [S, D] bf16 cache: a ring slot p mod W, a paged slot, ...) and its own cos/sin
// row (the angles of its position p, computed on the host side by the crate's RopeTable, so the
// kernel needs no position and no trigonometry and reproduces the CPU bit for bit).
//
// Design: one warp per token, ROWS tokens per warp with all their loads issued first
// (dsv41_row.cuh, warp_rows). Memory traffic is the minimum: one read of the kv row (2D bytes),
// the cos/sin row (4R bytes) and the slot, one write of the cache row (2D bytes); no
// intermediate leaves registers. The per-element quant has no division (dsv41_numerics.cuh).
//
// Numerics (Q1, spec §2.3, quant::fake_quant::QatFormat::Fp8Ue8m0B32): RoPE in f32 with separate
// roundings (candle-nn rope_i), rounded to bf16; per block of 32: amax floored to 1e-4,
// s = 2^ceil(log2(amax/448)) from the f32 bits, q = e4m3_rne(clamp(x/s, +-448)) with an IEEE
// division, value q*s (exact in bf16, the sign of zero kept).
#include "include/dsv41_row.cuh"

namespace dsv41 {

// grid.x = ceil(T / (8 * ROWS)), block = 256 threads (8 warps, ROWS tokens each).
template <int D, int ROWS, Quant Q>
__global__ void __launch_bounds__(kInsertThreads) window_insert_kernel(const Dsv41RowInsertParams p) {
    warp_rows<D, ROWS, Norm::None>(p, nullptr, [&](const RowIn<D>& r, float (&x)[D / 32]) {
        if constexpr (Q != Quant::None) fake_quant_row<D, Q>(x);
        __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.cache) + r.slot * p.cache_row_stride;
        if (r.slot >= 0) store_bf16<D / 32>(dst + (threadIdx.x & 31) * (D / 32), x);
    });
}

}  // namespace dsv41

// ------------------------------------------------------------------------------------ launcher

extern "C" int dsv41_window_insert(const Dsv41RowInsertParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    int status = check_insert_params(p, params_size);
    if (status != DSV41_OK || p->num_tokens == 0) return status;
    if (p->apply_norm) return DSV41_ERR_QUANT;
    if (p->quant != DSV41_QUANT_NONE && p->quant != DSV41_QUANT_FP8_UE8M0_B32) return DSV41_ERR_QUANT;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return with_head_dim(p->head_dim, [&](auto d) -> int {
        constexpr int D = decltype(d)::value;
        return with_insert_rows<D>(p->num_tokens, true, [&](auto rows) -> int {
            constexpr int ROWS = decltype(rows)::value;
            const dim3 grid(insert_blocks(p->num_tokens, ROWS));
            if (p->quant == DSV41_QUANT_NONE)
                window_insert_kernel<D, ROWS, Quant::None><<<grid, kInsertThreads, 0, s>>>(*p);
            else
                window_insert_kernel<D, ROWS, Quant::Fp8Ue8m0B32><<<grid, kInsertThreads, 0, s>>>(*p);
            return static_cast<int>(cudaGetLastError());
        });
    });
}
