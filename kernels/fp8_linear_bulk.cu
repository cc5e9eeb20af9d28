// fp8_linear BULK variant (DSV41_FP8_VARIANT_BULK; spec §2.4-§2.5, issue 21): the stream-K
// work of the PIPELINE variant (kernels/fp8_linear.cu, fp8_streamk_kernel: units of 128 rows x
// 128 bytes of K, a persistent grid, each CTA an equal contiguous run of units; the products and
// the partial sums of include/dsv41_fp8_stream.cuh: the same numerics, and the same bits where the
// two grids have as many CTAs) with the bytes brought in by a copying warp instead of by the
// computing threads.
//
// Why: at m <= 16 the 42 MB weights stream at 1.6-1.7 TB/s on an H100, 0.63x the read ceiling's
// time, and ncu finds the kernels latency-bound: too few bytes in flight per SM (docs/perf.md
// "FP8 linear"). PIPELINE holds 3-4 stages of ~21 KB and every unit costs a CTA barrier, so a
// slow warp stalls the copies of all. Here:
//   * CTA = 4 computing warps (warp w: row block w of the unit, as in PIPELINE) + 1 copying warp.
//   * A ring of S stages (as many of streamk_stage_bytes as fit 200 KB: 9 at NT = 1, 5 at NT = 8)
//     with a full and an empty mbarrier per stage. The copying warp waits for a stage to be empty,
//     posts its byte count (mbarrier.arrive.expect_tx) and issues TMA bulk copies
//     (cp.async.bulk ... complete_tx, L2 evict-first for the weights): one 128-byte copy per
//     weight row of the unit, one 256-byte copy per token row of the activation panel, one per
//     k32 block of the activation scales; the 4 weight-scale words by cp.async, whose completion
//     is the stage's second arrival (cp.async.mbarrier.arrive.noinc). Rows past n are not copied
//     (their products are computed from stale bytes and never stored).
//   * The computing warps wait for a stage to be full, compute it (streamk_stage_products), and
//     each warp's lane 0 arrives on its empty barrier; no CTA-wide barrier per unit. Where a run
//     leaves a row group they meet at named barrier 1 (128 threads) for the partial hand-over
//     (streamk_leave_group).
//   * Programmatic dependent launch: the weight copies of the first S units are issued before
//     griddepcontrol.wait, the activation copies after it (the prep kernel writes the panel).
// Requirements (the launcher checks them, else REGISTERS runs): k % 128 == 0, codes 16-byte and
// scales 4-byte aligned (as PIPELINE). Explicit only until measured faster than AUTO's choice.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "include/dsv41_fp8.cuh"
#include "include/dsv41_fp8_stream.cuh"
#include "include/dsv41_hopper.cuh"
#include "include/dsv41_launch.cuh"

namespace dsv41 {
namespace fp8 {

namespace {

using namespace dsv41_ptx;

constexpr int kBulkThreads = 160;  // 4 computing warps + the copying warp (warp 4)
constexpr int kBulkRingBytes = 200 * 1024;

template <int NT>
__host__ __device__ constexpr int bulk_stages() {
    return kBulkRingBytes / streamk_stage_bytes<NT>() < 16 ? kBulkRingBytes / streamk_stage_bytes<NT>() : 16;
}
template <int NT>
__host__ __device__ constexpr int bulk_smem() {
    return bulk_stages<NT>() * streamk_stage_bytes<NT>();
}

// A TMA bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global
// memory into this CTA's shared memory, completing as transactions on the mbarrier `bar`; with
// the L2 policy `pol` (bulk_g2s_hint) or the default one.
__device__ __forceinline__ void bulk_g2s_hint(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar, uint64_t pol) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar), "l"(pol)
                 : "memory");
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes),
                 "r"(bar)
                 : "memory");
}

