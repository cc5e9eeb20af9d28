// index_key_insert: the lightning-indexer keys of a kv-source layer (spec §6.2, §5.4):
//
//   k_j = fq_Q3( RoPE(j*r)( k_norm(k_pre_j) ) )  ->  cache[slot_j]
//
// where k_pre_j = latent_j . wk^T ([G, D_I] bf16, D_I = 128 in V4.1) is computed by the caller,
// k_norm is the RMSNorm with its learned weight (eps 1e-20 in V4.1) and RoPE rotates the last R
// dims (64..127 in V4.1) with the angles of the group's first position j*r.
//
// Design: for the V4.1 shape (D = 128, R = 64) a quarter warp per key, a persistent grid whose
// warps prefetch their next 4 keys while computing the current ones (dsv41_row128.cuh), the
// RoPE'd key kept as bf16 pairs and fake-quantized two values per instruction (q3_fake_quant_pair
// of dsv41_numerics.cuh, 7 instructions per pair instead of ~11 per element), the rare paths out
// of line. Other
// shapes: one warp per key, ROWS keys per warp with their loads issued first (dsv41_row.cuh);
// the norm's sum of squares is staged through D floats of shared memory per warp so that the
// reduction order equals candle's CPU order. Both compute the same operations in the same order.
//
// Numerics: norm in f32 exactly as the crate's nn::RmsNorm on the CPU (x / sqrt(mean(x^2) + eps)
// * w, candle's AVX2 summation order), rounded to bf16; RoPE in f32, rounded to bf16; Q3
// (quant::fake_quant::QatFormat::Fp4Ue8m0B32) per block of 32: amax floored to 6*2^-126,
// s = 2^ceil(log2(amax/6)), q = e2m1 (ties to even code) of clamp(x/s, +-6), value q*s.
#include "include/dsv41_row128.cuh"
#include "include/dsv41_row_insert.cuh"

// The generic path: rope_insert_kernel<D, ROWS, Norm::Weighted, Q> (dsv41_row_insert.cuh).

namespace dsv41 {

// The f32 element path of a key (a block scale above 2^119), out of line (see dsv41_row128.cuh).
struct Row128H8 { uint32_t h[8]; };
static __device__ __noinline__ Row128H8 q3_fake_quant_element8(Row128H8 hh, uint32_t a0, uint32_t a1) {
    constexpr Quant Q = Quant::Fp4Ue8m0B32;
    const uint32_t amax2[2] = {a0, a1};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const BlockScale b = pow2_scale(q3_block_k_row128(amax2, i / 2));
        hh.h[i] = pack_bf16x2_rn(fake_quant_element<Q>(bf16x2_lo(hh.h[i]), b), fake_quant_element<Q>(bf16x2_hi(hh.h[i]), b));
    }
    return hh;
}

// The D = 128, R = 64 path: grid = row128_grid, block = 256 threads (8 warps, 4 keys per warp
// and row set). Q3 on bf16 pairs (q3_fake_quant_pair); a lane whose row has a block scale above
// 2^119 takes the f32 element path for that row.
template <Quant Q>
__global__ void __launch_bounds__(kInsertThreads, kRow128BlocksPerSm) index_key_insert_row128_kernel(const Dsv41RowInsertParams p) {
    row128_loop<Norm::Weighted>(p, [&](const Row128In& r, const float* w, int, int j, auto&& prefetch) {
        uint32_t h[8], amax2[2];
        // the norm etc., and the next set's loads (rows and slot right after the quotient: the
        // schedule options of dsv41_row128.cuh, 7.09 -> 6.87 us at G = 32768)
        compute_row128<Norm::Weighted, kRow128TreeMin | kRow128EarlyRows>(r, w, p.norm_eps, p.norm_inv_dim, j, h,
                                                                          amax2, prefetch);
        if constexpr (Q != Quant::None) {
            const Q3Blocks qb = q3_blocks_row128(amax2);
            if (qb.pairs_ok) {
#pragma unroll
                for (int i = 0; i < 8; ++i) h[i] = q3_fake_quant_pair(h[i], q3_pair_from_bits2(qb.sb[i / 4], (i / 2) & 1));
            } else {  // the element path, out of line
                Row128H8 hh;
#pragma unroll
                for (int i = 0; i < 8; ++i) hh.h[i] = h[i];
                hh = q3_fake_quant_element8(hh, amax2[0], amax2[1]);
#pragma unroll
                for (int i = 0; i < 8; ++i) h[i] = hh.h[i];
            }
        }
        if (r.slot >= 0) {
            __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.cache) + r.slot * p.cache_row_stride + 4 * j;
#pragma unroll
            for (int m = 0; m < 4; ++m) *reinterpret_cast<uint2*>(dst + 32 * m) = make_uint2(h[2 * m], h[2 * m + 1]);
        }
    });
}

template <Quant Q>
int launch_row128(const Dsv41RowInsertParams& p, cudaStream_t s) {
    const unsigned grid = row128_grid<index_key_insert_row128_kernel<Q>>((static_cast<int64_t>(p.num_tokens) + 3) / 4);
    index_key_insert_row128_kernel<Q><<<grid, kInsertThreads, 0, s>>>(p);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace dsv41

// ------------------------------------------------------------------------------------ launcher

extern "C" int dsv41_index_key_insert(const Dsv41RowInsertParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    int status = check_insert_params(p, params_size);
    if (status != DSV41_OK || p->num_tokens == 0) return status;
    if ((p->quant != DSV41_QUANT_FP4_UE8M0_B32 && p->quant != DSV41_QUANT_NONE) || !p->apply_norm) return DSV41_ERR_QUANT;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (row128_applies(*p))
        return p->quant == DSV41_QUANT_NONE ? launch_row128<Quant::None>(*p, s) : launch_row128<Quant::Fp4Ue8m0B32>(*p, s);
    return launch_rope_insert<Norm::Weighted, Quant::Fp4Ue8m0B32>(*p, s);
}
