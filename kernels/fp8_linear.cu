// fp8_linear: the block-scaled FP8 linear of the release's dense weights (spec §2.4-§2.5, issue
// 21) without dequantizing the weight: y[m, n] = bf16( sum_k xq[m, k] * W[n, k] ), f32
// accumulation, where W[n, k] = e4m3(codes[n, k]) * 2^(S[n/32, k/32] - 127) (32x32 blocks, e8m0
// scale bytes, 255 = NaN) and xq = Q1(x) (1x32 e4m3 activation quantization with a power-of-two
// scale, spec §0.1b.8) when act_quant is on, else x. CPU reference: quant::fp8_linear_ref (the
// crate's nn::Linear over the dequantized weight); GPU tests: tests/cuda_fp8_linear.rs.
//
// Layout: x [m, k] bf16, codes [n, k] u8, scales [ceil(n/32), ceil(k/32)] u8, out [m, n] bf16,
// all contiguous row-major. Two outputs (n_first > 0, a multiple of 32): two linears of one input
// stacked along N (the attention's wq_a and wkv, spec §4.1; its wq_b and the indexer's wq_b) -
// features 0 .. n_first go to out [m, n_first], the rest to out2 [m, n - n_first]; a 32-row
// block lies in one of them, so every store finds its output once per block
// (include/dsv41_fp8_stream.cuh, out_block). The exact dequantization W -> bf16 / f32 (the
// large-m path's first step) is kernels/fp8_dequant.cu; the FP8 wgmma GEMM kernels/fp8_gemm.cu; the WARP variant of
// the weight streaming kernels/fp8_linear_warp.cu (the device pieces all variants share:
// include/dsv41_fp8_stream.cuh).
//
// Design (weight streaming, m <= 256; decode is m <= 64): the weight is read once from HBM and
// every byte meets all m tokens on the tensor cores.
//   * prep kernel: the activation panel [mpad, kpad] of 16-bit elements (the f16 e4m3 code
//     values of Q1(x) with the block scales 2^e as f32 [kb, mpad]; or the bf16 x itself),
//     zero-padded to whole 32-blocks and token tiles, and the split-K arrival counters zeroed.
//     It lets the stream kernel launch early (programmatic dependent launch): that one starts
//     its weight copies, then waits for the panel (griddepcontrol.wait).
//   * products (every variant): a warp computes one 32-row block of W (one e8m0 scale row; WARP:
//     16 rows of one) x a chunk of 8*NT <= 64 tokens. Per k32 block a lane holds 8 code bytes of
//     each of its 4 rows (WARP: 2), converts them exactly to f16 (cvt.rn.f16x2.e4m3x2; bf16 via
//     f32 when act quant is off) and runs mma.sync m16n8k16 with the weight as A (2 m16 tiles;
//     WARP: 1) and the tokens as B (NT n8 tiles, 16-byte panel loads), 2G independent products
//     at a time.
//     The K order inside a block is permuted (lane quad t owns k = 8t..8t+7 of every row and
//     token; a dot product does not care), so the panel and the code bytes line up without
//     shuffles. Each k32 block's product goes to a fresh accumulator that is added to the
//     running sum times 2^(sa + sw) (one FFMA per output element and block): the reference's
//     per-block scales, applied in f32. Partial sums always meet in a fixed order, so results
//     are deterministic.
//   * How the bytes arrive (DSV41_FP8_VARIANT_*): PIPELINE (k % 128 == 0; design above
//     fp8_streamk_kernel): stream-K over units of 128 rows x 128 bytes of K, a persistent grid
//     whose CTAs each stream an equal contiguous run of units through a cp.async ring in shared
//     memory (16 bytes per lane, whole 128-byte lines per instruction, 3-4 stages of 16 KB of
//     weights), the panel chunk of each stage shared by the CTA's 4 warps; partial row groups at
//     the ends of a run are added deterministically by the group's last CTA. REGISTERS (any k):
//     a CTA per 32-row block x split of K x token chunk, 8-byte loads per lane and row (byte
//     loads where k % 8 != 0), 4 k32 blocks in flight per warp in a register ring, the panel read
//     through L1; split-K partials are added in split order by the tile's last CTA (about 3 CTAs
//     per SM, at least 16 k32 blocks per CTA). WARP (any k, m <= 64; explicit only until timed,
//     design in kernels/fp8_linear_warp.cu): the warp-owned streaming of kernels/moe_experts.cu -
//     a unit of 16 rows x a split of K is owned by one warp, which loads its codes and scales
//     straight from global memory into registers in the fragment pattern, 2 groups of 4 k32
//     blocks ahead of the products across its units; a persistent grid of 16-warp CTAs, each
//     with one K split and an equal contiguous run of units, its panel slice copied into shared
//     memory once; no weight ring, no per-stage barrier, no cross-warp reduction; split-K
//     partials added in split order by the unit's last warp.
//   * Why stream-K (docs/perf.md "FP8 linear"): with a CTA per 32-row block, every CTA read
//     only 40-340 KB and waited for its first bytes; the measured time was ~5.6 us plus the
//     bytes at 2.3 TB/s on an H100, whether the bytes came through registers or a 3-stage
//     cp.async pipeline per warp.
//   * Why WARP: at m <= 16 REGISTERS and stream-K reach 1.6-1.7 TB/s on the 42 MB shapes,
//     0.63x the read ceiling's time (docs/perf.md "FP8 linear"); the MoE experts' kernel went 2x
//     faster when its shared-memory weight ring with a CTA barrier per stage (instruction-bound,
//     ncu) became warp-owned register streaming. WARP removes the costs of that kind here:
//     stream-K's barrier per stage, REGISTERS' grid of short CTAs that each wait for their first
//     bytes and reduce across warps. Whether it is faster is the bench's to say
//     (examples/bench_fp8_linear.rs times the three variants in one run).
//
// Numerics: the products of e4m3 codes are exact in f16 x f16 -> f32 tensor-core products;
// with act quant off, bf16 x times the code is exact too. A block's 32 products are summed by
// the tensor core in f32, then scaled by the power of two 2^(sa + sw) (exact unless it leaves
// the f32 range: a scale product above 2^127 is clamped to FLT_MAX so that an all-zero block
// stays zero; below 2^-149 it is 0 - never with the Q1 scales, which are >= 2^-22), then added
// in f32. So the result equals the reference up to the order of the f32 summation; outputs are
// rounded to bf16 once (RNE). Scale byte 255 (NaN) gives NaN like the reference.
//
// Measured: docs/perf.md "FP8 linear" (figures, card, command); numerics: at most a few in 10^4
// outputs one bf16 ulp off the CPU reference (tests/cuda_fp8_linear.rs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>

