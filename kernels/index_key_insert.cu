// index_key_insert: the lightning-indexer keys of a kv-source layer (spec §6.2, §5.4):
//
//   k_j = fq_Q3( RoPE(j*r)( k_norm(k_pre_j) ) )  ->  cache[slot_j]
//
// where k_pre_j = latent_j . wk^T ([G, D_I] bf16, D_I = 128 in V4.1) is computed by the caller,
// k_norm is the RMSNorm with its learned weight (eps 1e-20 in V4.1) and RoPE rotates the last R
// dims (64..127 in V4.1) with the angles of the group's first position j*r.
//
// Design: one warp per key, ROWS keys per warp with their loads issued first (dsv41_row.cuh);
// the norm's sum of squares is staged through D floats of shared memory per warp so that the
// reduction order equals candle's CPU order.
//
// Numerics: norm in f32 exactly as the crate's nn::RmsNorm on the CPU (x / sqrt(mean(x^2) + eps)
// * w, candle's AVX2 summation order), rounded to bf16; RoPE in f32, rounded to bf16; Q3
// (quant::fake_quant::QatFormat::Fp4Ue8m0B32) per block of 32: amax floored to 6*2^-126,
// s = 2^ceil(log2(amax/6)), q = e2m1 (ties to even code) of clamp(x/s, +-6), value q*s.
#include "include/dsv41_row.cuh"

namespace dsv41 {

// grid.x = ceil(G / (8 * ROWS)), block = 256 threads (8 warps, ROWS keys each), 8*D*4 bytes of
// shared memory. Q = Quant::None stores the normed, RoPE'd keys unquantized (reference numerics
// with QAT off).
template <int D, int ROWS, Quant Q>
__global__ void __launch_bounds__(kInsertThreads) index_key_insert_kernel(const Dsv41RowInsertParams p) {
    __shared__ float squares[kInsertWarps][D];
    warp_rows<D, ROWS, Norm::Weighted>(p, squares[threadIdx.x / 32], [&](const RowIn<D>& r, float (&x)[D / 32]) {
        if constexpr (Q != Quant::None) fake_quant_row<D, Q>(x);
        __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.cache) + r.slot * p.cache_row_stride;
        if (r.slot >= 0) store_bf16<D / 32>(dst + (threadIdx.x & 31) * (D / 32), x);
    });
}

}  // namespace dsv41

// ------------------------------------------------------------------------------------ launcher

extern "C" int dsv41_index_key_insert(const Dsv41RowInsertParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    int status = check_insert_params(p, params_size);
    if (status != DSV41_OK || p->num_tokens == 0) return status;
    if ((p->quant != DSV41_QUANT_FP4_UE8M0_B32 && p->quant != DSV41_QUANT_NONE) || !p->apply_norm) return DSV41_ERR_QUANT;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return with_head_dim(p->head_dim, [&](auto d) -> int {
        constexpr int D = decltype(d)::value;
        return with_insert_rows<D>(p->num_tokens, true, [&](auto rows) -> int {
            constexpr int ROWS = decltype(rows)::value;
            const dim3 grid(insert_blocks(p->num_tokens, ROWS));
            if (p->quant == DSV41_QUANT_NONE)
                index_key_insert_kernel<D, ROWS, Quant::None><<<grid, kInsertThreads, 0, s>>>(*p);
            else
                index_key_insert_kernel<D, ROWS, Quant::Fp4Ue8m0B32><<<grid, kInsertThreads, 0, s>>>(*p);
            return static_cast<int>(cudaGetLastError());
        });
    });
}
