// sparse_attention_heads: the head-split decode kernel of the sparse attention with sink
// (kernels/sparse_attention.cu holds the launcher, the definition and the numerics; this kernel
// computes the same function). Chosen by the launcher for few tokens (decode), where the
// all-heads kernel needs split-KV and a split merge across the SMs of a cluster.
//
// Design. grid = (T, ceil(H / 32)), 256 threads, 1 CTA per SM (~190 KB shared memory). CTA (t, z)
// owns heads [32 z, 32 z + 32) of token t and ALL of the token's valid rows, so there is no
// split and no merge: the token's two (H = 64) CTAs read the same rows (the second from L2) and
// each writes its heads' output rows directly. Rows are the wgmma M dimension (32 heads would
// fill only half of an M = 64 instruction):
//   1. All 256 threads compact the token's valid indices (dsv41_sparse_attention_common.cuh,
//      ValidIndices) while warpgroup 0 copies q (32 heads x 512, a 32-row swizzled K-major
//      tile) and the sink.
//   2. Warpgroup 1 is the producer (produce_tiles, shared with the all-heads kernel: 64-row
//      tiles into a two-stage ring, bf16 or packed rows). Warpgroup 0 consumes, per tile:
//      S^T [64 rows, 32 heads] = K . q^T: 32 x wgmma m64n32k16 (A = the row tile, K-major; B = q,
//        K-major); warp w holds rows 16 w .. +16, thread (g, tq) = (lane / 4, lane % 4) rows
//        16 w + g (+8) of heads 8 i + 2 tq (+1), i = 0..3.
//      Softmax per head over rows: the tile max of a head is spread over the 4 warps, so each
//        warp publishes its 32 maxima (shared memory, two buffers by tile parity), and after a
//        barrier every thread forms m_new of its 8 heads; p = e^{l - m_new} (f32) is summed into
//        the warp's denominators (per warp, added up at the end) and rounded to bf16 into P^T
//        [32 heads][64 rows] (the K-major B operand, 128-byte swizzle; pairs of rows of a head
//        are exchanged between lanes g, g ^ 1 for 4-byte stores).
//      O^T [512 dims, 32 heads] += V^T . P^T: per 16 rows 8 x m64n32k16 (A = the row tile read
//        MN-major: dims are its M dimension, 64-dim planes; B = P^T), 128 f32 accumulators per
//        thread: o[16 mb + 4 i + c] = dim 64 mb + 16 w + g + 8 (c / 2), head 8 i + 2 tq + c % 2.
//   3. Epilogue: the per-warp denominators are added (shared memory), out = fl(O fl(1 / (den +
//      e^{sink - m}))) as the all-heads kernel with one split, bf16 rows staged transposed in
//      shared memory (a stage tile, free after the last one) and stored with 16-byte stores (the
//      CTA's 32 output rows are contiguous); lse = m + ln den.
// Numerics: those of the all-heads kernel with one split (the reference's 64-row blocks, p
// rounded to bf16 relative to the block's running max); only the f32 orders of the dot
// products, tensor-core sums and denominators differ.
// Launch: programmatic dependent launch as the all-heads kernel. Diagnostics: mode bit 0 traces
// CTA (0, 0) (DSV41_SPARSE_ATTENTION_TRACE=1), bits 1 / 2 skip the products / the gather.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "include/dsv41_hopper.cuh"
#include "include/dsv41_sparse_attention.h"
#include "include/dsv41_sparse_attention_common.cuh"