#include "include/dsv41_fp8.cuh"
#include "include/dsv41_fp8_linear.h"
#include "include/dsv41_fp8_stream.cuh"
#include "include/dsv41_hopper.cuh"
#include "include/dsv41_launch.cuh"
#include "include/dsv41_numerics.cuh"

namespace dsv41 {
namespace fp8 {

constexpr int kThreads = 128;   // 4 warps per CTA
constexpr int kMinBlocksPerSplit = 16;
constexpr int kPrepThreads = 256;

// Stores 4 consecutive outputs (row tok, columns n0..n0+3) as bf16.
__device__ __forceinline__ void store_out4(const StreamArgs& a, int tok, int n0, float4 v) {
    if (tok >= a.m) return;
    // n0 is a multiple of 4 and n1 of 32: the 4 outputs lie in one of the two outputs.
    const OutBlock ob = out_block(a, n0);
    const int w = ob.width, c0 = n0 - ob.first;
    __nv_bfloat16* o = ob.at(tok, n0);
    if ((w & 3) == 0 && c0 + 3 < w) {
        __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
        uint2 w;
        w.x = *reinterpret_cast<uint32_t*>(&lo);
        w.y = *reinterpret_cast<uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(o) = w;
    } else {
        const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int c = 0; c < 4; ++c)
            if (c0 + c < w) o[c] = __float2bfloat16_rn(f[c]);
    }
}

constexpr int kLd = 36;        // padded row (32 rows + 4) of the reduction tile: conflict-free, float4-aligned

// The CTA's epilogue: the 4 warps' sums meet in red (fixed order), then bf16 stores, or with
// split-K an f32 partial and, in the last CTA of the tile to arrive, the sum of the partials in
// split order. red: [4][8 NT][kLd] floats; the caller's warps may still read other shared data.
template <int NT>
__device__ __forceinline__ void finish(const float (&acc)[2][NT][4], float* red, int* is_last, const StreamArgs& a, int warp, int g, int t) {
    constexpr int TOK = 8 * NT;
    const int mc = blockIdx.x, rb = blockIdx.y, s = blockIdx.z, tok0 = mc * TOK;
    float* mine = red + warp * TOK * kLd;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int tk = 8 * nt + 2 * t, r = 16 * mt + g;
            mine[tk * kLd + r] = acc[mt][nt][0];
            mine[(tk + 1) * kLd + r] = acc[mt][nt][1];
            mine[tk * kLd + r + 8] = acc[mt][nt][2];
            mine[(tk + 1) * kLd + r + 8] = acc[mt][nt][3];
        }
    __syncthreads();

