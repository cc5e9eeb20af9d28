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
//      Softmax per head over rows: the fragments of S^T go to shared memory ([head][row], f32),
//        and lane l of warp w takes head 8 w + l / 4 over 16 of the tile's rows (the 4 lanes of
//        a head exchange max and sum by two shuffles): m_new, p = e^{l - m_new} summed (f32)
//        into the head's denominator and rounded to bf16 into P^T [32 heads][64 rows] (the
//        K-major B operand, 128-byte swizzle, two 16-byte stores), alpha = e^{m_old - m_new}
//        to shared memory for the O rescale.
//      O^T [512 dims, 32 heads] += V^T . P^T: per 16 rows 8 x m64n32k16 (A = the row tile read
//        MN-major: dims are its M dimension, 64-dim planes; B = P^T), 128 f32 accumulators per
//        thread: o[16 mb + 4 i + c] = dim 64 mb + 16 w + g + 8 (c / 2), head 8 i + 2 tq + c % 2.
//      Then the stage goes back to the producer, which meanwhile gathered tile j + 1 into the
//        other stage (two 64 KB stages: q, the stages, P^T and S^T take ~180 KB; a third does
//        not fit, so the softmax does not overlap the products).
//   3. Epilogue: per head (one lane) the factor fl(1 / (den + e^{sink - m})) as the all-heads
//      kernel with one split, and lse = m + ln den; out = fl(O f) rounded to bf16 and transposed
//      into [head][dim] rows by stmatrix .trans (in a stage tile, free after the last one), then
//      16-byte stores (the CTA's 32 output rows are contiguous).
// Numerics: those of the all-heads kernel with one split (the reference's 64-row blocks, p
// rounded to bf16 relative to the block's running max); only the f32 orders of the dot
// products, tensor-core sums and denominators differ.
// Launch: programmatic dependent launch as the all-heads kernel (chain contract in
// kernels/sparse_attention.cu: nothing is read before griddepcontrol.wait). Diagnostics: mode
// bit 0 traces CTA (0, 0) (DSV41_SPARSE_ATTENTION_TRACE=1), bit 2 skips the gather (bit 1 does
// not apply).
// Prologue variants measured in round 8 (docs/perf.md, "Round 8"), none kept: the window tiles
// gathered by the producer before the compaction (slower: issuing 128 KB of cp.async delays the
// producer's share of the compaction, 29.5 vs 26.8 us); L2 prefetches (cp.async.bulk.prefetch.L2)
// of the CTA's q rows and first 128 window rows before griddepcontrol.wait, and of tile 2's
// rows after tile 1's copies (no gain standalone or in-stream); TMA bulk stores of the out rows
// (no gain); the q copies and the window tiles' gather before the wait (-1.8 us in-stream behind
// the top-k, but sound only with the caller's guarantee, see the chain contract).
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
constexpr int SP = BLK + 4;                    // row stride (f32) of the S^T staging tile
constexpr int SM_S = SM_P + HS * BLK * 2;      // f32 [32 heads][SP]: S^T of a tile (softmax input)
constexpr int SM_ALPHA = SM_S + HS * SP * 4;   // f32 [32 heads]: e^{m_old - m_new} of the tile
constexpr int SM_FAC = SM_ALPHA + HS * 4;      // f32 [32 heads]: epilogue factors
constexpr int SM_SINK = SM_FAC + HS * 4;       // f32 [32 heads]
constexpr int SM_CNT = SM_SINK + HS * 4;       // i32 [MAX_ROUNDS * 8] per-warp valid counts -> offsets
constexpr int SM_TOTAL = SM_CNT + MAX_ROUNDS * 8 * 4;  // i32 [1]
constexpr int SM_BAR = SM_TOTAL + 16;          // u64 [4]: full[2], empty[2]
constexpr int SM_ENT = SM_BAR + 32;            // u32 [valid rows]
constexpr int OUT_STRIDE = D * 2 + 16;         // padded bf16 out row (conflict-free pair stores)
static_assert(SM_K % 1024 == 0 && SM_P % 1024 == 0, "wgmma operand tiles start on 1024-byte boundaries");
static_assert(HS * OUT_STRIDE <= 2 * TILEB, "out rows fit the stages");

