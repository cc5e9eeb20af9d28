// compressed_insert: the compressed KV entries of a kv-source layer (spec §4.4 step 3, §5.4):
//
//   c_j = fq_Q2( RoPE(j*r)(latent_j) )  ->  cache[slot_j]
//
// for the G group-closing tokens of a call (any number of sequences). The latent is the
// compressor's RMSNorm'ed, pre-RoPE bf16 output [G, D]; the cos/sin rows are those of the
// group's FIRST position j*r (spec §2.2), prepared on the host side by the crate's RopeTable.
//
// Design: identical to window_insert (one warp per entry, ROWS entries per warp with their loads
// issued first, registers only, dsv41_row.cuh); only the quantizer differs.
//
// Numerics (Q2, quant::fake_quant::QatFormat::Fp4E4m3B16): RoPE in f32 rounded to bf16; per
// block of 16: amax floored to 6*2^-9, s = min(e4m3_rne(amax/6), 448) with an IEEE division,
// q = e2m1 (ties to the even code) of clamp(x/s, +-6), value q*s, exact in bf16; negative values
// rounding to zero give -0.0.
#include "include/dsv41_row_insert.cuh"

// The kernel: rope_insert_kernel<D, ROWS, Norm::None, Q> (dsv41_row_insert.cuh).

// ------------------------------------------------------------------------------------ launcher

extern "C" int dsv41_compressed_insert(const Dsv41RowInsertParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    int status = check_insert_params(p, params_size);
    if (status != DSV41_OK || p->num_tokens == 0) return status;
    if ((p->quant != DSV41_QUANT_FP4_E4M3_B16 && p->quant != DSV41_QUANT_NONE) || p->apply_norm) return DSV41_ERR_QUANT;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return launch_rope_insert<Norm::None, Quant::Fp4E4m3B16>(*p, s);
}
