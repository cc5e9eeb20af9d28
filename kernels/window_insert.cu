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
#include "include/dsv41_row_insert.cuh"

// The kernel: rope_insert_kernel<D, ROWS, Norm::None, Q> (dsv41_row_insert.cuh).

// ------------------------------------------------------------------------------------ launcher

extern "C" int dsv41_window_insert(const Dsv41RowInsertParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    int status = check_insert_params(p, params_size);
    if (status != DSV41_OK || p->num_tokens == 0) return status;
    if (p->apply_norm) return DSV41_ERR_QUANT;
    if (p->quant != DSV41_QUANT_NONE && p->quant != DSV41_QUANT_FP8_UE8M0_B32) return DSV41_ERR_QUANT;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return launch_rope_insert<Norm::None, Quant::Fp8Ue8m0B32>(*p, s);
}