    const int n_base = rb * 32;
    const int64_t tile = static_cast<int64_t>(rb) * a.mc + mc;
    for (int it = threadIdx.x; it < TOK * 8; it += kThreads) {
        const int tk = it >> 3, q = (it & 7) * 4;
        float4 v = *reinterpret_cast<const float4*>(red + tk * kLd + q);
#pragma unroll
        for (int w = 1; w < 4; ++w) {
            const float4 u = *reinterpret_cast<const float4*>(red + (w * TOK + tk) * kLd + q);
            v.x += u.x;
            v.y += u.y;
            v.z += u.z;
            v.w += u.w;
        }
        if (a.splits == 1) store_out4(a, tok0 + tk, n_base + q, v);
        else *reinterpret_cast<float4*>(a.ws + ((tile * a.splits + s) * TOK + tk) * 32 + q) = v;
    }
    if (a.splits == 1) return;

    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *is_last = atomicAdd(a.ctr + tile, 1u) == static_cast<unsigned>(a.splits - 1);
    __syncthreads();
    if (!*is_last) return;
    __threadfence();
    if (threadIdx.x == 0) a.ctr[tile] = 0u;  // every split has arrived: ready for the next call
    for (int it = threadIdx.x; it < TOK * 8; it += kThreads) {
        const int tk = it >> 3, q = (it & 7) * 4;
        const float* p = a.ws + (tile * a.splits * TOK + tk) * 32 + q;
        float4 v = __ldcg(reinterpret_cast<const float4*>(p));
        for (int sp = 1; sp < a.splits; ++sp) {
            const float4 u = __ldcg(reinterpret_cast<const float4*>(p + static_cast<int64_t>(sp) * TOK * 32));
            v.x += u.x;
            v.y += u.y;
            v.z += u.z;
            v.w += u.w;
        }
        store_out4(a, tok0 + tk, n_base + q, v);
    }
}

// Register-ring variant (any k and alignment): grid (mc, ceil(n/32), splits), 128 threads; warp
// w takes the k32 blocks w, w+4, ... of the split, 4 of them in flight (8-byte loads per lane
// and row, or byte loads when !VEC). See the header comment.
template <int NT, bool ACTQ, bool VEC, bool FUSED>
__global__ void __launch_bounds__(kThreads, NT >= 4 ? 3 : 4) fp8_stream_kernel(const StreamArgs a) {
    constexpr int D = 4;
    __shared__ __align__(16) float red[4 * 8 * NT * kLd];
    __shared__ int is_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int rb = blockIdx.y, s = blockIdx.z, tok0 = blockIdx.x * 8 * NT;
    const int kb_begin = static_cast<int>(static_cast<int64_t>(s) * a.kb / a.splits);
    const int kb_end = static_cast<int>(static_cast<int64_t>(s + 1) * a.kb / a.splits);
    const uint64_t pol = evict_first_policy();

    const uint8_t* rows[4];
    bool row_ok[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = rb * 32 + g + 8 * i;
        row_ok[i] = r < a.n;
        rows[i] = a.codes + static_cast<int64_t>(row_ok[i] ? r : 0) * a.k;
    }
    const uint8_t* srow = a.scales + static_cast<int64_t>(rb) * a.kb;

    float acc[2][NT][4] = {};

    uint2 buf[D][4];
    uint32_t sbuf[D];
    auto issue = [&](int slot, int kb) {
        const bool ok = kb < kb_end;
#pragma unroll
        for (int i = 0; i < 4; ++i) buf[slot][i] = load_w8<VEC>(rows[i], kb * 32 + 8 * t, a.k, ok && row_ok[i], pol);
        sbuf[slot] = ok ? static_cast<uint32_t>(__ldg(srow + kb)) : 0u;
    };
    const int first = kb_begin + warp;
#pragma unroll
    for (int d = 0; d < D; ++d) issue(d, first + 4 * d);
    // Programmatic dependent launch: the weight loads above may overlap the previous kernel (the
    // prep kernel, or with FUSED whatever wrote x); x, the panel, its scales and the counters
    // are read only after it has finished.
    asm volatile("griddepcontrol.wait;" ::: "memory");

    for (int base = first; base < kb_end; base += 4 * D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int kb = base + 4 * d;
            if (kb >= kb_end) break;
            uint2 w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) w[i] = buf[d][i];
            const float sw = e8m0_f32(sbuf[d]);
            issue(d, kb + 4 * D);
            if constexpr (FUSED) {
                block_step_fused<NT, ACTQ>(acc, w, sw, g, t, a.x, a.m, a.k, tok0, kb);
            } else {
                const uint4* pb = reinterpret_cast<const uint4*>(a.panel) + ((static_cast<int64_t>(tok0 + g) * a.kpad + kb * 32 + 8 * t) >> 3);
                block_step<NT, ACTQ>(acc, w, sw, t, pb, a.kpad, a.ascale + static_cast<int64_t>(kb) * a.mpad + tok0);
            }
        }
    }
    finish<NT>(acc, red, &is_last, a, warp, g, t);
}