namespace dsv41_sa {
namespace heads {

using namespace dsv41_ptx;

constexpr int HS = 32;        // heads per CTA
constexpr int CONSUMERS = 128;  // warpgroup 0; warpgroup 1 produces
constexpr int THREADS_ALL = CONSUMERS + PROD_THREADS;
static_assert(THREADS_ALL == IDX_THREADS, "every thread compacts the indices");

// Shared memory map (bytes).
constexpr int SM_Q = 0;                        // bf16 [8 planes][32 heads][128 B]
constexpr int SM_K = SM_Q + HS * D * 2;        // bf16 [2 stages][64 rows][512] (epilogue: bf16 out rows [32][OUT_STRIDE])
constexpr int SM_P = SM_K + 2 * TILEB;         // bf16 [32 heads][64 rows], 128-byte swizzle
constexpr int SM_MX = SM_P + HS * BLK * 2;     // f32 [2 parity][4 warps][32 heads]: tile maxima
constexpr int SM_DEN = SM_MX + 2 * 4 * HS * 4; // f32 [4 warps][32 heads]: denominators
constexpr int SM_SINK = SM_DEN + 4 * HS * 4;   // f32 [32 heads]
constexpr int SM_CNT = SM_SINK + HS * 4;       // i32 [MAX_ROUNDS * 8] per-warp valid counts -> offsets
constexpr int SM_TOTAL = SM_CNT + MAX_ROUNDS * 8 * 4;  // i32 [1]
constexpr int SM_BAR = SM_TOTAL + 16;          // u64 [4]: full[2], empty[2]
constexpr int SM_ENT = SM_BAR + 32;            // u32 [valid rows]
constexpr int OUT_STRIDE = D * 2 + 16;         // padded bf16 out row (conflict-free pair stores)
static_assert(SM_K % 1024 == 0 && SM_P % 1024 == 0, "wgmma operand tiles start on 1024-byte boundaries");
static_assert(HS * OUT_STRIDE <= 2 * TILEB, "out rows fit the stages");

constexpr int TRACE_SLOTS = 40;
// Phase timestamps of CTA (0, 0), thread 0: [0] start, [1] indices loaded, [2] compaction done,
// [3] end, [4 + j] rows of tile j arrived, [20 + j] tile j done (j < 16).
__device__ long long g_trace_heads[TRACE_SLOTS];

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory"); }

// Stores the bf16 transpose of a thread's 16 x 8 accumulator block: v0 / v1 = (row R, column
// 2 tq) / (row R, column 2 tq + 1), R = base + g. Lanes g, g ^ 1 exchange one value so that each
// stores two consecutive rows of one column as a 4-byte word: at(col, row) gives the shared
// address of (column col, rows row, row + 1), row even.
template <class At>
__device__ __forceinline__ void store_transposed_pair(float v0, float v1, int g, int tq, int row_base, At at) {
    const bool odd = g & 1;
    const float recv = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
    const int r = row_base + (g & ~1);
    if (!odd)
        *reinterpret_cast<uint32_t*>(at(2 * tq, r)) = pack_bf16x2_rn(v0, recv);
    else
        *reinterpret_cast<uint32_t*>(at(2 * tq + 1, r)) = pack_bf16x2_rn(recv, v1);
}

__global__ void __launch_bounds__(THREADS_ALL, 1) head_split_kernel(const Dsv41SparseAttentionParams p, int mode) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sbase = smem_addr(smem);
    if ((sbase & 1023u) != 0) __trap();  // the wgmma descriptors assume 1024-byte aligned tiles
    int* cnt_s = reinterpret_cast<int*>(smem + SM_CNT);
    int* total_s = reinterpret_cast<int*>(smem + SM_TOTAL);
    uint32_t* ent_s = reinterpret_cast<uint32_t*>(smem + SM_ENT);
    const uint32_t bar_full = sbase + SM_BAR, bar_empty = sbase + SM_BAR + 16;
    // (The warp index through a shuffle: the compiler then knows the role branch is warp-uniform
    // and keeps the wgmma products of the consumer path asynchronous.)
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const bool consumer = warp < CONSUMERS / 32;
    const int t = blockIdx.x, h0 = blockIdx.y * HS;
    const int nh = min(HS, p.num_heads - h0);
    const bool skip_mma = mode & 2, skip_gather = mode & 4;
    const bool tracer = (mode & 1) && tid == 0 && blockIdx.x == 0 && blockIdx.y == 0;
    auto stamp = [&](int slot) {
        if (tracer) g_trace_heads[slot] = clock64();
    };
    grid_dep_wait();  // everything below may read what the previous kernel wrote
    grid_dep_launch();
    stamp(0);
    if (tid == 0) {
        mbar_init(bar_full, PROD_THREADS);  // one arrival per producer thread
        mbar_init(bar_full + 8, PROD_THREADS);
        mbar_init(bar_empty, CONSUMERS / 32);  // one arrival per consumer warp
        mbar_init(bar_empty + 8, CONSUMERS / 32);
    }
    // 1. Indices (all threads); q and the sink (consumers) while the index loads are in flight.
    ValidIndices vi;
    vi.load_and_count(p, t, tid, cnt_s, [&]() {
        if (consumer) load_q_tile<HS, CONSUMERS>(p, t, h0, nh, tid, sbase + SM_Q, sbase + SM_SINK);
    });
    __syncthreads();
    stamp(1);
    if (warp == 0) vi.scan(cnt_s, total_s, lane);
    __syncthreads();
    const int count = *total_s;
    vi.store(cnt_s, ent_s, 0, count, tid);
    __syncthreads();
    const int ntiles = (count + BLK - 1) / BLK;
    if (!consumer) {
        produce_tiles(p, sbase + SM_K, ent_s, count, bar_full, bar_empty, tid - CONSUMERS, skip_gather);
        return;
    }
    stamp(2);

