// The split merge and output store of the sparse attention kernel for S <= 2 splits
// (kernels/sparse_attention.cu, design in its header comment, step 3).
#pragma once
#include <cuda_runtime.h>
#include <math.h>

#include "dsv41_hopper.cuh"
#include "dsv41_sparse_attention.h"
#include "dsv41_sparse_attention_layout.cuh"

namespace dsv41_sa {

using namespace dsv41_ptx;

// Epilogue with S <= 2 splits (compute threads; S = 2: after this CTA's cluster arrival behind its
// last tile). stat_s holds this split's (m, den) per head, acc the raw O fragments (warp w: heads
// 16 (w % 4) .. +16, dims 256 (w / 4) .. +256). This CTA stores heads [split hs, +hs).
//   S = 2: the raw O of the other CTA's heads and their (m, den) go into SM_TX (local stores),
//   then, once both CTAs are past their tiles (cluster barrier), one bulk copy moves the chunk
//   into the other CTA's SM_RX and completes on its rx mbarrier; this CTA waits on its own, then
//   on the second cluster barrier (both chunks landed).
//   Then (any S): a thread per head merges (m, den) into the factors e^{m_r - M} / den (fac_s)
//   and the lse; each thread combines its own heads' O as fl(f_0 O_0) + fl(f_1 O_1) (split
//   order, from its registers and SM_RX) into bf16 rows in SM_OUTB (S = 2) / at 0 (S = 1), and
//   the CTA copies the rows to `out` with 16-byte stores.
__device__ __forceinline__ void epilogue_xfer(const Dsv41SparseAttentionParams& p, unsigned char* smem, const float* acc, int t, int split,
                                           int nsplit, int h0, int nh, int hs, int count, bool tracer) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int hg = warp & 3, wg = warp >> 2, other = split ^ 1;
    const uint32_t sbase = smem_addr(smem);
    const float* stat_s = reinterpret_cast<const float*>(smem + SM_STAT);
    constexpr uint32_t CHUNK = (HB / 2) * OROW + XSTAT;
    compute_sync();  // stat_s complete
    if (tracer && nsplit == 1) g_trace[21] = g_trace[18] = clock64();
    if (nsplit > 1) {
        unsigned char* tx = smem + SM_TX;
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const int h = hg * 16 + g + 8 * hi;
            if (h < nh && h / hs == other) {
                const int row = h - other * hs;
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    const int d0 = wg * 256 + 8 * i + 2 * tq;
                    *reinterpret_cast<float2*>(tx + sw2k(row, d0 >> 2) + (d0 & 3) * 4) = make_float2(acc[4 * i + 2 * hi], acc[4 * i + 2 * hi + 1]);
                }
            }
        }
        if (tid < HB / 2) {
            float* txs = reinterpret_cast<float*>(tx + (HB / 2) * OROW);
            const int h = min(other * hs + tid, HB - 1);
            txs[tid] = stat_s[h];
            txs[HB / 2 + tid] = stat_s[HB + h];
        }
        fence_proxy_async();  // the chunk is read by the bulk copy (async proxy)
        cluster_wait();       // both CTAs are past their tiles: the other's SM_RX is free
        compute_sync();       // the whole chunk is written
        if (tracer) g_trace[21] = clock64();
        if (tid == 0)
            bulk_copy_to_cluster(mapa_shared(sbase + SM_RX, other), sbase + SM_TX, CHUNK, mapa_shared(sbase + SM_BAR + 32, other));
        mbar_wait(sbase + SM_BAR + 32, 0);
        cluster_arrive();  // this CTA's chunk landed: the other's SM_TX was read
        if (tracer) g_trace[18] = clock64();
        cluster_wait();  // both chunks landed (no copy in flight during the combine)
        if (tracer) g_trace[44] = clock64();
    }
    const float* rx = reinterpret_cast<const float*>(smem + SM_RX);
    float* fac_s = reinterpret_cast<float*>(smem + SM_P);  // f32 [2 splits][64 local heads]
    const int hb = split * hs, he = min(nh, hb + hs);
    if (tid < he - hb) {
        const int h = hb + tid;
        float mr[2] = {stat_s[h], M_FLOOR}, dr[2] = {stat_s[HB + h], 0.f};
        if (nsplit > 1) {
            mr[1] = rx[(HB / 2) * D + tid];
            dr[1] = rx[(HB / 2) * D + HB / 2 + tid];
            if (split == 1) {  // split order: r = 0 first
                const float m0 = mr[0], d0 = dr[0];
                mr[0] = mr[1], dr[0] = dr[1], mr[1] = m0, dr[1] = d0;
            }
        }
        const float big = fmaxf(M_FLOOR, fmaxf(mr[0], mr[1]));
        float wsum = 0.f;
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (r < nsplit) wsum = __fadd_rn(wsum, __fmul_rn(expf(mr[r] - big), dr[r]));
        const float den = __fadd_rn(wsum, expf(reinterpret_cast<const float*>(smem + SM_SINK)[h] - big));
        const bool ok = den > 0.f && isfinite(den);
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (r < nsplit) fac_s[r * HB + tid] = ok ? __fdiv_rn(expf(mr[r] - big), den) : 0.f;
        p.lse[static_cast<int64_t>(t) * p.num_heads + h0 + h] = count > 0 ? big + logf(wsum) : -INFINITY;
    }
    if (tracer) g_trace[41] = clock64();
    compute_sync();
    if (tracer) g_trace[42] = clock64();
    unsigned char* outb = smem + (nsplit > 1 ? SM_OUTB2 : 0);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        const int h = hg * 16 + g + 8 * hi;
        if (h < he && h >= hb) {
            const int row = h - hb;
            const float fo = fac_s[(nsplit > 1 ? split : 0) * HB + row], fr = nsplit > 1 ? fac_s[other * HB + row] : 0.f;
            // 16 dims pairs at a time: the loads first (the compiler cannot move them above
            // the stores: both are shared memory through the same pointer).
#pragma unroll
            for (int i0 = 0; i0 < 32; i0 += 16) {
                float2 v[16];
#pragma unroll
                for (int k = 0; k < 16; ++k) {
                    const int d0 = wg * 256 + 8 * (i0 + k) + 2 * tq;
                    v[k] = nsplit > 1 ? *reinterpret_cast<const float2*>(smem + SM_RX + sw2k(row, d0 >> 2) + (d0 & 3) * 4) : make_float2(0.f, 0.f);
                }
#pragma unroll
                for (int k = 0; k < 16; ++k) {
                    const int i = i0 + k, d0 = wg * 256 + 8 * i + 2 * tq;
                    const float ox = __fmul_rn(acc[4 * i + 2 * hi], fo), oy = __fmul_rn(acc[4 * i + 2 * hi + 1], fo);
                    float x = __fadd_rn(0.f, ox), y = __fadd_rn(0.f, oy);
                    if (nsplit > 1) {  // in split order: (0 + fl(f_0 O_0)) + fl(f_1 O_1)
                        const float vx = __fmul_rn(v[k].x, fr), vy = __fmul_rn(v[k].y, fr);
                        x = split == 0 ? __fadd_rn(x, vx) : __fadd_rn(__fadd_rn(0.f, vx), ox);
                        y = split == 0 ? __fadd_rn(y, vy) : __fadd_rn(__fadd_rn(0.f, vy), oy);
                    }
                    *reinterpret_cast<uint32_t*>(outb + row * OUTB_STRIDE + d0 * 2) = pack_bf16x2_rn(x, y);
                }
            }
        }
    }
    if (tracer) g_trace[43] = clock64();
    compute_sync();
    if (tracer) g_trace[19] = clock64();
    // The CTA's out rows are contiguous: 16-byte stores, a warp per 512 bytes.
    __nv_bfloat16* orow = static_cast<__nv_bfloat16*>(p.out) + (static_cast<int64_t>(t) * p.num_heads + h0 + hb) * D;
    const int items = (he - hb) * 64;
    for (int c0 = 0; c0 < items; c0 += 8 * THREADS) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int c = c0 + k * THREADS + tid;
            if (c < items) v[k] = *reinterpret_cast<const uint4*>(outb + (c >> 6) * OUTB_STRIDE + (c & 63) * 16);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int c = c0 + k * THREADS + tid;
            if (c < items) *reinterpret_cast<uint4*>(orow + c * 8) = v[k];
        }
    }
    if (tracer) g_trace[20] = clock64();
}

}  // namespace dsv41_sa
