// q_rope: the query path's RoPE (spec §4.2): GPT-J rotation of the last R dims of every head of
// q [T, H, D] at its token's position, in place or into a separate tensor, optionally after a
// weightless per-head RMSNorm (V4.0's "qnorm"; V4.1 does not use it: spec §4.2).
//
// Two kernels:
//  * q_rope_tail_kernel (in place, no norm): touches only the rotated tail. A thread owns C = 8
//    (or 2) consecutive tail elements of one (token, head) row: one 16-byte load and store, its
//    C/2 cos/sin pairs, no shuffles. For V4.1 (D = 512, R = 64) that moves 2*R of the 2*D bytes
//    per head: 1/8 of a full-row pass.
//  * q_rope_row_kernel (norm, or out of place): one warp per (token, head) row through the
//    shared row pipeline (dsv41_row.cuh).
//
// Numerics: as nn::rope::apply_rope_tail on the CPU (f32 products and sums with one rounding
// each, no FMA, then bf16); the optional norm as nn::rms_norm::rms_normalize_f32 (candle's AVX2
// summation order) followed by a bf16 rounding, before RoPE.
#include "include/dsv41_row.cuh"

namespace dsv41 {

// grid.x = ceil(T*H*(R/C) / 128), block = 128 threads, one C-element tail chunk each.
template <int C>
__global__ void __launch_bounds__(kThreadsPerBlock) q_rope_tail_kernel(const Dsv41QRopeParams p) {
    const int chunks = p.rope_dim / C;
    const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (g >= static_cast<int64_t>(p.num_tokens) * p.num_heads * chunks) return;
    const int c = static_cast<int>(g % chunks);
    const int64_t row = g / chunks;
    const int64_t h = row % p.num_heads;
    const int64_t t = row / p.num_heads;
    __nv_bfloat16* x_ptr = static_cast<__nv_bfloat16*>(p.out) + t * p.out_token_stride + h * p.out_head_stride +
                           (p.head_dim - p.rope_dim) + c * C;
    float x[C];
    load_bf16<C>(x_ptr, x);
    const int64_t cs = t * (p.rope_dim / 2) + c * (C / 2);
#pragma unroll
    for (int k = 0; k < C / 2; ++k) rotate_pair(x[2 * k], x[2 * k + 1], p.cos[cs + k], p.sin[cs + k]);
    store_bf16<C>(x_ptr, x);
}

// grid.x = ceil(T*H / 4), block = 128 threads (4 warps, one (token, head) row each).
template <int D, bool NORM>
__global__ void __launch_bounds__(kThreadsPerBlock) q_rope_row_kernel(const Dsv41QRopeParams p) {
    __shared__ float squares[NORM ? kWarpsPerBlock : 1][NORM ? D : 1];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
    if (row >= static_cast<int64_t>(p.num_tokens) * p.num_heads) return;
    const int64_t h = row % p.num_heads;
    const int64_t t = row / p.num_heads;
    float x[D / 32];
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.q) + t * p.q_token_stride + h * p.q_head_stride;
    load_bf16<D / 32>(src + lane * (D / 32), x);
    if constexpr (NORM)
        rms_norm_row<D, Norm::Weightless>(x, lane, squares[warp], [](int) { return 1.0f; }, p.norm_eps,
                                          p.norm_inv_dim);
    const int64_t half = p.rope_dim / 2;
    rope_row<D>(x, lane, p.rope_dim, p.cos + t * half, p.sin + t * half);
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) + t * p.out_token_stride + h * p.out_head_stride;
    store_bf16<D / 32>(dst + lane * (D / 32), x);
}

}  // namespace dsv41

// ------------------------------------------------------------------------------------ launcher

namespace {

bool tail_aligned(const Dsv41QRopeParams* p, int c) {
    const int first = p->head_dim - p->rope_dim;
    const uintptr_t base = reinterpret_cast<uintptr_t>(p->out) + 2 * static_cast<uintptr_t>(first);
    return p->rope_dim % c == 0 && first % c == 0 && base % (2 * c) == 0 && p->out_token_stride % c == 0 &&
           p->out_head_stride % c == 0;
}

}  // namespace

extern "C" int dsv41_q_rope(const Dsv41QRopeParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41QRopeParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_tokens < 0 || p->num_heads < 0) return DSV41_ERR_SHAPE;
    const int d = p->head_dim;
    if (d != 64 && d != 128 && d != 256 && d != 512) return DSV41_ERR_HEAD_DIM;
    if (p->rope_dim <= 0 || p->rope_dim % 2 != 0 || p->rope_dim > d) return DSV41_ERR_ROPE_DIM;
    const int64_t rows = static_cast<int64_t>(p->num_tokens) * p->num_heads;
    if (rows == 0) return DSV41_OK;
    if (!p->q || !p->out || !p->cos || !p->sin) return DSV41_ERR_NULL;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool in_place =
        p->q == p->out && p->q_token_stride == p->out_token_stride && p->q_head_stride == p->out_head_stride;
    if (in_place && !p->apply_norm) {
        const int c = tail_aligned(p, 8) ? 8 : (tail_aligned(p, 2) ? 2 : 0);
        if (c == 0) return DSV41_ERR_ALIGNMENT;
        const int64_t threads = rows * (p->rope_dim / c);
        const dim3 grid(static_cast<unsigned>((threads + kThreadsPerBlock - 1) / kThreadsPerBlock));
        if (c == 8) q_rope_tail_kernel<8><<<grid, kThreadsPerBlock, 0, s>>>(*p);
        else q_rope_tail_kernel<2><<<grid, kThreadsPerBlock, 0, s>>>(*p);
        return static_cast<int>(cudaGetLastError());
    }
    const int align = 2 * (d / 32 < 8 ? d / 32 : 8);
    if (!aligned_rows(p->q, p->q_token_stride, align) || !aligned_rows(p->q, p->q_head_stride, align) ||
        !aligned_rows(p->out, p->out_token_stride, align) || !aligned_rows(p->out, p->out_head_stride, align))
        return DSV41_ERR_ALIGNMENT;
    const dim3 grid(blocks_for_rows(rows));
    return with_head_dim(d, [&](auto dd) -> int {
        constexpr int D = decltype(dd)::value;
        if (p->apply_norm) q_rope_row_kernel<D, true><<<grid, kThreadsPerBlock, 0, s>>>(*p);
        else q_rope_row_kernel<D, false><<<grid, kThreadsPerBlock, 0, s>>>(*p);
        return static_cast<int>(cudaGetLastError());
    });
}
