// mhc_norm: an mHC collapse and the sublayer's RMSNorm after it (spec §3.2, §2.1) in one launch,
// optionally with the mHC post that produces the stream first — bit for bit the kernels it
// replaces (kernels/decoder_ops.cu: mhc_post, collapse, rms_norm, each itself bit for bit the
// Candle ops), one launch instead of two or three:
//
//   collapse_norm:  c[t, :]   = cast(Σ_k f32(x[t, k, :]) · pre[t, k])            (k ascending)
//                   out[t, :] = cast(c / sqrt(mean(c²) + eps) · w)
//   post_norm:      x1[t, j, :] = cast(post[t, j] · f32(y[t, :]) + Σ_i comb[t, i, j] · f32(x[t, i, :]))
//                   out[t, :]   = collapse_norm of x1 with pre
//
// The decoder uses post_norm where a sublayer's post is followed by the next sublayer's collapse
// and norm (the collapse weights `pre` are known before the post: the staggered wiring of spec
// §3.2), and collapse_norm where the stream comes from elsewhere (the embedding, an Engram mix).
//
// Design: one block per token row, candle's reduction block size for d (norm_block). Each thread
// computes its columns' stream values (post_norm: written out) and the collapsed value c,
// rounded to x's dtype, kept in shared memory (d f32, d ≤ DSV41_MHC_NORM_MAX_D); then candle's
// row sum of the squares of c in its order (candle_row_sum with the row's element offset t·d, as
// the norm kernel sees a fresh [T, d] collapse output) and the normed row. The stream rows are
// read once per output copy (hc² loads per column, from L1 after the first).
//
// Numerics: every product and sum is __fmul_rn / __fadd_rn / __fmaf_rn exactly where the replaced
// kernels have them (decoder_ops.cu's header), the intermediate roundings to x's dtype included,
// so the outputs equal the unfused kernels' bit for bit (tests/cuda_decoder_ops.rs).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "include/dsv41_candle_sum.cuh"
#include "include/dsv41_float_io.cuh"
#include "include/dsv41_mhc_norm.h"

namespace dsv41 {
namespace mhc_norm {

// The normed row of the collapsed values col[0..d) into out[t, :].
template <typename X>
__device__ void norm_row(const Dsv41MhcNormParams& p, int64_t t, const float* col) {
    const int d = p.d;
    const float sum = candle_row_sum(t * d, d, [&](int64_t j) { return __fmul_rn(col[j], col[j]); });
    const float r = rms_root(sum, p.mean_mul, p.eps);
    X* out = static_cast<X*>(p.out) + t * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) store_as(out, c, __fmul_rn(__fdiv_rn(col[c], r), p.weight[c]));
}

template <typename X>
__global__ void collapse_norm_kernel(const Dsv41MhcNormParams p) {
    extern __shared__ float col[];
    const int64_t t = blockIdx.x;
    const int hc = p.hc, d = p.d;
    const X* x = static_cast<const X*>(p.x) + t * hc * d;
    const float* pre = p.pre + t * hc;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float s = 0.0f;
        for (int k = 0; k < hc; ++k) s = __fadd_rn(s, __fmul_rn(load_f32(x, static_cast<int64_t>(k) * d + c), pre[k]));
        col[c] = rounded_as(x, s);
    }
    // candle_row_sum starts with a barrier: col is complete before it is read.
    norm_row<X>(p, t, col);
}

template <typename X, typename Y>
__global__ void post_norm_kernel(const Dsv41MhcNormParams p) {
    extern __shared__ float col[];
    const int64_t t = blockIdx.x;
    const int hc = p.hc, d = p.d;
    const X* x = static_cast<const X*>(p.x) + t * hc * d;
    const Y* y = static_cast<const Y*>(p.y) + t * d;
    const float* comb = p.comb + t * hc * hc;
    const float* post = p.post + t * hc;
    const float* pre = p.pre + t * hc;
    X* x1 = static_cast<X*>(p.stream_out) + t * hc * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const float yc = load_f32(y, c);
        float s = 0.0f;
        for (int j = 0; j < hc; ++j) {
            // mhc_post_kernel's element (t, j, c), then collapse_kernel's term j.
            float mixed = __fmul_rn(comb[j], load_f32(x, c));
            for (int i = 1; i < hc; ++i) mixed = __fmaf_rn(comb[i * hc + j], load_f32(x, static_cast<int64_t>(i) * d + c), mixed);
            const float v = __fadd_rn(__fmul_rn(post[j], yc), mixed);
            store_as(x1, static_cast<int64_t>(j) * d + c, v);
            s = __fadd_rn(s, __fmul_rn(rounded_as(x1, v), pre[j]));
        }
        col[c] = rounded_as(x1, s);
    }
    norm_row<X>(p, t, col);
}

inline int check(const Dsv41MhcNormParams* p, size_t params_size, bool post) {
    if (params_size != sizeof(Dsv41MhcNormParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->tokens < 0 || p->tokens >= (int64_t{1} << 31) || p->hc < 1 || p->hc > DSV41_MHC_NORM_MAX_HC || p->d < 1 || p->d > DSV41_MHC_NORM_MAX_D)
        return DSV41_ERR_SHAPE;
    if (p->tokens == 0) return DSV41_OK;
    if (!p->x || !p->pre || !p->weight || !p->out) return DSV41_ERR_NULL;
    if (post && (!p->comb || !p->y || !p->post || !p->stream_out)) return DSV41_ERR_NULL;
    return 1;  // launch
}

}  // namespace mhc_norm
}  // namespace dsv41

extern "C" int dsv41_mhc_collapse_norm(const Dsv41MhcNormParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    using namespace dsv41::mhc_norm;
    const int c = check(p, params_size, false);
    if (c != 1) return c;
    const dim3 grid(static_cast<unsigned>(p->tokens));
    const size_t smem = static_cast<size_t>(p->d) * sizeof(float);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (p->x_f32) collapse_norm_kernel<float><<<grid, norm_block(p->d), smem, s>>>(*p);
    else collapse_norm_kernel<__nv_bfloat16><<<grid, norm_block(p->d), smem, s>>>(*p);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int dsv41_mhc_post_norm(const Dsv41MhcNormParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    using namespace dsv41::mhc_norm;
    const int c = check(p, params_size, true);
    if (c != 1) return c;
    const dim3 grid(static_cast<unsigned>(p->tokens));
    const unsigned block = norm_block(p->d);
    const size_t smem = static_cast<size_t>(p->d) * sizeof(float);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    using bf = __nv_bfloat16;
    switch ((p->x_f32 ? 2 : 0) | (p->y_f32 ? 1 : 0)) {
        case 0: post_norm_kernel<bf, bf><<<grid, block, smem, s>>>(*p); break;
        case 1: post_norm_kernel<bf, float><<<grid, block, smem, s>>>(*p); break;
        case 2: post_norm_kernel<float, bf><<<grid, block, smem, s>>>(*p); break;
        default: post_norm_kernel<float, float><<<grid, block, smem, s>>>(*p); break;
    }
    return static_cast<int>(cudaGetLastError());
}
