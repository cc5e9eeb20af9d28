// fp8_linear_warp: the WARP variant (DSV41_FP8_VARIANT_WARP, m <= 64) of the FP8 linear's weight
// streaming (spec §2.4-§2.5, issue 21): the warp-owned units of kernels/moe_experts.cu applied to the
// dense FP8 weight, with the weights loaded into registers (that kernel now streams them through
// per-warp shared-memory rings, which held more bytes in flight). kernels/fp8_linear.cu holds the launcher, the prep kernel (the
// activation panel and its block scales), the other variants and the numerics; the per-k32-block
// product (block_step) and the loads are shared through include/dsv41_fp8_stream.cuh.
//
// Design:
//   * unit = 16 weight rows x a split of K (the whole K when the units fill the SMs), owned by ONE
//     warp: lane (g, t) loads the 8 code bytes 8t..8t+7 of each k32 block of rows g and g + 8
//     (the mma fragment with the block's K order permuted as in the other variants: no shuffles)
//     straight from global memory into registers, 8-byte read-only loads that do not allocate in
//     L1, with the 4 scale bytes of each group of 4 k32 blocks. D = 2 groups (2 KB per warp each)
//     are in flight ahead of the products, across the warp's units: its next unit's first groups
//     are loaded during the current unit's last ones (no drain between units).
//   * 16 rows, not 32: the weight is the mma's A operand (m16) and a 16-row unit lies in one
//     32-row scale block, so the warp needs one weight scale per k32 block; a group in flight
//     takes 16 registers (32 rows: 32, and D = 2 of them plus the copies would not fit the 128
//     registers of a 512-thread CTA); and N gives twice the units (wq_a 5120 -> 1280 has 80,
//     not 40), so fewer K splits fill the GPU. The tokens are the B operand: one n8 tile for
//     m <= 8, two for m <= 16 (4 / 8 up to m = 64).
//   * grid: persistent, splits x parts CTAs of 16 warps (at most one per SM). CTA c takes split
//     s = c / parts (whole groups of 4 k32 blocks: groups [s G / S, (s + 1) G / S)) and an equal
//     contiguous run of the units; warp w takes units w, w + 16, ... of the run. A CTA has one K
//     range, so it copies the panel's slice (every token x its k range: the f16 e4m3 code values
//     of Q1(x), or bf16 x) and the activation scales into shared memory once (cp.async by all
//     threads, one barrier, while the warps' first weight groups are in flight), and the products
//     read it with conflict-free 16-byte loads (row stride 64 mod 128 bytes). Each weight byte is
//     used by one warp only: no shared-memory weight ring, no per-stage barrier, no cross-warp
//     reduction.
//   * split factor (warp_plan): the least work of the busiest warp (its units x the groups of a
//     split, plus one group's worth for a split-K reduction), the fewest splits on ties, and at
//     least as many as the panel slice needs to fit 224 KB of shared memory (a forced factor is
//     raised to that and capped at the groups). wq_a at m <= 16 on 132 SMs: 20 splits of 2
//     groups, 6 CTAs of 13-14 units per split, every warp's bytes in flight at once.
//   * split-K: the warp stores its unit's f32 sums ([register][lane], coalesced); the last of the
//     unit's S warps to arrive (a counter per unit, zeroed by the prep kernel) adds the S partials
//     in split order and stores bf16. Within a split the blocks are added in ascending k. So the
//     order of every sum is fixed by the shape: deterministic, and the reference's value up to
//     the f32 summation order (kernels/fp8_linear.cu "Numerics").
//   * any k: k % 8 == 0 with 8-byte aligned codes takes 8-byte loads, otherwise byte loads
//     (load_w8); a partial last k32 block reads zero codes past k against a zero-padded panel,
//     and blocks past the split's end are skipped.
//
// Measured: not yet (docs/perf.md "FP8 linear"; examples/bench_fp8_linear.rs times it next to the
// other variants).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "include/dsv41_fp8_linear.h"
#include "include/dsv41_fp8_stream.cuh"
#include "include/dsv41_hopper.cuh"
#include "include/dsv41_launch.cuh"