// Stream-K pipeline variant (k % 128 == 0, 16-byte aligned codes, 4-byte aligned scales). The
// work is the sequence of units (token chunk, row group of 128 rows = 4 row blocks, stage of
// 128 k = 4 k32 blocks), row-group-major; a persistent grid of `ctas` CTAs (every SM filled
// once, at least kMinUnits units each) splits it into equal contiguous ranges, so every CTA
// streams the same number of weight bytes back to back through one cp.async ring whatever N and
// K are (no waves, no per-tile ramp-up). Warp w computes row block w of the group. A stage holds
// everything its products read - the 4 warps' weight rows, the chunk's panel rows (tokens x 128
// k, 16-bit) and activation scales, the 4 x 4 weight scale bytes - so no load waits inside the
// products (a scale read from global memory there put one memory latency per unit on the
// critical path: twice the time of the pure read, measured). Where a range starts or ends inside
// a row group, the CTA stores its f32 partial (registers as they are: [warp][register][lane]) in
// one of two slots of its own, and the last of the group's contributors to arrive (a counter per
// group) adds the partials in CTA order: deterministic.
template <int NT>
__host__ __device__ constexpr int streamk_stages() { return NT <= 2 ? 4 : 3; }
template <int NT>
__host__ __device__ constexpr int streamk_smem() { return streamk_stages<NT>() * streamk_stage_bytes<NT>(); }

template <int NT, bool ACTQ>
__global__ void __launch_bounds__(kThreads, 1) fp8_streamk_kernel(const StreamArgs a) {
    constexpr int TOK = 8 * NT, S = streamk_stages<NT>(), SB = streamk_stage_bytes<NT>();
    constexpr int kPanelOff = 4 * kWarpStage, kAsOff = kPanelOff + TOK * kPst, kWsOff = kAsOff + 4 * TOK * 4;
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int is_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nrg = (a.n + 127) / 128, sk = a.kb / kStepBlocks;
    const int64_t units = static_cast<int64_t>(a.mc) * nrg * sk;
    const int c = blockIdx.x, ctas = gridDim.x;
    const int64_t u0 = unit_begin(c, units, ctas), u1 = unit_begin(c + 1, units, ctas);
    const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

    // Copies of unit u into slot. Weights: the warp's 32 rows x 128 bytes (8 x 16 bytes per lane)
    // and its 4 scale bytes; activations (after the prep kernel): the chunk's TOK panel rows x
    // 256 bytes and (ACTQ) 4 blocks x TOK scales, over the CTA's threads.
    const int crow = lane >> 3, cchunk = lane & 7;
    auto load_w = [&](int slot, int64_t u) {
        const int st = static_cast<int>(u % sk), rb = static_cast<int>((u / sk) % nrg) * 4 + warp;
        const uint32_t base = smem_addr + slot * SB;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int r = 4 * i + crow, row = rb * 32 + r;
            const bool ok = row < a.n;
            dsv41_ptx::cp_async16_l2(base + warp * kWarpStage + r * kSrow + 16 * cchunk, a.codes + (ok ? static_cast<int64_t>(row) * a.k + st * 128 + 16 * cchunk : 0), ok);
        }
        if (lane == 0) {
            const bool ok = rb * 32 < a.n;
            const uint8_t* src = a.scales + (ok ? static_cast<int64_t>(rb) * a.kb + st * kStepBlocks : 0);
            dsv41_ptx::cp_async4(base + kWsOff + 4 * warp, src, ok);
        }
    };
    auto load_act = [&](int slot, int64_t u) {
        const int st = static_cast<int>(u % sk), tok0 = static_cast<int>(u / (static_cast<int64_t>(sk) * nrg)) * TOK;
        const uint32_t base = smem_addr + slot * SB;
        for (int i = threadIdx.x; i < TOK * 16; i += kThreads) {
            const int tk = i >> 4, ch = i & 15;
            dsv41_ptx::cp_async16_l2(base + kPanelOff + tk * kPst + 16 * ch, a.panel + static_cast<int64_t>(tok0 + tk) * a.kpad + st * 128 + 8 * ch, true);
        }
        if constexpr (ACTQ) {
            if (threadIdx.x < TOK) {  // 4 blocks x TOK / 4 chunks of 4 scales
                const int blk = threadIdx.x / (TOK / 4), part = threadIdx.x % (TOK / 4);
                dsv41_ptx::cp_async16_l2(base + kAsOff + 16 * threadIdx.x, a.ascale + static_cast<int64_t>(st * kStepBlocks + blk) * a.mpad + tok0 + 4 * part, true);
            }
        }
    };
    // Prologue: the weights of the first S - 1 units may overlap the prep kernel (programmatic
    // dependent launch); the activations are read after it has finished.
    for (int d = 0; d < S - 1; ++d)
        if (u0 + d < u1) load_w(d, u0 + d);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int d = 0; d < S - 1; ++d) {
        if (u0 + d < u1) load_act(d, u0 + d);
        dsv41_ptx::cp_async_commit();
    }

    float acc[2][NT][4] = {};
    for (int64_t u = u0; u < u1; ++u) {
        const int i = static_cast<int>(u - u0);
        dsv41_ptx::cp_async_wait_group<S - 2>();
        __syncthreads();  // the stage is complete for every thread; slot (i - 1) % S is free
        if (u + S - 1 < u1) {
            load_w((i + S - 1) % S, u + S - 1);
            load_act((i + S - 1) % S, u + S - 1);
        }
        dsv41_ptx::cp_async_commit();
        const int64_t grp = u / sk;  // chunk * nrg + row group
        const int st = static_cast<int>(u % sk), rb = static_cast<int>(grp % nrg) * 4 + warp;
        const int tok0 = static_cast<int>(grp / nrg) * TOK;
        streamk_stage_products<NT, ACTQ>(acc, smem + (i % S) * SB, warp, g, t);
        if (st != sk - 1 && u + 1 < u1) continue;
        // The range leaves this row group: store, or hand the partial to the group's last CTA.
        streamk_leave_group<NT>(acc, a, &is_last, grp, u0, units, c, ctas, warp, lane, g, t, rb * 32, tok0);
        zero_acc<NT>(acc);
    }
    dsv41_ptx::cp_async_wait_group<0>();
}