    // 2. Consumer warpgroup.
    const int g = lane >> 2, tq = lane & 3, w = warp;
    float* mx_s = reinterpret_cast<float*>(smem + SM_MX);
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    // This thread's 8 heads k = 2 i + b: head 8 i + 2 tq + b.
    float m_run[8], den[8];  // running max; this warp's denominator (its 16 rows of each tile)
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        m_run[k] = M_FLOOR;
        den[k] = 0.f;
    }
    for (int j = 0; j < ntiles; ++j) {
        mbar_wait(bar_full + 8 * (j & 1), (j >> 1) & 1);
        if (j == 0) cp_async_wait_all();  // this thread's q copies
        fence_proxy_async();  // q and the row tile (generic-proxy writes) are read by wgmma
        consumer_sync();
        if (j < 16) stamp(4 + j);
        const int nb = min(BLK, count - j * BLK);
        const uint32_t kt = sbase + SM_K + (j & 1) * TILEB;
        // S^T = K . q^T (m64n32k16 over the 512 dims: 8 planes x 4 k-steps of 16).
        float s[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) s[i] = 0.f;
        if (!skip_mma) {
            wg_fence_regs<16>(s);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                const uint32_t sub = (ks & 3) * 32;
                wg_m64n32k16<0, 0>(s, wg_desc(kt + (ks >> 2) * PLANE + sub, 16, 1024), wg_desc(sbase + SM_Q + (ks >> 2) * (HS * 128) + sub, 16, 1024));
            }
            wg_commit();
            wg_wait_all();
            wg_fence_regs<16>(s);
        }
        // Scale, mask rows past the tile's end, per-head max of this warp's 16 rows.
        float* mxw = mx_s + (j & 1) * 4 * HS;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int i = k >> 1, b = k & 1;
            const int r0 = 16 * w + g;
            float& a = s[4 * i + b];
            float& c = s[4 * i + 2 + b];
            a = r0 < nb ? __fmul_rn(p.scale, a) : -INFINITY;
            c = r0 + 8 < nb ? __fmul_rn(p.scale, c) : -INFINITY;
            float m = fmaxf(a, c);
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
            if (g == 0) mxw[w * HS + 8 * i + 2 * tq + b] = m;
        }
        consumer_sync();
        // m_new, bf16 p -> P^T, this warp's denominators, rescale O.
        float alpha[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int i = k >> 1, b = k & 1, h = 8 * i + 2 * tq + b;
            const float mt = fmaxf(fmaxf(mxw[h], mxw[HS + h]), fmaxf(mxw[2 * HS + h], mxw[3 * HS + h]));
            const float mn = fmaxf(m_run[k], mt);
            alpha[k] = expf(m_run[k] - mn);
            m_run[k] = mn;
            const float e0 = expf(s[4 * i + b] - mn), e1 = expf(s[4 * i + 2 + b] - mn);
            s[4 * i + b] = e0;
            s[4 * i + 2 + b] = e1;
            float sum = e0 + e1;
            sum += __shfl_xor_sync(0xffffffffu, sum, 4);
            sum += __shfl_xor_sync(0xffffffffu, sum, 8);
            sum += __shfl_xor_sync(0xffffffffu, sum, 16);
            den[k] = __fadd_rn(__fmul_rn(den[k], alpha[k]), sum);
        }
        auto p_at = [&](int col, int row) { return smem + SM_P + sw128(col, row >> 3) + (row & 7) * 2; };
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                store_transposed_pair(s[4 * i + 2 * hf], s[4 * i + 2 * hf + 1], g, tq, 16 * w + 8 * hf,
                                      [&](int col, int row) { return p_at(8 * i + col, row); });
        fence_proxy_async();  // the P^T tile is read by wgmma
        consumer_sync();
