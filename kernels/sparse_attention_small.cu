// sparse_attention_small: sparse attention with a per-head sink (spec §4.7) for the head dims the
// FlashMLA-style kernels (kernels/sparse_attention*.cu, d = 512) do not take - the small configs,
// e.g. the embedded model's 128 - in one launch instead of the ~28 Candle kernels of
// attention::sparse_attention_candle (gathers, masks, the softmax, two products, casts) per layer.
// Token t, head h attends to the valid rows of [kv_a[idx_a[t]] ; kv_b[idx_b[t]]] (an index < 0 or
// past its source is none; duplicates count twice), K = V = the row:
//
//   l_s = scale · (q[t,h] · kv[s])                  f32
//   out = Σ_s e^{l_s − m}·kv[s] / (Σ_s e^{l_s − m} + e^{sink[h] − m})
//
// computed as the CPU reference computes it (attention::sparse_attention_ref): the valid rows in
// index order, in blocks of 64 valid rows (SOFTMAX_BLOCK); per block the running max m (from
// −1e30) is raised to the block's max, the denominator and the output are multiplied by
// e^{m_old − m}, then for each row in order p = e^{l − m} is added to the denominator (f32) and
// bf16(p)·kv to the output (a rounded product, then a rounded sum); the sink term is added last;
// the output is divided by the denominator (zeros when it is 0 or not finite) and rounded to bf16.
// Differences from the reference: the dot products' f32 summation order (lane-strided, then a
// butterfly) and expf's last bit; the golden checks' tolerances cover both.
//
// Design: one CTA of 128 threads per (token, head) (grid t·h); q in shared memory as f32. The index lists
// are read in chunks of 128 (one per thread), the valid rows compacted in order (warp ballots)
// into a buffer; every 64 buffered rows are a block: the 4 warps compute its logits (a row per
// warp at a time, lanes over d), 64 threads its probabilities, one thread the denominator in
// order, and each thread the running outputs of its dims (c = tid + 128 i, i < 4). The kv rows
// are read twice (logits, then outputs; the second time from L2). Small-model sizes only: at
// d = 512 the FlashMLA-style kernels are the fast path.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "include/dsv41_sparse_attention_small.h"

namespace dsv41 {
namespace sa_small {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kBlock = 64;                  // SOFTMAX_BLOCK of the reference
constexpr int kDims = DSV41_SA_SMALL_MAX_DIM / kThreads;
constexpr int kBuf = kBlock + kThreads;     // buffered valid rows: < 64 left + a chunk of 128

__global__ void __launch_bounds__(kThreads) sparse_attention_small_kernel(const Dsv41SparseAttentionSmallParams p) {
    __shared__ float qs[DSV41_SA_SMALL_MAX_DIM];
    __shared__ const __nv_bfloat16* rows[kBuf];
    __shared__ float logit[kBlock], prob[kBlock], prob_bf[kBlock];
    __shared__ int warp_count[kWarps];
    __shared__ float alpha_s, den_s;
    const int h = static_cast<int>(blockIdx.x % p.h), t = static_cast<int>(blockIdx.x / p.h), tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.q) + (static_cast<int64_t>(t) * p.h + h) * p.d;
    for (int c = tid; c < p.d; c += kThreads) qs[c] = __bfloat162float(q[c]);
    const __nv_bfloat16* kva = static_cast<const __nv_bfloat16*>(p.kv_a);
    const __nv_bfloat16* kvb = static_cast<const __nv_bfloat16*>(p.kv_b);
    const int64_t* ia = p.idx_a ? p.idx_a + static_cast<int64_t>(t) * p.ka : nullptr;
    const int64_t* ib = p.idx_b ? p.idx_b + static_cast<int64_t>(t) * p.kb : nullptr;

    float acc[kDims];
#pragma unroll
    for (int i = 0; i < kDims; ++i) acc[i] = 0.0f;
    float m = -1e30f, den = 0.0f;  // den: thread 0's; m: every thread's (identical)
    int buffered = 0;              // uniform across the CTA

