// sparse_attention: sparse attention with a per-head sink over two gathered KV sources (spec
// §4.6-§4.7, §0.1b.6), decode design, bf16 rows.
//
// For token t, head h and the valid rows s of [kv_window[idx_window[t]] ; kv_extra[idx_extra[t]]]
// (in that order, duplicates kept):
//
//   l_s = scale * (q[t,h] . kv[s])                       f32
//   out = sum_s e^{l_s - m} kv[s] / (sum_s e^{l_s - m} + e^{sink[h] - m})      -> bf16
//   lse = m + ln sum_s e^{l_s - m}                        (sink excluded; -inf for an empty row)
//
// Numerics follow the crate's reference `attention::sparse_attention_ref` exactly in structure:
// the valid indices are first compacted (holes removed), then processed in blocks of 64 valid
// rows; per block the running max starts at the -1e30 floor and is updated with the block's
// max, the accumulators and the f32 denominator are rescaled by e^{m_old - m_new}, the
// probabilities p = e^{l - m_new} are summed in f32 into the denominator and rounded to bf16
// for P.V, rows accumulated in index order. Output = acc / (den + e^{sink - m}), zero when that
// is 0 or not finite (empty row), rounded to bf16. Differences to the CPU: the order of the
// 512-term dot products and of the per-block denominator sums (f32 rounding only), and expf.
//
// Design (decode, memory bound): one CTA per (token, group of 16 heads), 256 threads. Every
// gathered row is loaded once per CTA with 16-byte loads into shared memory and serves all 16
// heads of the group (the 4 CTAs of a 64-head token run side by side and share the rows in L2).
//   1. warp 0 compacts the valid indices of both sources into row pointers (ballot + popc);
//      the other warps stage q (f32) in shared memory.
//   2. per block of 64 rows: cooperative 16-byte gather of the rows into shared memory;
//      logits: a warp per row, each lane 16 dims x 16 heads, a transposing butterfly reduction
//      (16 shuffles per row for 16 heads); softmax bookkeeping: a warp per 2 heads;
//      P.V: a thread per (8 dims, 4 heads), 32 f32 accumulators in registers.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "include/dsv41_sparse_attention.h"