#pragma unroll
        for (int mb = 0; mb < 8; ++mb)
#pragma unroll
            for (int c = 0; c < 16; ++c) o[16 * mb + c] *= alpha[2 * (c >> 2) + (c & 1)];
        const int ksteps = skip_mma ? 0 : (nb + 15) >> 4;
        if (ksteps > 0) {
            wg_fence_regs<128>(o);
            wg_fence();
#pragma unroll 1
            for (int kk = 0; kk < ksteps; ++kk) {
                const uint64_t b = wg_desc(sbase + SM_P + kk * 32, 16, 1024);
#pragma unroll
                for (int mb = 0; mb < 8; ++mb) wg_m64n32k16<1, 0>(o + 16 * mb, wg_desc(kt + mb * PLANE + kk * 16 * 128, PLANE, 1024), b);
            }
            wg_commit();
            wg_wait_all();
            wg_fence_regs<128>(o);
        }
        // This warp is done with the stage (its wgmma reads completed): hand it back.
        if (lane == 0) mbar_arrive(bar_empty + 8 * (j & 1));
        if (j < 16) stamp(20 + j);
    }

    // 3. Epilogue.
    cp_async_wait_all();  // the q copies are still in flight when there is no row
    float* den_s = reinterpret_cast<float*>(smem + SM_DEN);
    if (g == 0) {
#pragma unroll
        for (int k = 0; k < 8; ++k) den_s[w * HS + 8 * (k >> 1) + 2 * tq + (k & 1)] = den[k];
    }
    consumer_sync();  // also: the sink landed for every thread
    const float* sink_s = reinterpret_cast<const float*>(smem + SM_SINK);
    float fac[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int h = 8 * (k >> 1) + 2 * tq + (k & 1);
        const float dsum = __fadd_rn(__fadd_rn(__fadd_rn(den_s[h], den_s[HS + h]), den_s[2 * HS + h]), den_s[3 * HS + h]);
        // As the all-heads kernel's merge with one split (bitwise the same factor for the same m, den).
        const float big = fmaxf(M_FLOOR, m_run[k]);
        const float wsum = __fadd_rn(0.f, __fmul_rn(expf(m_run[k] - big), dsum));
        const float dall = __fadd_rn(wsum, expf(sink_s[h] - big));
        const bool ok = dall > 0.f && isfinite(dall);
        fac[k] = ok ? __fdiv_rn(expf(m_run[k] - big), dall) : 0.f;
        if (w == 0 && g == 0 && h < nh) p.lse[static_cast<int64_t>(t) * p.num_heads + h0 + h] = count > 0 ? big + logf(wsum) : -INFINITY;
    }
    // bf16 out rows [head][dim] into the stage tiles (all consumed: the last tile's products
    // completed in every warp before the barrier above).
    unsigned char* outb = smem + SM_K;
    auto out_at = [&](int col, int row) { return outb + col * OUT_STRIDE + row * 2; };
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float* v = o + 16 * mb + 4 * i + 2 * hf;
                store_transposed_pair(__fadd_rn(0.f, __fmul_rn(v[0], fac[2 * i])), __fadd_rn(0.f, __fmul_rn(v[1], fac[2 * i + 1])), g, tq,
                                      64 * mb + 16 * w + 8 * hf, [&](int col, int row) { return out_at(8 * i + col, row); });
            }
    consumer_sync();
    // The CTA's out rows are contiguous: 16-byte stores.
    __nv_bfloat16* orow = static_cast<__nv_bfloat16*>(p.out) + (static_cast<int64_t>(t) * p.num_heads + h0) * D;
    const int items = nh * (D / 8);