    // One block of nb <= 64 buffered rows (rows[0..nb)).
    auto block = [&](int nb) {
        for (int j = warp; j < nb; j += kWarps) {
            const __nv_bfloat16* r = rows[j];
            float s = 0.0f;
            for (int c = lane; c < p.d; c += 32) s = fmaf(qs[c], __bfloat162float(r[c]), s);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
            if (lane == 0) logit[j] = __fmul_rn(p.scale, s);
        }
        __syncthreads();
        float m_new = m;
        for (int j = 0; j < nb; ++j) m_new = fmaxf(m_new, logit[j]);
        if (tid < nb) {
            const float e = expf(__fsub_rn(logit[tid], m_new));
            prob[tid] = e;
            prob_bf[tid] = __bfloat162float(__float2bfloat16_rn(e));
        }
        if (tid == 0) alpha_s = expf(__fsub_rn(m, m_new));
        __syncthreads();
        const float alpha = alpha_s;
        if (tid == 0) {
            den = __fmul_rn(den, alpha);
            for (int j = 0; j < nb; ++j) den = __fadd_rn(den, prob[j]);
        }
#pragma unroll
        for (int i = 0; i < kDims; ++i) {
            const int c = tid + kThreads * i;
            if (c >= p.d) break;
            float o = __fmul_rn(acc[i], alpha);
            for (int j = 0; j < nb; ++j) o = __fadd_rn(o, __fmul_rn(prob_bf[j], __bfloat162float(rows[j][c])));
            acc[i] = o;
        }
        m = m_new;
        __syncthreads();  // rows, logits and probabilities are rewritten next
    };

    const int total = p.ka + p.kb;
    for (int base = 0; base < total; base += kThreads) {
        // This thread's entry of the chunk, valid or not.
        const int e = base + tid;
        const __nv_bfloat16* row = nullptr;
        if (e < p.ka) {
            const int64_t i = ia[e];
            if (i >= 0 && i < p.na) row = kva + i * p.d;
        } else if (e < total) {
            const int64_t i = ib[e - p.ka];
            if (i >= 0 && i < p.nb) row = kvb + i * p.d;
        }
        // Compaction in index order: the rank among the chunk's valid entries.
        const unsigned ballot = __ballot_sync(0xffffffffu, row != nullptr);
        if (lane == 0) warp_count[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, chunk_valid = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            before += w < warp ? warp_count[w] : 0;
            chunk_valid += warp_count[w];
        }
        if (row) rows[buffered + before + __popc(ballot & ((1u << lane) - 1u))] = row;
        __syncthreads();
        buffered += chunk_valid;
        while (buffered >= kBlock) {
            block(kBlock);
            buffered -= kBlock;
            // Move the rest (< 128) to the front; every thread read warp_count before this point.
            const __nv_bfloat16* moved = tid < buffered ? rows[kBlock + tid] : nullptr;
            __syncthreads();
            if (tid < buffered) rows[tid] = moved;
            __syncthreads();
        }
    }
    if (buffered > 0) block(buffered);

    if (tid == 0) den_s = __fadd_rn(den, expf(__fsub_rn(p.sink[h], m)));
    __syncthreads();
    const float d_all = den_s;
    const bool ok = d_all > 0.0f && isfinite(d_all);
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + (static_cast<int64_t>(t) * p.h + h) * p.d;
#pragma unroll
    for (int i = 0; i < kDims; ++i) {
        const int c = tid + kThreads * i;
        if (c >= p.d) break;
        out[c] = __float2bfloat16_rn(ok ? __fdiv_rn(acc[i], d_all) : 0.0f);
    }
}

}  // namespace sa_small
}  // namespace dsv41

extern "C" int dsv41_sparse_attention_small(const Dsv41SparseAttentionSmallParams* p, size_t params_size, void* stream) {
    using namespace dsv41::sa_small;
    if (params_size != sizeof(Dsv41SparseAttentionSmallParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->t < 0 || p->h < 1 || p->h > 65535 || p->d < 1 || p->d > DSV41_SA_SMALL_MAX_DIM || p->ka < 0 || p->kb < 0 || p->na < 0 || p->nb < 0)
        return DSV41_ERR_SHAPE;
    if (p->ka > INT32_MAX - p->kb - kThreads || static_cast<int64_t>(p->t) * p->h > INT32_MAX) return DSV41_ERR_SHAPE;
    if (p->t == 0) return DSV41_OK;
    if (!p->q || !p->sink || !p->out || (p->ka > 0 && (!p->idx_a || !p->kv_a)) || (p->kb > 0 && (!p->idx_b || !p->kv_b))) return DSV41_ERR_NULL;
    Dsv41SparseAttentionSmallParams a = *p;
    if (a.ka == 0) a.idx_a = nullptr;
    if (a.kb == 0) a.idx_b = nullptr;
    sparse_attention_small_kernel<<<static_cast<unsigned>(a.t * a.h), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
    return static_cast<int>(cudaGetLastError());
}