// One warp per (token row of the panel, k32 block): the panel row's 32 elements and, with
// ACTQ, the block's scale; padding rows / columns are zeros (scale 0). Also zeroes ctr.
template <bool ACTQ>
__global__ void __launch_bounds__(kPrepThreads) fp8_prep_kernel(const __nv_bfloat16* __restrict__ x, uint16_t* __restrict__ panel,
                                                                 float* __restrict__ ascale, unsigned* __restrict__ ctr, int n_ctr, int m,
                                                                 int k, int kb, int kpad, int mpad) {
    // Let the stream kernel start loading weights (it waits for this grid before reading).
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int64_t gid = static_cast<int64_t>(blockIdx.x) * kPrepThreads + threadIdx.x;
    for (int64_t i = gid; i < n_ctr; i += static_cast<int64_t>(gridDim.x) * kPrepThreads) ctr[i] = 0u;
    const int64_t gw = gid >> 5;
    const int lane = threadIdx.x & 31;
    if (gw >= static_cast<int64_t>(mpad) * kb) return;  // whole warps leave together
    const int row = static_cast<int>(gw / kb), blk = static_cast<int>(gw % kb);
    const int kk = blk * 32 + lane;
    const bool in = row < m && kk < k;
    const __nv_bfloat16 xv = in ? x[static_cast<int64_t>(row) * k + kk] : __float2bfloat16_rn(0.0f);
    uint16_t out;
    if constexpr (ACTQ) {
        using Q1 = QuantTraits<Quant::Fp8Ue8m0B32>;
        const float v = __bfloat162float(xv);
        float amax = fabsf(v);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        const BlockScale bs = Q1::scale(amax);
        const __half h = __float2half_rn(Q1::round(Q1::quotient(v, bs)));  // an e4m3 value: exact
        out = *reinterpret_cast<const uint16_t*>(&h);
        if (lane == 0) ascale[static_cast<int64_t>(blk) * mpad + row] = row < m ? bs.s : 0.0f;
    } else {
        out = *reinterpret_cast<const uint16_t*>(&xv);
    }
    panel[static_cast<int64_t>(row) * kpad + kk] = out;
}

// ---------------------------------------------------------------------------------- launchers

struct Plan {
    int nt, tok, mc, mpad, kb, kpad, nb, splits;
    int ctas;  // stream-K grid: the SMs x resident CTAs per SM, at most the units
    bool warp; // the WARP variant runs (asked for, m <= kWarpMaxM)
    WarpPlan wp;
    int64_t panel_off, ascale_off, ws_off, ctr_off, bytes;
};

