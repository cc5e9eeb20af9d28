// compress_pool: the ratio-2 compressor's pooling and carry update of the batched decode step
// (spec §5; attention::decode_batch, "inserts") in one launch. Per sequence b and dimension d,
// with the carried token (kv0, s0) and this one (kv1, s1):
//   m = max(s0, s1); e_j = exp(s_j − m); a_j = e_j / (e0 + e1)
//   pooled = bf16(a0·kv0 + a1·kv1)
//   carry  = closing ? (kv0, s0) : (kv1, s1)     (kept where the group closes, else this token)
// bit for bit the Candle op sequence it replaces (stack, softmax = max, sub, exp, sum, div;
// product, sum, bf16 cast; two where_cond): about twenty kernels and their allocations per kv
// source and step, checked in tests/cuda_decoder_ops.rs.
//
// Why a kernel: a decode step of a small batch is bound by its kernel count (the captured step of
// the embedded model is ~700 kernels), and this is the largest run of glue ops in a kv source.
//
// Design: one thread per (b, d), rows·dim threads; every output element written.
//
// Numerics (candle's kernels, operation by operation, nothing contracted into an FMA):
//   * max is fmaxf; the subtraction, the two-term sums, the division and the products are single
//     IEEE roundings (__fsub_rn, __fadd_rn, __fdiv_rn, __fmul_rn); a two-term sum does not depend
//     on its order, but candle's sums start from +0, so the pool is (+0 + p0) + p1: a product of
//     −0 (a weight that underflowed to 0 times a negative value) gives +0 as there;
//   * exp is expf (candle's expg for f32);
//   * the bf16 cast rounds to nearest even.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "include/dsv41_compress_pool.h"

namespace dsv41 {

constexpr int kPoolThreads = 256;

__global__ void __launch_bounds__(kPoolThreads) compress_pool_kernel(Dsv41CompressPoolParams p) {
    const int64_t e = static_cast<int64_t>(blockIdx.x) * kPoolThreads + threadIdx.x;
    if (e >= p.rows * p.dim) return;
    const int64_t b = e / p.dim;
    const float kv0 = p.carry_kv[e], s0 = p.carry_score[e];
    const float kv1 = p.kv[e], s1 = p.score[e];
    const float m = fmaxf(s0, s1);
    const float e0 = expf(__fsub_rn(s0, m));
    const float e1 = expf(__fsub_rn(s1, m));
    const float den = __fadd_rn(e0, e1);
    const float a0 = __fdiv_rn(e0, den), a1 = __fdiv_rn(e1, den);
    // candle's sum starts from +0: a −0 product becomes +0 before the second term is added.
    const float pooled = __fadd_rn(__fadd_rn(0.0f, __fmul_rn(a0, kv0)), __fmul_rn(a1, kv1));
    static_cast<__nv_bfloat16*>(p.pooled)[e] = __float2bfloat16_rn(pooled);
    const bool keep = p.closing[b] != 0;
    p.new_kv[e] = keep ? kv0 : kv1;
    p.new_score[e] = keep ? s0 : s1;
}

}  // namespace dsv41

extern "C" int dsv41_compress_pool(const Dsv41CompressPoolParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41CompressPoolParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->rows < 0 || p->dim < 1) return DSV41_ERR_SHAPE;
    const int64_t n = p->rows * p->dim;
    if (n / kPoolThreads >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    if (n == 0) return DSV41_OK;
    if (!p->carry_kv || !p->carry_score || !p->kv || !p->score || !p->closing || !p->pooled || !p->new_kv || !p->new_score) return DSV41_ERR_NULL;
    const dim3 grid(static_cast<unsigned>((n + kPoolThreads - 1) / kPoolThreads));
    compress_pool_kernel<<<grid, kPoolThreads, 0, static_cast<cudaStream_t>(stream)>>>(*p);
    return static_cast<int>(cudaGetLastError());
}