namespace dsv41 {
namespace fp8 {

constexpr int kWarps = 16;
constexpr int kWarpThreads = 32 * kWarps;
constexpr int kUnitRows = 16;
constexpr int kGroup = 4;                     // k32 blocks per load group
// Load groups in flight per warp: 2 (4 KB), 1 at NT = 8, where two groups' registers spill.
template <int NT>
__host__ __device__ constexpr int depth() { return NT >= 8 ? 1 : 2; }
constexpr int kWarpSmemMax = 224 * 1024;      // dynamic shared memory at most (the sm_90 opt-in limit is 227 KB)

// Bytes per panel row in shared memory for nblk k32 blocks (64 bytes each): 64 mod 128, so the
// 8 rows g of a quarter warp's 16-byte reads fall in distinct banks.
__host__ __device__ constexpr int panel_row_bytes(int nblk) { return 128 * ((nblk + 1) / 2) + 64; }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// grid = splits x parts CTAs of 16 warps; dynamic shared memory: the panel slice [TOK][prow]
// bytes, then (ACTQ) the activation scales [blocks of the split][TOK] f32. a.mpad == TOK (one
// token chunk). See the header comment.
template <int NT, bool ACTQ, bool VEC>
__global__ void __launch_bounds__(kWarpThreads, 1) fp8_warp_kernel(const StreamArgs a) {
    constexpr int TOK = 8 * NT, D = depth<NT>(), R = 4 * NT;
    extern __shared__ __align__(16) uint8_t smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int units = (a.n + kUnitRows - 1) / kUnitRows, gt = (a.kb + kGroup - 1) / kGroup;
    const int s = blockIdx.x / a.parts, part = blockIdx.x - s * a.parts;
    const int g0 = static_cast<int>(static_cast<int64_t>(s) * gt / a.splits);
    const int g1 = static_cast<int>(static_cast<int64_t>(s + 1) * gt / a.splits);
    const int kb0 = kGroup * g0, kb1 = min(kGroup * g1, a.kb), ng = g1 - g0, nblk = kb1 - kb0;
    const int ub = static_cast<int>(static_cast<int64_t>(part) * units / a.parts);
    const int ue = static_cast<int>(static_cast<int64_t>(part + 1) * units / a.parts);
    // The warp's steps: its units x the split's groups.
    const int steps = (ub + warp < ue ? (ue - ub - warp + kWarps - 1) / kWarps : 0) * ng;
    const uint64_t pol = evict_first_policy();

    // Load side: unit lu, group lj of the next load. The lane's rows g and g + 8 of the unit (a
    // row past n reads row n - 1: its sums are never stored) and the unit's scale row (one
    // 32-row scale block holds the 16 rows); the addresses are recomputed per group, which
    // keeps fewer registers live than carried pointers.
    int lu = ub + warp, lj = 0;
    uint2 cw[D][kGroup][2];
    uint32_t scw[D];
    // The next group into buffer d (no loads, zeros, when !live: past the warp's last step).
    auto issue = [&](int d, bool live) {
        const int kbg = kb0 + kGroup * lj;
        const int r0 = min(kUnitRows * lu + g, a.n - 1), r1 = min(kUnitRows * lu + g + 8, a.n - 1);
        const uint8_t* p0 = a.codes + static_cast<int64_t>(r0) * a.k;
        const uint8_t* p1 = a.codes + static_cast<int64_t>(r1) * a.k;
        const uint8_t* ps = a.scales + static_cast<int64_t>(lu >> 1) * a.kb + kbg;
        uint32_t sw = 0u;
#pragma unroll
        for (int b = 0; b < kGroup; ++b) {
            const bool ok = live && kbg + b < kb1;
            cw[d][b][0] = load_w8<VEC>(p0, (kbg + b) * 32 + 8 * t, a.k, ok, pol);
            cw[d][b][1] = load_w8<VEC>(p1, (kbg + b) * 32 + 8 * t, a.k, ok, pol);
            if (ok) sw |= static_cast<uint32_t>(__ldg(ps + b)) << (8 * b);
        }
        scw[d] = sw;
        if (++lj == ng) {
            lj = 0;
            lu += kWarps;
        }
    };
#pragma unroll
    for (int d = 0; d < D; ++d) issue(d, d < steps);
    // Programmatic dependent launch: the weight loads above may overlap the prep kernel; the
    // panel, its scales and the counters are read only after it has finished.
    asm volatile("griddepcontrol.wait;" ::: "memory");

    // The CTA's panel slice and activation scales into shared memory.
    const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const int chunks = 4 * nblk;  // 16-byte chunks per token row
    const uint16_t* psrc = a.panel + static_cast<int64_t>(kb0) * 32;
    for (int i = threadIdx.x; i < TOK * chunks; i += kWarpThreads) {
        const int tk = i / chunks, c = i - tk * chunks;
        cp_async16(sbase + tk * a.prow + 16 * c, psrc + static_cast<int64_t>(tk) * a.kpad + 8 * c);
    }
    const int as_off = TOK * a.prow;
    if constexpr (ACTQ) {
        const float* asrc = a.ascale + static_cast<int64_t>(kb0) * TOK;  // [kb, TOK]: the split's blocks are contiguous
        for (int i = threadIdx.x; i < nblk * TOK / 4; i += kWarpThreads) cp_async16(sbase + as_off + 16 * i, asrc + 4 * i);
    }
    dsv41_ptx::cp_async_commit();
    dsv41_ptx::cp_async_wait_group<0>();
    __syncthreads();
    if (steps == 0) return;

    // The unit's sums: bf16 stores, or (split-K) the partial and, in the unit's last warp to
    // arrive, the sum of the partials in split order.
    float acc[1][NT][4] = {};
    auto finish_unit = [&](int u) {
        if (a.splits > 1) {
            float* mine = a.ws + (static_cast<int64_t>(u) * a.splits + s) * (R * 32) + lane;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) mine[(4 * nt + e) * 32] = acc[0][nt][e];
            __threadfence();
            __syncwarp();
            unsigned last = 0u;
            if (lane == 0) last = atomicAdd(a.ctr + u, 1u) == static_cast<unsigned>(a.splits - 1) ? 1u : 0u;
            if (__shfl_sync(0xffffffffu, last, 0) == 0u) return;
            __threadfence();
            const float* p = a.ws + static_cast<int64_t>(u) * a.splits * (R * 32) + lane;
            constexpr int B = R >= 16 ? 1 : 32 / R;  // partials loaded at a time (32 floats per lane; 16 from NT = 4 on)
            float sum[R];
#pragma unroll
            for (int j = 0; j < R; ++j) sum[j] = 0.0f;
            for (int s0 = 0; s0 < a.splits; s0 += B) {
                float v[B][R];
#pragma unroll
                for (int q = 0; q < B; ++q) {
                    if (s0 + q >= a.splits) break;
#pragma unroll
                    for (int j = 0; j < R; ++j) v[q][j] = __ldcg(p + (static_cast<int64_t>(s0 + q) * R + j) * 32);
                }
#pragma unroll
                for (int q = 0; q < B; ++q) {
                    if (s0 + q >= a.splits) break;
#pragma unroll
                    for (int j = 0; j < R; ++j) sum[j] += v[q][j];
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[0][nt][e] = sum[4 * nt + e];
        }
        // Lane (g, t): rows g, g + 8 of the unit (registers 0-1 / 2-3), tokens 2t, 2t + 1 of each tile.
        const OutBlock ob = out_block(a, kUnitRows * u);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = kUnitRows * u + g + (e >= 2 ? 8 : 0), tok = 8 * nt + 2 * t + (e & 1);
                if (r < a.n && tok < a.m) *ob.at(tok, r) = __float2bfloat16_rn(acc[0][nt][e]);
            }
    };

    // Compute side: unit cu, group cj of the next products. Buffer d takes the load D groups
    // ahead once its products are issued.
    int cu = ub + warp, cj = 0;
    const uint8_t* pbase = smem + g * a.prow + 16 * t;
    const float* asb = reinterpret_cast<const float*>(smem + as_off);
    for (int q0 = 0; q0 < steps; q0 += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            if (q0 + d >= steps) break;
#pragma unroll
            for (int b = 0; b < kGroup; ++b) {
                const int bi = kGroup * cj + b;  // block of the split
                if (kb0 + bi >= kb1) break;
                block_step<NT, ACTQ>(acc, cw[d][b], e8m0_f32((scw[d] >> (8 * b)) & 0xffu), t, reinterpret_cast<const uint4*>(pbase + 64 * bi),
                                     8 * a.prow / 16, asb + bi * TOK);
            }
            issue(d, q0 + d + D < steps);
            if (++cj == ng) {
                finish_unit(cu);
                cj = 0;
                cu += kWarps;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[0][nt][e] = 0.0f;
            }
        }
    }
}

// ---------------------------------------------------------------------------------- host side

WarpPlan warp_plan(int n, int kb, int tok, bool act_quant, int splits) {
    const int units = (n + kUnitRows - 1) / kUnitRows, gt = (kb + kGroup - 1) / kGroup, sms = dsv41_launch::sm_count();
    // The most groups per split whose panel slice fits: tok x (256 g + 64) bytes of panel and
    // (act quant) tok x 16 g of scales.
    const int gmax = (kWarpSmemMax / tok - 64) / (256 + (act_quant ? 16 : 0));
    const int s_min = (gt + gmax - 1) / gmax;
    auto parts_of = [&](int s) {
        const int p = sms / s > 1 ? sms / s : 1;
        return p < units ? p : units;
    };
    int best = s_min;
    if (splits > 0) {
        best = splits < s_min ? s_min : splits;
    } else {
        // The least work of the busiest warp: its units x the groups of a split (+1 for the
        // split-K reduction); the fewest splits on ties.
        int64_t best_cost = -1;
        const int s_hi = gt < sms ? gt : sms;
        for (int s = s_min; s <= (s_hi > s_min ? s_hi : s_min); ++s) {
            const int p = parts_of(s);
            const int64_t per_cta = (units + p - 1) / p, per_warp = (per_cta + kWarps - 1) / kWarps;
            const int64_t cost = per_warp * ((gt + s - 1) / s) + (s > 1 ? 1 : 0);
            if (best_cost < 0 || cost < best_cost) {
                best_cost = cost;
                best = s;
            }
        }
    }
    if (best > gt) best = gt;
    WarpPlan w;
    w.splits = best;
    w.parts = parts_of(best);
    const int nblk = 4 * ((gt + best - 1) / best) < kb ? 4 * ((gt + best - 1) / best) : kb;
    w.prow = panel_row_bytes(nblk);
    w.smem = tok * w.prow + (act_quant ? 4 * tok * nblk : 0);
    return w;
}

template <int NT, bool ACTQ, bool VEC>
cudaError_t launch_warp_t(const StreamArgs& a, cudaStream_t st, int smem) {
    static thread_local int configured_dev = -1;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    e = dsv41_launch::set_max_dynamic_smem(fp8_warp_kernel<NT, ACTQ, VEC>, dev, kWarpSmemMax, configured_dev);
    if (e != cudaSuccess) return e;
    return dsv41_launch::launch_pdl(fp8_warp_kernel<NT, ACTQ, VEC>, dim3(a.splits * a.parts), dim3(kWarpThreads), smem, st, 1, a);
}

template <int NT, bool ACTQ>
cudaError_t launch_warp_v(const StreamArgs& a, bool vec8, cudaStream_t st, int smem) {
    return vec8 ? launch_warp_t<NT, ACTQ, true>(a, st, smem) : launch_warp_t<NT, ACTQ, false>(a, st, smem);
}

template <bool ACTQ>
cudaError_t launch_warp_nt(const StreamArgs& a, int nt, bool vec8, cudaStream_t st, int smem) {
    switch (nt) {
        case 1: return launch_warp_v<1, ACTQ>(a, vec8, st, smem);
        case 2: return launch_warp_v<2, ACTQ>(a, vec8, st, smem);
        case 4: return launch_warp_v<4, ACTQ>(a, vec8, st, smem);
        default: return launch_warp_v<8, ACTQ>(a, vec8, st, smem);
    }
}

cudaError_t launch_warp(const StreamArgs& args, const WarpPlan& w, int nt, bool act_quant, bool vec8, cudaStream_t st) {
    StreamArgs a = args;
    a.splits = w.splits;
    a.parts = w.parts;
    a.prow = w.prow;
    return act_quant ? launch_warp_nt<true>(a, nt, vec8, st, w.smem) : launch_warp_nt<false>(a, nt, vec8, st, w.smem);
}

}  // namespace fp8
}  // namespace dsv41