namespace dsv41_sa {

constexpr int D = 512;        // head dim (row width)
constexpr int BLK = 64;       // softmax block (reference SOFTMAX_BLOCK)
constexpr int HG = 16;        // heads per CTA
constexpr int THREADS = 256;  // 8 warps
constexpr int WARPS = THREADS / 32;
constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
constexpr float M_FLOOR = -1e30f;

// Shared memory: q f32 [HG][D] | rows bf16 [BLK][D] | logits/p f32 [BLK][HG] | alpha, m, den
// f32 [HG] | row pointers [Kw + Kc].
constexpr size_t SMEM_Q = sizeof(float) * HG * D;
constexpr size_t SMEM_KV = sizeof(__nv_bfloat16) * BLK * D;
constexpr size_t SMEM_P = sizeof(float) * BLK * HG;
constexpr size_t SMEM_STATS = sizeof(float) * 4 * HG;
constexpr size_t SMEM_FIXED = SMEM_Q + SMEM_KV + 2 * SMEM_P + SMEM_STATS + 16;

__device__ __forceinline__ int64_t load_index(const void* base, int64_t i, int bytes) {
    return bytes == 8 ? static_cast<const int64_t*>(base)[i] : static_cast<int64_t>(static_cast<const int32_t*>(base)[i]);
}

__device__ __forceinline__ void bf16x8_to_f32(const uint4 v, float* f) {
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 x = __bfloat1622float2(b[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

// grid = (ceil(H / HG), T), block = THREADS, dynamic smem = SMEM_FIXED + 8 * (Kw + Kc).
__global__ void __launch_bounds__(THREADS) sparse_attention_decode_kernel(const Dsv41SparseAttentionParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* q_s = reinterpret_cast<float*>(smem);
    __nv_bfloat16* kv_s = reinterpret_cast<__nv_bfloat16*>(smem + SMEM_Q);
    float* l_s = reinterpret_cast<float*>(smem + SMEM_Q + SMEM_KV);       // logits [BLK][HG]
    float* p_s = l_s + BLK * HG;                                          // bf16-rounded p [BLK][HG]
    float* alpha_s = p_s + BLK * HG;                                      // [HG]
    float* m_s = alpha_s + HG;                                            // [HG]
    float* den_s = m_s + HG;                                              // [HG]
    int* count_s = reinterpret_cast<int*>(den_s + HG);                    // [1]
    const uint4** rows_s = reinterpret_cast<const uint4**>(smem + SMEM_FIXED);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t = blockIdx.y;
    const int h0 = blockIdx.x * HG;
    const int nh = min(HG, p.num_heads - h0);

    // 1. Compaction of the valid indices (warp 0) and q staging (all threads).
    if (warp == 0) {
        const int ktot = p.kw + p.kc;
        int count = 0;
        for (int base = 0; base < ktot; base += 32) {
            const int i = base + lane;
            const uint4* ptr = nullptr;
            if (i < p.kw) {
                const int64_t s = load_index(p.idx_window, static_cast<int64_t>(t) * p.kw + i, p.index_bytes);
                if (s >= 0 && s < p.num_window_rows)
                    ptr = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.kv_window) + s * p.window_row_stride);
            } else if (i < ktot) {
                const int j = i - p.kw;
                const int64_t s = load_index(p.idx_extra, static_cast<int64_t>(t) * p.kc + j, p.index_bytes);
                if (s >= 0 && s < p.num_extra_rows)
                    ptr = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.kv_extra) + s * p.extra_row_stride);
            }
            const unsigned ballot = __ballot_sync(0xffffffffu, ptr != nullptr);
            if (ptr) rows_s[count + __popc(ballot & ((1u << lane) - 1u))] = ptr;
            count += __popc(ballot);
        }
        if (lane == 0) *count_s = count;
    }
    for (int c = tid; c < HG * CHUNKS; c += THREADS) {
        const int h = c / CHUNKS, col = c % CHUNKS;
        float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (h < nh) {
            const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.q) + t * p.q_token_stride +
                                                            (h0 + h) * p.q_head_stride + col * 8);
            bf16x8_to_f32(v, f);
        }
        float4* dst = reinterpret_cast<float4*>(q_s + h * D + col * 8);
        dst[0] = make_float4(f[0], f[1], f[2], f[3]);
        dst[1] = make_float4(f[4], f[5], f[6], f[7]);
    }
    if (tid < HG) {
        m_s[tid] = M_FLOOR;
        den_s[tid] = 0.f;
    }
    __syncthreads();
    const int count = *count_s;

    // P.V mapping: 8 dims (one 16-byte chunk) x 4 heads per thread.
    const int pv_col = tid % CHUNKS;
    const int pv_h = (tid / CHUNKS) * 4;
    float acc[4][8];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 8; ++b) acc[a][b] = 0.f;

    for (int b0 = 0; b0 < count; b0 += BLK) {
        const int nb = min(BLK, count - b0);
        // 2a. Gather the block's rows (16-byte loads, 4096 chunks over 256 threads).
        for (int c = tid; c < nb * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, col = c % CHUNKS;
            reinterpret_cast<uint4*>(kv_s + r * D)[col] = __ldg(rows_s[b0 + r] + col);
        }
        __syncthreads();
        // 2b. Logits: warp per row; lane holds dims [8 lane, 8 lane + 8) and [256 + 8 lane, ...).
        for (int r = warp; r < nb; r += WARPS) {
            float k[16];
            bf16x8_to_f32(reinterpret_cast<const uint4*>(kv_s + r * D)[lane], k);
            bf16x8_to_f32(reinterpret_cast<const uint4*>(kv_s + r * D)[lane + 32], k + 8);
            float v[HG];
#pragma unroll
            for (int h = 0; h < HG; ++h) {
                const float4* qa = reinterpret_cast<const float4*>(q_s + h * D + lane * 8);
                const float4* qb = reinterpret_cast<const float4*>(q_s + h * D + 256 + lane * 8);
                const float4 x0 = qa[0], x1 = qa[1], y0 = qb[0], y1 = qb[1];
                float s = 0.f;
                s = fmaf(x0.x, k[0], s); s = fmaf(x0.y, k[1], s); s = fmaf(x0.z, k[2], s); s = fmaf(x0.w, k[3], s);
                s = fmaf(x1.x, k[4], s); s = fmaf(x1.y, k[5], s); s = fmaf(x1.z, k[6], s); s = fmaf(x1.w, k[7], s);
                s = fmaf(y0.x, k[8], s); s = fmaf(y0.y, k[9], s); s = fmaf(y0.z, k[10], s); s = fmaf(y0.w, k[11], s);
                s = fmaf(y1.x, k[12], s); s = fmaf(y1.y, k[13], s); s = fmaf(y1.z, k[14], s); s = fmaf(y1.w, k[15], s);
                v[h] = s;
            }
            // Transposing butterfly: after step j, lane keeps half of its heads (chosen by a
            // lane bit) summed with its partner's; at the end lanes 2h and 2h+1 hold head h.
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const bool hi = lane & 16;
                const float send = hi ? v[i] : v[i + 8], keep = hi ? v[i + 8] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const bool hi = lane & 8;
                const float send = hi ? v[i] : v[i + 4], keep = hi ? v[i + 4] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const bool hi = lane & 4;
                const float send = hi ? v[i] : v[i + 2], keep = hi ? v[i + 2] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
            }
            {
                const bool hi = lane & 2;
                const float send = hi ? v[0] : v[1], keep = hi ? v[1] : v[0];
                v[0] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
            }
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], 1);
            if ((lane & 1) == 0) l_s[r * HG + (lane >> 1)] = __fmul_rn(p.scale, v[0]);
        }
        __syncthreads();
        // 2c. Online softmax bookkeeping: warp per 2 heads, lane per 2 rows.