using dsv41_launch::align256;

using dsv41_launch::sm_count;

inline int validate(const Dsv41Fp8LinearParams* p, size_t params_size) {
    if (params_size != sizeof(Dsv41Fp8LinearParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->m < 1 || p->m > DSV41_FP8_STREAM_MAX_M || p->n < 1 || p->k < 1 || p->splits < 0) return DSV41_ERR_SHAPE;
    if (p->variant < DSV41_FP8_VARIANT_AUTO || p->variant > DSV41_FP8_VARIANT_WARP) return DSV41_ERR_SHAPE;
    if (p->prep < DSV41_FP8_PREP_AUTO || p->prep > DSV41_FP8_PREP_FUSED) return DSV41_ERR_SHAPE;
    if (p->act_quant && p->k % 32 != 0) return DSV41_ERR_SHAPE;
    if (p->n_first < 0 || p->n_first % 32 != 0 || (p->n_first > 0 && p->n_first >= p->n)) return DSV41_ERR_SHAPE;
    // Grid limits: ceil(n/32) CTAs in y (<= 65535).
    if ((p->n + 31) / 32 > 65535) return DSV41_ERR_SHAPE;
    return DSV41_OK;
}

// Resident stream-K CTAs per SM (its dynamic shared memory limit set once per device).
template <int NT, bool ACTQ>
int streamk_per_sm() {
    return dsv41_launch::resident_per_sm<fp8_streamk_kernel<NT, ACTQ>>(kThreads, streamk_smem<NT>());
}

template <bool ACTQ>
int streamk_per_sm_nt(int nt) {
    switch (nt) {
        case 1: return streamk_per_sm<1, ACTQ>();
        case 2: return streamk_per_sm<2, ACTQ>();
        case 4: return streamk_per_sm<4, ACTQ>();
        default: return streamk_per_sm<8, ACTQ>();
    }
}

inline Plan make_plan(const Dsv41Fp8LinearParams* p) {
    Plan q;
    const int m = p->m;
    q.nt = m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
    q.tok = 8 * q.nt;
    q.mc = (m + q.tok - 1) / q.tok;
    q.mpad = q.mc * q.tok;
    q.kb = (p->k + 31) / 32;
    q.kpad = 32 * q.kb;
    q.nb = (p->n + 31) / 32;
    int s;
    if (p->splits > 0) {
        s = p->splits < q.kb ? p->splits : q.kb;
    } else {
        const int tiles = q.nb * q.mc, want = 3 * sm_count();
        s = (want + tiles - 1) / tiles;
        const int cap = q.kb / kMinBlocksPerSplit > 1 ? q.kb / kMinBlocksPerSplit : 1;
        s = s < 1 ? 1 : (s > cap ? cap : s);
    }
    q.splits = s;
    q.panel_off = 0;
    q.ascale_off = align256(static_cast<int64_t>(q.mpad) * q.kpad * 2);
    q.ws_off = q.ascale_off + (p->act_quant ? align256(static_cast<int64_t>(q.kb) * q.mpad * 4) : 0);
    const int64_t tiles = static_cast<int64_t>(q.nb) * q.mc;
    // Stream-K: units = chunks x row groups x stages; two partial slots of 4 warps x 8 NT x 32
    // lanes x 8 floats per CTA; a counter per (chunk, row group).
    const int64_t groups = static_cast<int64_t>(q.mc) * ((p->n + 127) / 128);
    const int64_t units = groups * ((q.kb + kStepBlocks - 1) / kStepBlocks);
    // The grid of the stream-K variant.
    const int64_t per_sm = p->act_quant ? streamk_per_sm_nt<true>(q.nt) : streamk_per_sm_nt<false>(q.nt);
    const int64_t ctas = per_sm * sm_count(), by_units = units / kMinUnits > 1 ? units / kMinUnits : 1;
    q.ctas = static_cast<int>(ctas < by_units ? ctas : by_units);
    const int64_t ws_reg = s > 1 ? tiles * s * q.tok * 32 * 4 : 0, ws_sk = 2 * static_cast<int64_t>(q.ctas) * 4 * (8 * q.nt) * 32 * 4;
    // WARP: partials [16-row unit][split][16 x tok] f32 and a counter per unit (splits > 1).
    q.warp = p->variant == DSV41_FP8_VARIANT_WARP && m <= kWarpMaxM;
    int64_t ws_warp = 0, ctr_warp = 0;
    q.wp = WarpPlan{1, 1, 0, 0};
    if (q.warp) {
        q.wp = warp_plan(p->n, q.kb, q.tok, p->act_quant != 0, p->splits);
        ctr_warp = q.wp.splits > 1 ? (p->n + 15) / 16 : 0;
        ws_warp = ctr_warp * q.wp.splits * 16 * q.tok * 4;
    }
    const int64_t ws = ws_reg > ws_sk ? ws_reg : ws_sk, n_ctr = tiles > groups ? tiles : groups;
    q.ctr_off = q.ws_off + align256(ws > ws_warp ? ws : ws_warp);
    q.bytes = q.ctr_off + align256((n_ctr > ctr_warp ? n_ctr : ctr_warp) * 4);
    return q;
}

// kind: 0 register ring with byte loads, 1 register ring with 8-byte loads, 2 smem pipeline (3:
// the WARP variant, launch_warp); fused: REGISTERS with the activation from x (nt <= 2).
template <int NT, bool ACTQ>
cudaError_t launch_stream(const StreamArgs& a, const Plan& q, int kind, bool fused, cudaStream_t st) {
    const dim3 grid(q.mc, q.nb, q.splits);
    if (kind == 2) {
        // make_plan set the kernel's shared memory limit (streamk_per_sm).
        return dsv41_launch::launch_pdl(fp8_streamk_kernel<NT, ACTQ>, dim3(q.ctas), dim3(kThreads), streamk_smem<NT>(), st, 1, a);
    }
    auto* kernel = kind == 1 ? fp8_stream_kernel<NT, ACTQ, true, false> : fp8_stream_kernel<NT, ACTQ, false, false>;
    if constexpr (NT <= 2) {
        if (fused) kernel = kind == 1 ? fp8_stream_kernel<NT, ACTQ, true, true> : fp8_stream_kernel<NT, ACTQ, false, true>;
    }
    return dsv41_launch::launch_pdl(kernel, grid, dim3(kThreads), 0, st, 1, a);
}

template <bool ACTQ>
cudaError_t launch_stream_nt(const StreamArgs& a, const Plan& q, int kind, bool fused, cudaStream_t st) {
    switch (q.nt) {
        case 1: return launch_stream<1, ACTQ>(a, q, kind, fused, st);
        case 2: return launch_stream<2, ACTQ>(a, q, kind, fused, st);
        case 4: return launch_stream<4, ACTQ>(a, q, kind, false, st);
        default: return launch_stream<8, ACTQ>(a, q, kind, false, st);
    }
}

}  // namespace fp8
}  // namespace dsv41

