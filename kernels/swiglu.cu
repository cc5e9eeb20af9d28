// swiglu: the MoE experts' activation (spec §8) between w1/w3 and w2 in one launch:
//   out = cast(silu(min(g, L)) · clamp(u, −L, L) · w)   computed in f32, w the row's routing weight
// bit for bit the Candle op sequence of model::moe::Expert (two f32 casts, minimum, clamp =
// maximum + minimum, silu, product, broadcast product, bf16 cast: 9 kernels plus the uploads of
// the scalar bounds and of the broadcast strides; checked in tests/cuda_decoder_ops.rs).
//
// Why a kernel: a decode step runs this for every selected and shared expert of every layer,
// and the step of a small model is bound by launches, not arithmetic.
//
// Design: one thread per element, grid-stride free (rows·inter threads).
//
// Numerics (candle's kernels, operation by operation, nothing contracted into an FMA):
//   * min / max are fminf / fmaxf against (float)L and (float)(−L);
//   * silu(x) = x / (1 + expf(−x)) with an IEEE division (candle's silu_fwd for f32);
//   * the two products are separate __fmul_rn roundings, in the order (silu · up) · w;
//   * the output cast is round-to-nearest-even.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "include/dsv41_float_io.cuh"
#include "include/dsv41_swiglu.h"

namespace dsv41 {

constexpr int kSwigluThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kSwigluThreads) swiglu_kernel(Dsv41SwigluParams p) {
    const int64_t e = static_cast<int64_t>(blockIdx.x) * kSwigluThreads + threadIdx.x;
    if (e >= p.rows * p.inter) return;
    float g = load_f32(static_cast<const T*>(p.gate), e);
    float u = load_f32(static_cast<const T*>(p.up), e);
    if (p.clamp) {
        g = fminf(g, p.limit);
        u = fminf(fmaxf(u, -p.limit), p.limit);
    }
    const float s = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    float a = __fmul_rn(s, u);
    if (p.weight) a = __fmul_rn(a, p.weight[e / p.inter]);
    store_as(static_cast<T*>(p.out), e, a);
}

}  // namespace dsv41

extern "C" int dsv41_swiglu(const Dsv41SwigluParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41SwigluParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->rows < 0 || p->inter < 1 || (p->clamp && !(p->limit > 0.0f))) return DSV41_ERR_SHAPE;
    const int64_t n = p->rows * p->inter;
    if (n / kSwigluThreads >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    if (n == 0) return DSV41_OK;
    if (!p->gate || !p->up || !p->out) return DSV41_ERR_NULL;
    const dim3 grid(static_cast<unsigned>((n + kSwigluThreads - 1) / kSwigluThreads));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (p->x_f32) swiglu_kernel<float><<<grid, kSwigluThreads, 0, s>>>(*p);
    else swiglu_kernel<__nv_bfloat16><<<grid, kSwigluThreads, 0, s>>>(*p);
    return static_cast<int>(cudaGetLastError());
}
