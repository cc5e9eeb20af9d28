// step_inputs: the position-derived inputs of the batched decode step (attention::decode_inputs,
// DecodeStepInputs::derive) in one launch, from the integer rows the update uploaded:
//   cos / sin / −sin      = cos / sin / −sin of f32(p)·inv_freq           (RoPE rows at p)
//   window_indices[b][k]  = (p + 1 + k) mod W + b·W'  when p + 1 + k ≥ W, else −1
//                          (the ring slots of positions p − W + 1 ..= p, ascending; k = 0 .. W−1
//                          counts the offsets 1 ..= W)
//   entry_cos / entry_sin = the RoPE rows at the closing entry's position   (compressed layers)
//   closing = entry_slot ≥ 0,  visible = (u32) visible
// bit for bit the Candle op sequence it replaces (cast, product, sin, cos, neg; the window's
// integer broadcast ops; ge; cast: ~16 kernels per inputs object, ~27 for a kv source's, with
// their allocations and shape uploads), checked in tests/cuda_decoder_ops.rs.
//
// Why a kernel: the step runs it for every inputs object (one per kv source) inside its graph,
// and a small batch's step is bound by its kernel count.
//
// Design: one thread per output element of the widest row set: rows·max(half, window) threads;
// thread (b, i) writes element i of each of row b's outputs that has one.
//
// Numerics: f32(p) is the round-to-nearest conversion of the i64 position (candle's cast), the
// angle one __fmul_rn, then cosf / sinf (candle's cosg / sing for f32, no fast math), −sin a sign
// flip; the window and the flags are integer arithmetic.
#include <cuda_runtime.h>

#include "include/dsv41_step_inputs.h"

namespace dsv41 {

constexpr int kStepInputsThreads = 256;

__global__ void __launch_bounds__(kStepInputsThreads) step_inputs_kernel(Dsv41StepInputsParams p, int32_t width) {
    const int64_t e = static_cast<int64_t>(blockIdx.x) * kStepInputsThreads + threadIdx.x;
    if (e >= p.rows * width) return;
    const int64_t b = e / width;
    const int32_t i = static_cast<int32_t>(e - b * width);
    const int64_t pos = p.positions[b];
    if (i < p.half) {
        const float f = p.inv_freq[i];
        const float a = __fmul_rn(static_cast<float>(pos), f);
        const float s = sinf(a);
        p.cos[b * p.half + i] = cosf(a);
        p.sin[b * p.half + i] = s;
        p.neg_sin[b * p.half + i] = -s;
        if (p.entry_cos) {
            const float ae = __fmul_rn(static_cast<float>(p.entry_positions[b]), f);
            p.entry_cos[b * p.half + i] = cosf(ae);
            p.entry_sin[b * p.half + i] = sinf(ae);
        }
    }
    if (i < p.window) {
        const int64_t q = pos + 1 + i;
        p.window_indices[b * p.window + i] = q >= p.window ? q % p.window + b * p.window_stride : -1;
    }
    if (i == 0 && p.closing) {
        p.closing[b] = p.entry_slots[b] >= 0 ? 1 : 0;
        p.visible[b] = static_cast<uint32_t>(p.visible_in[b]);
    }
}

}  // namespace dsv41

extern "C" int dsv41_step_inputs(const Dsv41StepInputsParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41StepInputsParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->rows < 0 || p->half < 1 || p->window < 1 || p->window_stride < p->window) return DSV41_ERR_SHAPE;
    const int32_t width = p->half > p->window ? p->half : p->window;
    const int64_t n = p->rows * width;
    if (n / kStepInputsThreads >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    if (n == 0) return DSV41_OK;
    if (!p->positions || !p->inv_freq || !p->cos || !p->sin || !p->neg_sin || !p->window_indices) return DSV41_ERR_NULL;
    const bool compressed = p->entry_cos != nullptr;
    if (compressed && (!p->entry_positions || !p->entry_slots || !p->visible_in || !p->entry_sin || !p->closing || !p->visible)) return DSV41_ERR_NULL;
    if (!compressed && (p->entry_sin || p->closing || p->visible)) return DSV41_ERR_NULL;
    const dim3 grid(static_cast<unsigned>((n + kStepInputsThreads - 1) / kStepInputsThreads));
    step_inputs_kernel<<<grid, kStepInputsThreads, 0, static_cast<cudaStream_t>(stream)>>>(*p, width);
    return static_cast<int>(cudaGetLastError());
}