#pragma unroll
        for (int j = 0; j < HG / WARPS; ++j) {
            const int h = warp * (HG / WARPS) + j;
            const float l0 = lane < nb ? l_s[lane * HG + h] : -INFINITY;
            const float l1 = lane + 32 < nb ? l_s[(lane + 32) * HG + h] : -INFINITY;
            float mx = fmaxf(l0, l1);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_old = m_s[h];
            const float m_new = fmaxf(m_old, mx);
            const float e0 = lane < nb ? expf(l0 - m_new) : 0.f;
            const float e1 = lane + 32 < nb ? expf(l1 - m_new) : 0.f;
            p_s[lane * HG + h] = __bfloat162float(__float2bfloat16_rn(e0));
            p_s[(lane + 32) * HG + h] = __bfloat162float(__float2bfloat16_rn(e1));
            float sum = e0 + e1;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            __syncwarp();
            if (lane == 0) {
                const float alpha = expf(m_old - m_new);
                alpha_s[h] = alpha;
                den_s[h] = __fadd_rn(__fmul_rn(den_s[h], alpha), sum);
                m_s[h] = m_new;
            }
        }
        __syncthreads();
        // 2d. P.V: acc = acc * alpha + sum_r p[r] * row[r] (rows in index order).
        {
            const float4 al = *reinterpret_cast<const float4*>(alpha_s + pv_h);
            const float alv[4] = {al.x, al.y, al.z, al.w};
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 8; ++b) acc[a][b] = __fmul_rn(acc[a][b], alv[a]);
            for (int r = 0; r < nb; ++r) {
                float k[8];
                bf16x8_to_f32(reinterpret_cast<const uint4*>(kv_s + r * D)[pv_col], k);
                const float4 pr = *reinterpret_cast<const float4*>(p_s + r * HG + pv_h);
                const float pv[4] = {pr.x, pr.y, pr.z, pr.w};
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 8; ++b) acc[a][b] = __fadd_rn(acc[a][b], __fmul_rn(pv[a], k[b]));
            }
        }
        __syncthreads();
    }

    // 3. Normalise, store bf16 output and lse.
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int h = pv_h + a;
        if (h >= nh) continue;
        const float m = m_s[h];
        const float den = __fadd_rn(den_s[h], expf(p.sink[h0 + h] - m));
        const bool ok = den > 0.f && isfinite(den);
        __align__(16) __nv_bfloat16 o[8];
#pragma unroll
        for (int b = 0; b < 8; ++b) o[b] = __float2bfloat16_rn(ok ? __fdiv_rn(acc[a][b], den) : 0.f);
        __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) + (static_cast<int64_t>(t) * p.num_heads + h0 + h) * D + pv_col * 8;
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(o);
    }
    if (tid < nh) p.lse[static_cast<int64_t>(t) * p.num_heads + h0 + tid] = count > 0 ? m_s[tid] + logf(den_s[tid]) : -INFINITY;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace dsv41_sa

extern "C" int dsv41_sparse_attention(const Dsv41SparseAttentionParams* p, size_t params_size, void* stream) {
    using namespace dsv41_sa;
    if (params_size != sizeof(Dsv41SparseAttentionParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->head_dim != D) return DSV41_ERR_HEAD_DIM;
    if (p->num_tokens < 0 || p->num_heads < 0 || p->kw < 0 || p->kc < 0 || p->num_tokens > 65535 ||
        (p->index_bytes != 4 && p->index_bytes != 8) || p->num_window_rows < 0 || p->num_extra_rows < 0)
        return DSV41_ERR_SHAPE;
    if (p->num_tokens == 0 || p->num_heads == 0) return DSV41_OK;
    if (!p->q || !p->sink || !p->out || !p->lse || (p->kw > 0 && (!p->kv_window || !p->idx_window)) ||
        (p->kc > 0 && (!p->kv_extra || !p->idx_extra)))
        return DSV41_ERR_NULL;
    // 16-byte row loads: every row start must be 8-element aligned.
    if (!aligned16(p->q) || p->q_token_stride % 8 || p->q_head_stride % 8 || !aligned16(p->out) ||
        (p->kw > 0 && (!aligned16(p->kv_window) || p->window_row_stride % 8)) ||
        (p->kc > 0 && (!aligned16(p->kv_extra) || p->extra_row_stride % 8)))
        return DSV41_ERR_ALIGNMENT;
    const size_t smem = SMEM_FIXED + sizeof(void*) * (static_cast<size_t>(p->kw) + p->kc);
    int dev = 0, max_smem = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess) return static_cast<int>(e);
    if (smem > static_cast<size_t>(max_smem)) return DSV41_ERR_SHAPE;
    e = cudaFuncSetAttribute(sparse_attention_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return static_cast<int>(e);
    const dim3 grid((p->num_heads + HG - 1) / HG, p->num_tokens);
    sparse_attention_decode_kernel<<<grid, THREADS, smem, static_cast<cudaStream_t>(stream)>>>(*p);
    return static_cast<int>(cudaGetLastError());
}