constexpr int TRACE_SLOTS = 40;
// Phase timestamps of CTA (0, 0), thread 0: [0] start, [1] indices loaded, [2] compaction done,
// [3] end, [4 + j] rows of tile j arrived, [20 + j] tile j done (j < 16); tile 1: [36] S^T
// done, [37] softmax done (P^T written).
__device__ long long g_trace_heads[TRACE_SLOTS];

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory"); }

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
    // mode: bit 0 trace, bit 2 skip the gather (diagnostic; bit 1, skip the products, does not
    // apply: the products have no run-time conditions, which keeps them asynchronous).
    const bool skip_gather = mode & 4;
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

    // 2. Consumer warpgroup. Products: thread (g, tq) of warp w holds S^T / O^T fragments of
    // heads 8 i + 2 tq (+1), i = 0..3. Softmax: lane l of warp w owns head hw = 8 w + l / 4 over
    // rows rq = 16 (l % 4) .. +16 of each tile (its 4 lanes agree on m_run and den).
    const int g = lane >> 2, tq = lane & 3, w = warp;
    const int hw = 8 * w + (lane >> 2), rq = 16 * (lane & 3);
    float* s_s = reinterpret_cast<float*>(smem + SM_S);
    float* alpha_s = reinterpret_cast<float*>(smem + SM_ALPHA);
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run = M_FLOOR, den = 0.f;  // running max and denominator of head hw
    // S^T accumulators, zeroed while no product is in flight (ptxas serializes the products
    // when accumulator registers are defined while another product is pending).
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    // Per tile: wait for the rows, S^T, softmax, P.V, hand the stage back. (Measured slower,
    // round 6: the previous tile's P.V left in flight while this tile's rows are awaited and its
    // S^T issued; its stage then goes back only after this tile's rows landed, so at most one
    // tile is in flight.)
    for (int j = 0; j < ntiles; ++j) {
        mbar_wait(bar_full + 8 * (j & 1), (j >> 1) & 1);
        if (j == 0) cp_async_wait_all();  // this thread's q copies
        fence_proxy_async();  // q and the row tile (generic-proxy writes) are read by wgmma
        consumer_sync();
        if (j < 16) stamp(4 + j);
        const int nb = min(BLK, count - j * BLK);
        const uint32_t kt = sbase + SM_K + (j & 1) * TILEB;
        // S^T = K . q^T (m64n32k16 over the 512 dims: 8 planes x 4 k-steps of 16).
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
        if (j == 1) stamp(36);
        // S^T -> shared [head][row] (conflict-free: the row stride is 4 banks off per head).
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                s_s[(8 * i + 2 * tq + (c & 1)) * SP + 16 * w + g + 8 * (c >> 1)] = s[4 * i + c];
                s[4 * i + c] = 0.f;
            }
        consumer_sync();
        // Head hw over rows rq .. +16: scale, mask rows past the tile's end, tile max (the 4
        // lanes of the head), m_new, bf16 p -> P^T [head][row] (two 16-byte stores), denominator.
        float x[16];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float4 v = *reinterpret_cast<const float4*>(s_s + hw * SP + rq + 4 * k);
            x[4 * k] = v.x, x[4 * k + 1] = v.y, x[4 * k + 2] = v.z, x[4 * k + 3] = v.w;
        }
        float mx = -INFINITY;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            x[k] = rq + k < nb ? __fmul_rn(p.scale, x[k]) : -INFINITY;
            mx = fmaxf(mx, x[k]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m_run, mx);
        const float alpha = expf(m_run - mn);
        m_run = mn;
        float sum = 0.f;
        uint32_t pk[8];
