// window_insert: the window (SWA) KV path of every layer (spec §4.3), fused:
//
//   k_w = fq_Q1( RoPE(p)(kv[t]) )  ->  cache[slot[t]]          (or no fake quant)
//
// for T tokens of any number of sequences in one launch. Each token brings its own slot (a row
// index into a [S, D] bf16 cache: a ring slot p mod W, a paged slot, ...) and its own cos/sin
// row (the angles of its position p, computed on the host side by the crate's RopeTable, so the
// kernel needs no position and no trigonometry and reproduces the CPU bit for bit).
//
// Design: one warp per token (dsv41_row.cuh). Memory traffic is the minimum: one read of the
// kv row (2D bytes), the cos/sin row (2R bytes, shared by all layers of a step) and the slot,
// one write of the cache row (2D bytes); no intermediate leaves registers.
//
// Numerics (Q1, spec §2.3, quant::fake_quant::QatFormat::Fp8Ue8m0B32): RoPE in f32 with separate
// roundings (candle-nn rope_i), rounded to bf16; per block of 32: amax floored to 1e-4,
// s = 2^ceil(log2(amax/448)) from the f32 bits, q = e4m3_rne(clamp(x/s, +-448)) with an IEEE
// division, value q*s (exact in bf16, the sign of zero kept).
#include "include/dsv41_row.cuh"

namespace dsv41 {

// grid.x = ceil(T / 4), block = 128 threads (4 warps, one token each).
template <int D, Quant Q>
__global__ void __launch_bounds__(kThreadsPerBlock) window_insert_kernel(const Dsv41RowInsertParams p) {
    const int t = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
    if (t >= p.num_tokens) return;
    insert_row<D, Q, Norm::None>(p, t, threadIdx.x % 32, nullptr);
}

}  // namespace dsv41

// ------------------------------------------------------------------------------------ launcher

extern "C" int dsv41_window_insert(const Dsv41RowInsertParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    int status = check_insert_params(p, params_size);
    if (status != DSV41_OK || p->num_tokens == 0) return status;
    if (p->apply_norm) return DSV41_ERR_QUANT;
    const dim3 grid(blocks_for_rows(p->num_tokens));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return with_head_dim(p->head_dim, [&](auto d) -> int {
        constexpr int D = decltype(d)::value;
        switch (p->quant) {
            case DSV41_QUANT_NONE: window_insert_kernel<D, Quant::None><<<grid, kThreadsPerBlock, 0, s>>>(*p); break;
            case DSV41_QUANT_FP8_UE8M0_B32:
                window_insert_kernel<D, Quant::Fp8Ue8m0B32><<<grid, kThreadsPerBlock, 0, s>>>(*p);
                break;
            default: return DSV41_ERR_QUANT;
        }
        return static_cast<int>(cudaGetLastError());
    });
}
