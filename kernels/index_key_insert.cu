// index_key_insert: the lightning-indexer keys of a kv-source layer (spec §6.2, §5.4):
//
//   k_j = fq_Q3( RoPE(j*r)( k_norm(k_pre_j) ) )  ->  cache[slot_j]
//
// where k_pre_j = latent_j . wk^T ([G, D_I] bf16, D_I = 128 in V4.1) is computed by the caller,
// k_norm is the RMSNorm with its learned weight (eps 1e-20 in V4.1) and RoPE rotates the last R
// dims (64..127 in V4.1) with the angles of the group's first position j*r.
//
// Design: one warp per key (dsv41_row.cuh); the norm's sum of squares is staged through 4*D
// floats of shared memory so that the reduction order equals candle's CPU order.
//
// Numerics: norm in f32 exactly as the crate's nn::RmsNorm on the CPU (x / sqrt(mean(x^2) + eps)
// * w, candle's AVX2 summation order), rounded to bf16; RoPE in f32, rounded to bf16; Q3
// (quant::fake_quant::QatFormat::Fp4Ue8m0B32) per block of 32: amax floored to 6*2^-126,
// s = 2^ceil(log2(amax/6)), q = e2m1 (ties to even code) of clamp(x/s, +-6), value q*s.
#include "include/dsv41_row.cuh"

namespace dsv41 {

// grid.x = ceil(G / 4), block = 128 threads (4 warps, one key each), 4*D*4 bytes of shared memory.
// Q = Quant::None stores the normed, RoPE'd keys unquantized (reference numerics with QAT off).
template <int D, Quant Q>
__global__ void __launch_bounds__(kThreadsPerBlock) index_key_insert_kernel(const Dsv41RowInsertParams p) {
    __shared__ float squares[kWarpsPerBlock][D];
    const int warp = threadIdx.x / 32;
    const int t = blockIdx.x * kWarpsPerBlock + warp;
    if (t >= p.num_tokens) return;
    insert_row<D, Q, Norm::Weighted>(p, t, threadIdx.x % 32, squares[warp]);
}

}  // namespace dsv41

// ------------------------------------------------------------------------------------ launcher

extern "C" int dsv41_index_key_insert(const Dsv41RowInsertParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    int status = check_insert_params(p, params_size);
    if (status != DSV41_OK || p->num_tokens == 0) return status;
    if ((p->quant != DSV41_QUANT_FP4_UE8M0_B32 && p->quant != DSV41_QUANT_NONE) || !p->apply_norm) return DSV41_ERR_QUANT;
    const dim3 grid(blocks_for_rows(p->num_tokens));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return with_head_dim(p->head_dim, [&](auto d) -> int {
        constexpr int D = decltype(d)::value;
        if (p->quant == DSV41_QUANT_NONE) index_key_insert_kernel<D, Quant::None><<<grid, kThreadsPerBlock, 0, s>>>(*p);
        else index_key_insert_kernel<D, Quant::Fp4Ue8m0B32><<<grid, kThreadsPerBlock, 0, s>>>(*p);
        return static_cast<int>(cudaGetLastError());
    });
}