#pragma unroll
        for (int k = 0; k < 16; k += 2) {
            const float e0 = expf(x[k] - mn), e1 = expf(x[k + 1] - mn);
            sum += e0;
            sum += e1;
            pk[k >> 1] = pack_bf16x2_rn(e0, e1);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        den = __fadd_rn(__fmul_rn(den, alpha), sum);
        *reinterpret_cast<uint4*>(smem + SM_P + sw128(hw, rq >> 3)) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
        *reinterpret_cast<uint4*>(smem + SM_P + sw128(hw, (rq >> 3) + 1)) = make_uint4(pk[4], pk[5], pk[6], pk[7]);
        if ((lane & 3) == 0) alpha_s[hw] = alpha;
        fence_proxy_async();  // the P^T tile is read by wgmma
        consumer_sync();
        // Rescale O by its heads' alpha, then O^T += V^T . P^T over all 4 k-steps (no run-time trip
        // count: ptxas keeps the products asynchronous; rows past the tile's end have p = 0 and
        // zero-filled rows).
        if (j == 1) stamp(37);
        float al[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 a2 = *reinterpret_cast<const float2*>(alpha_s + 8 * i + 2 * tq);
            al[2 * i] = a2.x, al[2 * i + 1] = a2.y;
        }
#pragma unroll
        for (int mb = 0; mb < 8; ++mb)
#pragma unroll
            for (int c = 0; c < 16; ++c) o[16 * mb + c] *= al[2 * (c >> 2) + (c & 1)];
        wg_fence_regs<128>(o);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BLK / 16; ++kk) {
            const uint64_t b = wg_desc(sbase + SM_P + kk * 32, 16, 1024);
#pragma unroll
            for (int mb = 0; mb < 8; ++mb) wg_m64n32k16<1, 0>(o + 16 * mb, wg_desc(kt + mb * PLANE + kk * 16 * 128, PLANE, 1024), b);
        }
        wg_commit();
        wg_wait_all();
        wg_fence_regs<128>(o);
        // This warp is done with the stage (its products completed): hand it back.
        if (lane == 0) mbar_arrive(bar_empty + 8 * (j & 1));
        if (j < 16) stamp(20 + j);
    }

    // 3. Epilogue: per head the factor 1 / (den + e^{sink - m}) and the lse (lanes l % 4 = 0),
    // as the all-heads kernel's merge with one split (bitwise the same factor for the same m, den).
    cp_async_wait_all();  // the q copies are still in flight when there is no row
    consumer_sync();  // the sink landed for every thread
    float* fac_s = reinterpret_cast<float*>(smem + SM_FAC);
    if ((lane & 3) == 0) {
        const float big = fmaxf(M_FLOOR, m_run);
        const float wsum = __fadd_rn(0.f, __fmul_rn(expf(m_run - big), den));
        const float dall = __fadd_rn(wsum, expf(reinterpret_cast<const float*>(smem + SM_SINK)[hw] - big));
        const bool ok = dall > 0.f && isfinite(dall);
        fac_s[hw] = ok ? __fdiv_rn(expf(m_run - big), dall) : 0.f;
        if (hw < nh) p.lse[static_cast<int64_t>(t) * p.num_heads + h0 + hw] = count > 0 ? big + logf(wsum) : -INFINITY;
    }
    consumer_sync();
    float fac[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f2 = *reinterpret_cast<const float2*>(fac_s + 8 * i + 2 * tq);
        fac[2 * i] = f2.x, fac[2 * i + 1] = f2.y;
    }
    // bf16 out rows [head][dim] into the stage tiles (all consumed), transposed by stmatrix:
    // matrix (i, hf) of m-block mb = dims 64 mb + 16 w + 8 hf .. +8 of heads 8 i .. +8.
    const uint32_t outb = sbase + SM_K;
    auto scaled = [&](int idx, int k) { return __fadd_rn(0.f, __fmul_rn(o[idx], fac[k])); };
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int ip = 0; ip < 2; ++ip) {
            uint32_t r[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int i = 2 * ip + (k >> 1), base = 16 * mb + 4 * i + 2 * (k & 1);
                r[k] = pack_bf16x2_rn(scaled(base, 2 * i), scaled(base + 1, 2 * i + 1));
            }
            const int mat = lane >> 3, i = 2 * ip + (mat >> 1), hf = mat & 1;
            stmatrix_x4_trans(outb + (8 * i + (lane & 7)) * OUT_STRIDE + (64 * mb + 16 * w + 8 * hf) * 2, r[0], r[1], r[2], r[3]);
        }
    consumer_sync();
    // The CTA's out rows are contiguous: 16-byte stores.
    __nv_bfloat16* orow = static_cast<__nv_bfloat16*>(p.out) + (static_cast<int64_t>(t) * p.num_heads + h0) * D;
    const int items = nh * (D / 8);
    const unsigned char* outp = smem + SM_K;
#pragma unroll 4
    for (int c = tid; c < items; c += CONSUMERS)
        *reinterpret_cast<uint4*>(orow + c * 8) = *reinterpret_cast<const uint4*>(outp + (c >> 6) * OUT_STRIDE + (c & 63) * 16);
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
    fprintf(stderr, " | epilogue %.2f | total %.2f us", (h[3] - prev) * us, (h[3] - h[0]) * us);
    if (h[37] > 0)
        fprintf(stderr, " (tile1 after its rows: S^T %.2f, softmax %.2f, P.V %.2f us)", (h[36] - h[5]) * us, (h[37] - h[36]) * us,
                (h[21] - h[37]) * us);
    fprintf(stderr, "\n");
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
    cfg.numAttrs = (mode & 64) ? 0 : 1;  // mode bit 6: no programmatic dependent launch (comparison)
    if (mode & 1) {
        void* buf = nullptr;
        if (cudaGetSymbolAddress(&buf, g_trace_heads) == cudaSuccess) cudaMemsetAsync(buf, 0, sizeof(long long) * TRACE_SLOTS, stream);
    }
    cudaError_t e = cudaLaunchKernelEx(&cfg, head_split_kernel, p, mode & 7);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e == cudaSuccess && (mode & 1)) print_trace(stream, dev);
    return static_cast<int>(e);
}

}  // namespace dsv41_sa