template <int NT, bool ACTQ>
__global__ void __launch_bounds__(kBulkThreads, 1) fp8_bulk_kernel(const StreamArgs a) {
    constexpr int TOK = 8 * NT, S = bulk_stages<NT>(), SB = streamk_stage_bytes<NT>();
    constexpr int kPanelOff = 4 * kWarpStage, kAsOff = kPanelOff + TOK * kPst, kWsOff = kAsOff + 4 * TOK * 4;
    static_assert(SB % 16 == 0 && kPanelOff % 16 == 0 && kAsOff % 16 == 0 && (TOK * 4) % 16 == 0, "bulk copies need 16-byte offsets");
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ __align__(8) uint64_t full[S], empty[S];
    __shared__ int is_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nrg = (a.n + 127) / 128, sk = a.kb / kStepBlocks;
    const int64_t units = static_cast<int64_t>(a.mc) * nrg * sk;
    const int c = blockIdx.x, ctas = gridDim.x;
    const int64_t u0 = unit_begin(c, units, ctas), u1 = unit_begin(c + 1, units, ctas);
    const uint32_t ring = smem_addr(smem);
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(smem_addr(&full[s]), 2);   // the copier's expect_tx + its cp.async arrival
            mbar_init(smem_addr(&empty[s]), 4);  // one per computing warp
        }
        fence_mbar_init_cluster();
        fence_proxy_async();
    }
    __syncthreads();

    if (warp == 4) {
        // The copying warp. Unit u in stage s: weight rows by lane (rows lane + 32 q of the
        // group), panel rows by lane, activation scale blocks by lanes 0..3, weight-scale words
        // and the byte count by lane 0.
        const uint64_t pol = evict_first_policy();
        auto post = [&](int64_t u, int s) {  // the weights (before the prep kernel is done)
            const int st = static_cast<int>(u % sk), rg = static_cast<int>((u / sk) % nrg);
            const int rows = a.n - rg * 128 < 128 ? a.n - rg * 128 : 128;
            const uint32_t stage = ring + s * SB, bar = smem_addr(&full[s]);
            if (lane == 0) {
                for (int w = 0; w < 4; ++w) {
                    const int rb = rg * 4 + w;
                    const bool ok = rb * 32 < a.n;
                    cp_async4(stage + kWsOff + 4 * w, a.scales + (ok ? static_cast<int64_t>(rb) * a.kb + st * kStepBlocks : 0), ok);
                }
                cp_async_mbar_arrive(bar);
                mbar_arrive_expect_tx(bar, static_cast<uint32_t>(rows * 128 + TOK * 256 + (ACTQ ? 4 * TOK * 4 : 0)));
            }
            __syncwarp();
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int r = lane + 32 * q;
                if (r < rows)
                    bulk_g2s_hint(stage + q * kWarpStage + lane * kSrow, a.codes + static_cast<int64_t>(rg * 128 + r) * a.k + st * 128, 128, bar, pol);
            }
        };
        auto activations = [&](int64_t u, int s) {
            const int st = static_cast<int>(u % sk), tok0 = static_cast<int>(u / (static_cast<int64_t>(sk) * nrg)) * TOK;
            const uint32_t stage = ring + s * SB, bar = smem_addr(&full[s]);
            for (int tk = lane; tk < TOK; tk += 32)
                bulk_g2s(stage + kPanelOff + tk * kPst, a.panel + static_cast<int64_t>(tok0 + tk) * a.kpad + st * 128, 256, bar);
            if constexpr (ACTQ) {
                if (lane < kStepBlocks)
                    bulk_g2s(stage + kAsOff + lane * TOK * 4, a.ascale + static_cast<int64_t>(st * kStepBlocks + lane) * a.mpad + tok0, TOK * 4, bar);
            }
        };
        const int64_t head = u1 - u0 < S ? u1 - u0 : S;
        for (int64_t i = 0; i < head; ++i) post(u0 + i, static_cast<int>(i));
        grid_dep_wait();
        for (int64_t i = 0; i < head; ++i) activations(u0 + i, static_cast<int>(i));
        for (int64_t u = u0 + head; u < u1; ++u) {
            const int64_t i = u - u0;
            const int s = static_cast<int>(i % S);
            mbar_wait(smem_addr(&empty[s]), static_cast<uint32_t>(((i / S) & 1) ^ 1));
            post(u, s);
            activations(u, s);
        }
        return;
    }

    // The computing warps.
    const int g = lane >> 2, t = lane & 3;
    grid_dep_wait();  // the counters and partials are read after the prep kernel
    float acc[2][NT][4] = {};
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t i = u - u0;
        const int s = static_cast<int>(i % S);
        mbar_wait(smem_addr(&full[s]), static_cast<uint32_t>((i / S) & 1));
        streamk_stage_products<NT, ACTQ>(acc, smem + s * SB, warp, g, t);
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&empty[s]));
        const int64_t grp = u / sk;  // chunk * nrg + row group
        if (static_cast<int>(u % sk) != sk - 1 && u + 1 < u1) continue;
        const int rb = static_cast<int>(grp % nrg) * 4 + warp, tok0 = static_cast<int>(grp / nrg) * TOK;
        streamk_leave_group<NT, ComputeSync>(acc, a, &is_last, grp, u0, units, c, ctas, warp, lane, g, t, rb * 32, tok0);
        zero_acc<NT>(acc);
    }
}

template <int NT, bool ACTQ>
int bulk_per_sm_t() {
    return dsv41_launch::resident_per_sm<fp8_bulk_kernel<NT, ACTQ>>(kBulkThreads, bulk_smem<NT>());
}

template <bool ACTQ>
cudaError_t launch_bulk_t(const StreamArgs& a, int ctas, int nt, cudaStream_t st) {
    // bulk_per_sm (make_plan) set the kernel's shared memory limit.
    switch (nt) {
        case 1: return dsv41_launch::launch_pdl(fp8_bulk_kernel<1, ACTQ>, dim3(ctas), dim3(kBulkThreads), bulk_smem<1>(), st, 1, a);
        case 2: return dsv41_launch::launch_pdl(fp8_bulk_kernel<2, ACTQ>, dim3(ctas), dim3(kBulkThreads), bulk_smem<2>(), st, 1, a);
        case 4: return dsv41_launch::launch_pdl(fp8_bulk_kernel<4, ACTQ>, dim3(ctas), dim3(kBulkThreads), bulk_smem<4>(), st, 1, a);
        default: return dsv41_launch::launch_pdl(fp8_bulk_kernel<8, ACTQ>, dim3(ctas), dim3(kBulkThreads), bulk_smem<8>(), st, 1, a);
    }
}

}  // namespace

int bulk_per_sm(int nt, bool act_quant) {
    switch (nt) {
        case 1: return act_quant ? bulk_per_sm_t<1, true>() : bulk_per_sm_t<1, false>();
        case 2: return act_quant ? bulk_per_sm_t<2, true>() : bulk_per_sm_t<2, false>();
        case 4: return act_quant ? bulk_per_sm_t<4, true>() : bulk_per_sm_t<4, false>();
        default: return act_quant ? bulk_per_sm_t<8, true>() : bulk_per_sm_t<8, false>();
    }
}

cudaError_t launch_bulk(const StreamArgs& a, int ctas, int nt, bool act_quant, cudaStream_t st) {
    return act_quant ? launch_bulk_t<true>(a, ctas, nt, st) : launch_bulk_t<false>(a, ctas, nt, st);
}

}  // namespace fp8
}  // namespace dsv41