extern "C" int dsv41_fp8_linear_scratch_bytes(const Dsv41Fp8LinearParams* p, size_t params_size, int64_t* bytes) {
    using namespace dsv41::fp8;
    const int v = validate(p, params_size);
    if (v != DSV41_OK) return v;
    if (!bytes) return DSV41_ERR_NULL;
    *bytes = make_plan(p).bytes;
    return DSV41_OK;
}

extern "C" int dsv41_fp8_linear(const Dsv41Fp8LinearParams* p, size_t params_size, void* stream) {
    using namespace dsv41::fp8;
    const int v = validate(p, params_size);
    if (v != DSV41_OK) return v;
    if (!p->x || !p->codes || !p->scales || !p->out || !p->scratch || (p->n_first > 0 && !p->out2)) return DSV41_ERR_NULL;
    const Plan q = make_plan(p);
    if (p->scratch_bytes < q.bytes) return DSV41_ERR_SHAPE;
    if ((reinterpret_cast<uintptr_t>(p->scratch) & 255) != 0 || (reinterpret_cast<uintptr_t>(p->out) & 7) != 0 ||
        (reinterpret_cast<uintptr_t>(p->x) & 1) != 0 || (p->n_first > 0 && (reinterpret_cast<uintptr_t>(p->out2) & 7) != 0))
        return DSV41_ERR_ALIGNMENT;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    char* base = static_cast<char*>(p->scratch);
    StreamArgs a;
    a.x = static_cast<const __nv_bfloat16*>(p->x);
    a.codes = p->codes;
    a.scales = p->scales;
    a.out = static_cast<__nv_bfloat16*>(p->out);
    a.out2 = static_cast<__nv_bfloat16*>(p->n_first > 0 ? p->out2 : p->out);
    a.n1 = p->n_first > 0 ? p->n_first : p->n;
    a.panel = reinterpret_cast<const uint16_t*>(base + q.panel_off);
    a.ascale = reinterpret_cast<const float*>(base + q.ascale_off);
    a.ws = reinterpret_cast<float*>(base + q.ws_off);
    a.ctr = reinterpret_cast<unsigned*>(base + q.ctr_off);
    a.m = p->m;
    a.n = p->n;
    a.k = p->k;
    a.kb = q.kb;
    a.kpad = q.kpad;
    a.mpad = q.mpad;
    a.mc = q.mc;
    a.splits = q.splits;
    a.parts = 1;  // WARP: set by launch_warp
    a.prow = 0;

    const uintptr_t cp = reinterpret_cast<uintptr_t>(p->codes);
    const bool vec8 = p->k % 8 == 0 && (cp & 7) == 0;
    const bool streamk = p->k % 128 == 0 && (cp & 15) == 0 && (reinterpret_cast<uintptr_t>(p->scales) & 3) == 0;
    // DSV41_FP8_VARIANT_*: AUTO takes the stream-K pipeline for m > 16 where its whole-stage copies
    // are possible (faster there on an H100: 48 vs 57 us for wq_b at m = 64) and its grid has at
    // least a quarter as many CTAs as the GPU has SMs; the ring for m <= 16 (as fast or faster: 9.5
    // vs 12.6 us for wq_a at m = 1; docs/perf.md "FP8 linear") and for small weights, whose few
    // stream-K units would run on one or two CTAs one after another (the embedded model's 16 KB -
    // 100 KB weights at m = 64: 7 - 16 us a call against ~6 us on the ring, ncu). WARP
    // (kernels/fp8_linear_warp.cu) runs where asked for and m <= kWarpMaxM, any k and alignment;
    // asked for above, it runs what AUTO picks.
    const bool pipeline = p->variant == DSV41_FP8_VARIANT_PIPELINE ||
                          ((p->variant == DSV41_FP8_VARIANT_AUTO || p->variant == DSV41_FP8_VARIANT_WARP) && p->m > 16 && 4 * q.ctas >= sm_count());
    const int kind = q.warp ? 3 : (pipeline && streamk) ? 2 : (vec8 ? 1 : 0);
    // The fused activation (FUSED, or AUTO for a small weight): REGISTERS at m <= 16 reading x
    // itself, where its 16-byte loads are possible and the split-K counters need no zeroing (one
    // split, or the caller's counters, which the last arrival of every tile leaves zero).
    const bool want_fused = p->prep == DSV41_FP8_PREP_FUSED ||
                            (p->prep == DSV41_FP8_PREP_AUTO && static_cast<int64_t>(p->n) * p->k <= DSV41_FP8_FUSED_AUTO_MAX_BYTES);
    const bool fused = want_fused && kind <= 1 && q.nt <= 2 && p->k % 8 == 0 &&
                       (reinterpret_cast<uintptr_t>(p->x) & 15) == 0 && (q.splits == 1 || (p->counters && q.nb * q.mc <= DSV41_FP8_COUNTERS));
    if (fused) {
        if (q.splits > 1) a.ctr = p->counters;
        return static_cast<int>(p->act_quant ? launch_stream_nt<true>(a, q, kind, true, st) : launch_stream_nt<false>(a, q, kind, true, st));
    }
    int n_ctr = 0;  // arrival counters the prep kernel zeroes
    if (kind == 3) n_ctr = q.wp.splits > 1 ? (p->n + 15) / 16 : 0;
    else if (kind == 2) n_ctr = q.mc * ((p->n + 127) / 128);
    else if (q.splits > 1) n_ctr = q.nb * q.mc;
    const int64_t prep_threads = static_cast<int64_t>(q.mpad) * q.kb * 32;
    const unsigned prep_blocks = static_cast<unsigned>((prep_threads + kPrepThreads - 1) / kPrepThreads);
    const auto* x = static_cast<const __nv_bfloat16*>(p->x);
    auto* panel = reinterpret_cast<uint16_t*>(base + q.panel_off);
    auto* ascale = reinterpret_cast<float*>(base + q.ascale_off);
    if (p->act_quant) fp8_prep_kernel<true><<<prep_blocks, kPrepThreads, 0, st>>>(x, panel, ascale, a.ctr, n_ctr, p->m, p->k, q.kb, q.kpad, q.mpad);
    else fp8_prep_kernel<false><<<prep_blocks, kPrepThreads, 0, st>>>(x, panel, ascale, a.ctr, n_ctr, p->m, p->k, q.kb, q.kpad, q.mpad);

    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return static_cast<int>(e);
    if (kind == 3) e = launch_warp(a, q.wp, q.nt, p->act_quant != 0, vec8, st);
    else e = p->act_quant ? launch_stream_nt<true>(a, q, kind, false, st) : launch_stream_nt<false>(a, q, kind, false, st);
    return static_cast<int>(e);
}