#pragma unroll 4
    for (int c = tid; c < items; c += CONSUMERS)
        *reinterpret_cast<uint4*>(orow + c * 8) = *reinterpret_cast<const uint4*>(outb + (c >> 6) * OUT_STRIDE + (c & 63) * 16);
    stamp(3);
}

// Prints the phase timestamps of CTA (0, 0) (synchronises the stream).
void print_trace(cudaStream_t stream, int dev) {
    long long h[TRACE_SLOTS] = {};
    int khz = 0;
    if (cudaStreamSynchronize(stream) != cudaSuccess || cudaMemcpyFromSymbol(h, g_trace_heads, sizeof(h)) != cudaSuccess ||
        cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) != cudaSuccess || khz <= 0)
        return;
    const double us = 1e3 / khz;
    fprintf(stderr, "sparse_attention head-split trace (CTA 0): indices %.2f | compaction %.2f us", (h[1] - h[0]) * us, (h[2] - h[0]) * us);
    long long prev = h[2];
    for (int j = 0; j < 16 && h[20 + j] > prev; ++j) {
        fprintf(stderr, " | tile%d %.2f (wait %.2f)", j, (h[20 + j] - prev) * us, (h[4 + j] - prev) * us);
        prev = h[20 + j];
    }
    fprintf(stderr, " | epilogue %.2f | total %.2f us\n", (h[3] - prev) * us, (h[3] - h[0]) * us);
}

}  // namespace heads

int launch_head_split(const Dsv41SparseAttentionParams& p, cudaStream_t stream, int mode, int dev, int max_smem) {
    using namespace heads;
    const int ktot = p.kw + p.kc;
    const size_t smem = SM_ENT + sizeof(uint32_t) * static_cast<size_t>(ktot > 0 ? ktot : 1);
    if (smem > static_cast<size_t>(max_smem)) return DSV41_ERR_SHAPE;
    static thread_local int configured_dev = -1;
    if (configured_dev != dev) {
        const cudaError_t e = cudaFuncSetAttribute(head_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
        if (e != cudaSuccess) return static_cast<int>(e);
        configured_dev = dev;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(p.num_tokens, (p.num_heads + HS - 1) / HS, 1);
    cfg.blockDim = dim3(THREADS_ALL, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (mode & 1) {
        void* buf = nullptr;
        if (cudaGetSymbolAddress(&buf, g_trace_heads) == cudaSuccess) cudaMemsetAsync(buf, 0, sizeof(long long) * TRACE_SLOTS, stream);
    }
    cudaError_t e = cudaLaunchKernelEx(&cfg, head_split_kernel, p, mode);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e == cudaSuccess && (mode & 1)) print_trace(stream, dev);
    return static_cast<int>(e);
}

}  // namespace dsv41_sa
