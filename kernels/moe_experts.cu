// moe_experts: the routed experts of one MoE layer (spec §8) over MXFP4 weights kept as the
// release stores them (spec §2.4), for every token of a step at once:
//   GATE_UP  act[p, r] = bf16( silu(min(a, L)) · clamp(u, −L, L) · g )   a = bf16(Q1(x_t)·w1_e[r]ᵀ),
//            u = bf16(Q1(x_t)·w3_e[r]ᵀ), for the p-th slot (t, e, g) in expert order;
//   DOWN     y[p, c] = bf16( Q1(act[p])·w2_e[c]ᵀ );
//   combine  out[t] = bf16( (0 + Σ_{slots of t, ascending expert id} y[p]) + shared[t] ).
// This is model::moe::Moe::forward's per-expert loop (Linear with the FP8 activation
// quantization Q1, f32 accumulation, bf16 outputs; the SwiGLU of kernels/swiglu.cu; the f32 sum
// in expert-id order) with one launch per projection whatever the number of tokens, no host
// read and no expert dequantized to memory. The routing (ids, weights, counts, the slot order)
// comes from kernels/moe_route.cu; tests/cuda_moe_experts.rs compares against the CPU path.
//
// Layout: an expert's codes [N, K/2] u8 (low nibble = even input) and scales [N, K/32] e8m0,
// each contiguous, reached through a device table of pointers [E, 4]; x [T, K] bf16; act and y
// [S, N] bf16 with S = T·k rows in expert order. K a multiple of 32.
//
// Design (decode: a few tokens per expert, the weights read once at the speed of HBM):
//   * prep kernel: the Q1 panel of the inputs — e4m3 code values as f16 (exact) with the block
//     scales 2^e as f32 [rows, K/32] — and, for GATE_UP, each slot's token row, its routing
//     weight and pos[order[p]] = p, all in expert order.
//   * stream kernel: a persistent grid (one CTA of 16 warps per SM). A unit is (chunk of up to
//     8 slots of one expert, group of 16 weight rows: GATE_UP 8 rows of w1 and the same 8 of w3,
//     DOWN 16 rows of w2) over the whole K; the units of all experts are numbered from an in-CTA
//     scan of the counts (chunk-major) and each CTA takes an equal contiguous run of them, so the
//     grid is fixed by the device (graph capture) while the work follows the routing.
//   * warp-owned units: each weight byte is used by one warp only, so a warp reads its unit's
//     codes straight from global memory into registers (4-byte read-only loads in the mma
//     fragment pattern: lane (g, t) takes bytes 4t..4t+3 of each k32 block of tile rows g and
//     g + 8; the other half of each 32-byte sector is the next block, an L1 hit) with the
//     scales as one 4-byte word per row and 4 blocks. Loads run D groups of 4 blocks ahead of
//     the products (D = 2 when K/128 is even, else 1; D divides the groups of a unit, so a
//     unit's last loads are the warp's next unit's first groups): 16 warps x 2 KB in flight
//     per SM, and each load asks L2 for the aligned 256 bytes around it (the row's next
//     groups). Deeper register pipelines do not fit: at D = 3 or 4 the 128 registers of a
//     512-thread CTA spill and ptxas moves the loads behind the products. No shared-memory
//     weight ring, no per-stage barrier, no cross-warp reduction: the unit's sums end in the
//     warp, where the GATE_UP epilogue has a and u of the same row and token in one lane (tile
//     rows 0-7 are w1, 8-15 w3) and applies the SwiGLU.
//   * rounds: the CTA's run is cut into rounds of at most 16 consecutive units (warp w takes
//     unit w of the round) that span at most two chunks; the chunks' panel rows, activation
//     scales and routing weights are resident in two shared-memory slots (chunk c in slot
//     c % 2), loaded with cp.async by the whole CTA between two barriers only when a round needs
//     a chunk not yet resident (barriers per chunk, not per stage). The weight loads of the
//     warps' next units are already in flight during that load. One CTA of 16 warps rather than
//     two of 8: two slots take 171 KB at K = 5120, and at B = 1 a run of ~13 units straddles a
//     chunk boundary on some SMs, which a single slot per CTA would serialise. A warp's unit
//     (chunk, row group, expert) advances incrementally from its previous one.
//   * weight scales: a lane decodes 2 of the 64 scales of a group (tile row lane/2, blocks
//     2(lane%2) and 2(lane%2)+1) and the warp shares them through a small shared-memory buffer
//     (one __syncwarp per group), instead of every lane decoding the 8 its fragment needs.
//   * products: per k32 block a lane holds 8 nibbles of each of its 2 rows (4 bytes). e2m1 is
//     e4m3 shifted: placing the sign at bit 7 and (e1 e0 m) at bits 4-2 gives the e4m3 code of
//     the value · 2^-6 (also for the subnormal 0.5), so each 4-byte word becomes 8 e4m3 codes
//     with 7 integer ops (even and odd nibbles apart), then f16 by cvt.rn.f16x2.e4m3x2 (exact),
//     and mma.sync m16n8k16 f16 -> f32 against the panel. The K order inside a block is
//     permuted (a dot product does not care; the panel is written in the same order), so no
//     shuffles. Each block's product starts from zero and is added to the running sum times
//     (2^sa · 64) · 2^sw in f32, blocks in ascending k.
//   * Where the time goes with this design: not measured yet (docs/perf.md "MoE experts" holds
//     the figures and the ncu analysis of the previous design, a shared-memory ring of weight
//     stages with a CTA barrier per stage, which was instruction-bound).
//
// Numerics: products of e4m3 panel codes and e2m1 weights are exact in f16 x f16 -> f32; a
// block's 32 products are summed by the tensor core in f32 and added to the running sum as
// fma((p · 2^sa · 64), 2^sw, acc): the first product is exact (a power of two, the activation
// scale finite for finite inputs), the FMA rounds once, and an all-zero block adds 0 whatever
// the scales (a NaN weight scale, byte 255, still gives NaN like the reference). So a and u
// equal the reference up to the order of the f32 summation; everything after (bf16 rounding,
// clamp, silu, the products, the combine's f32 sum) is the CPU's sequence. Scale bytes >= 253
// make weights overflow f32 in the reference too. The summation order is fixed by the unit
// (one warp, ascending k), whatever the timing: the results are deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "include/dsv41_fp8.cuh"
#include "include/dsv41_hopper.cuh"
#include "include/dsv41_launch.cuh"
#include "include/dsv41_moe_experts.h"
#include "include/dsv41_moe_experts_common.cuh"
#include "include/dsv41_numerics.cuh"

namespace dsv41 {
namespace moe_x {

using namespace dsv41_ptx;
using dsv41_experts::swiglu;

constexpr int kWarps = 16;
constexpr int kThreads = 32 * kWarps;
constexpr int kTok = 8;                    // slots per chunk: one n8 tile
constexpr int kGroup = 4;                  // k32 blocks per load group: one 4-byte scale word per weight row
constexpr int kSlots = 2;                  // resident chunks: a round spans at most two
constexpr int kSwBufs = 2;                 // a warp's decoded-scale buffers: by pipeline stage (D = 2) or group parity (D = 1)
constexpr int kSwFloats = 16 * kGroup;     // one buffer: 16 tile rows x 4 blocks
constexpr int kPrepThreads = 256;
constexpr int kMaxSmem = 226 * 1024;  // dynamic shared memory: the sm_90 opt-in limit (227 KB) less the static part

constexpr int align128(int v) { return (v + 127) & ~127; }

// Dynamic shared memory of the stream kernel for K inputs and E experts: two chunk slots (panel
// rows, activation scales, routing weights), the warps' decoded weight scales, and the expert
// table with the two scans.
struct Smem {
    int prow;   // panel row stride in bytes: 2K + 64 (= 64 mod 128: conflict-free 16-byte reads)
    int asc;    // in a slot: activation scales [ceil(K/64)][4][2][2] f32 (block pair, t, block, token)
    int rw;     // in a slot: the chunk's routing weights [8] f32 (GATE_UP), then its first slot and count
    int slot;   // bytes per slot
    int sw, tab, bytes;
};
__host__ __device__ inline Smem smem_layout(int k, int e) {
    Smem m;
    m.prow = 2 * k + 64;
    m.asc = kTok * m.prow;
    m.rw = m.asc + ((k / 32 + 1) / 2) * 64;
    m.slot = align128(m.rw + kTok * 4 + 8);
    m.sw = kSlots * m.slot;
    m.tab = m.sw + kWarps * kSwBufs * kSwFloats * 4;
    m.bytes = m.tab + e * 32 + 2 * (e + 1) * 4;
    return m;
}

// A read-only 4-byte load that asks L2 to fetch the whole aligned 256 bytes around it on a miss
// (the next groups of the same weight row).
__device__ __forceinline__ uint32_t ldg32(const uint8_t* p) {
    uint32_t v;
    asm("ld.global.nc.L2::256B.b32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// 8 e2m1 codes (a 4-byte word, code i in nibble i) -> 8 e4m3 codes of the values · 2^-6:
// even = codes 0, 2, 4, 6 (one per byte), odd = codes 1, 3, 5, 7.
__device__ __forceinline__ uint32_t e2m1_even_e4m3(uint32_t w) { return ((w << 2) & 0x1c1c1c1cu) | ((w << 4) & 0x80808080u); }
__device__ __forceinline__ uint32_t e2m1_odd_e4m3(uint32_t w) { return ((w >> 2) & 0x1c1c1c1cu) | (w & 0x80808080u); }
// The e4m3 codes in the low / high 16 bits of w -> f16x2 (exact); the high half is read in place.
__device__ __forceinline__ uint32_t e4m3x2_lo_f16x2(uint32_t w) {
    uint32_t d;
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;\n}" : "=r"(d) : "r"(w));
    return d;
}
__device__ __forceinline__ uint32_t e4m3x2_hi_f16x2(uint32_t w) {
    uint32_t d;
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;\n}" : "=r"(d) : "r"(w));
    return d;
}

// x · 0 + x: x for finite x, NaN for ±inf (not folded by the compiler).
__device__ __forceinline__ float nan_if_inf(float x) {
    float r;
    asm("fma.rn.f32 %0, %1, 0f00000000, %1;" : "=f"(r) : "f"(x));
    return r;
}
// e8m0 bytes 0 and 1 of w -> 2^(b - 127), the values of fp8::e8m0_f32: the byte placed at the
// f32 exponent, then byte 0 -> the subnormal 2^-127 (max) and byte 255 (+inf so far) -> NaN.
__device__ __forceinline__ float2 e8m0x2_f32(uint32_t w) {
    const float lo = fmaxf(__uint_as_float((w << 23) & 0x7f800000u), 0x1p-127f);
    const float hi = fmaxf(__uint_as_float((w << 15) & 0x7f800000u), 0x1p-127f);
    return make_float2(nan_if_inf(lo), nan_if_inf(hi));
}

__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, const float (&c)[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

struct Args {
    const uint64_t* experts;
    const uint32_t* counts;
    const uint16_t* panel;       // [rows, K] f16 e4m3 code values, 8-groups permuted
    const float* ascale;         // [rows, kb] block scales · 64
    const uint32_t* tok_sorted;  // [S] (GATE_UP)
    const float* rw_sorted;      // [S] (GATE_UP)
    __nv_bfloat16* out;          // [S, N]
    int e, n, k, kb, groups, n_rg;  // groups = ceil(kb / 4) per unit
    float limit;
};

// A unit of the warp: the start of its round (the unit is rs + warp), its chunk, row group and
// expert.
struct UnitPos {
    int rs, chunk, rg, e;
};

// D: load groups in flight per warp (divides a.groups); FULL: K/32 % 4 == 0 (4-byte scale words;
// otherwise byte loads and a partial last group, with D = 1).
template <int MODE, int D, bool FULL>
__global__ void __launch_bounds__(kThreads, 1) moe_stream_kernel(const Args a) {
    static_assert((FULL || D == 1) && D <= kSwBufs, "the partial-group path runs one group ahead; a scale buffer per stage");
    extern __shared__ __align__(128) uint8_t smem[];
    const Smem L = smem_layout(a.k, a.e);
    uint64_t* tab = reinterpret_cast<uint64_t*>(smem + L.tab);
    int* off = reinterpret_cast<int*>(tab + 4 * a.e);  // [E + 1] exclusive prefix of the counts
    int* item = off + (a.e + 1);                       // [E + 1] exclusive prefix of the chunks
    __shared__ int warp_sum[2][kWarps];
    // CTA-uniform round state kept in shared memory rather than registers (the load pipeline
    // needs them): the end of the run, the last chunk loaded and its expert.
    __shared__ int run_end, resident, resident_e;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const uint32_t sbase = smem_addr(smem);

    // The pointer table is the caller's static data: read it before waiting for the routing.
    for (int i = tid; i < 4 * a.e; i += kThreads) tab[i] = a.experts[i];
    grid_dep_wait();

    // Exclusive scans of the counts and of the chunks per expert (one expert per thread).
    {
        const int c = tid < a.e ? static_cast<int>(a.counts[tid]) : 0, it = (c + kTok - 1) / kTok;
        int sc = c, si = it;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int vc = __shfl_up_sync(0xffffffffu, sc, d), vi = __shfl_up_sync(0xffffffffu, si, d);
            if (lane >= d) {
                sc += vc;
                si += vi;
            }
        }
        if (lane == 31) {
            warp_sum[0][warp] = sc;
            warp_sum[1][warp] = si;
        }
        __syncthreads();
        int bc = 0, bi = 0;
        for (int w = 0; w < warp; ++w) {
            bc += warp_sum[0][w];
            bi += warp_sum[1][w];
        }
        if (tid < a.e) {
            off[tid] = bc + sc - c;
            item[tid] = bi + si - it;
        }
        if (tid == kThreads - 1) {
            off[a.e] = bc + sc;
            item[a.e] = bi + si;
        }
        __syncthreads();
    }

    // units < 2^31: the launcher checks slots · row groups (a chunk has at least one slot).
    const int n_rg = a.n_rg;
    const int64_t units = static_cast<int64_t>(item[a.e]) * n_rg;
    const int u0 = static_cast<int>(units * blockIdx.x / gridDim.x), u1 = static_cast<int>(units * (blockIdx.x + 1) / gridDim.x);
    if (u0 == u1) return;
    if (tid == 0) {
        run_end = u1;
        resident = -1;
        resident_e = -1;
    }
    __syncthreads();

    // A round: units [rs, round_end(rs)), at most one per warp (unit rs + warp) and two chunks.
    auto round_end = [&](int rs) {
        const int64_t cap = (static_cast<int64_t>(rs / n_rg) + kSlots) * n_rg;
        const int re = rs + kWarps < run_end ? rs + kWarps : run_end;
        return re < cap ? re : static_cast<int>(cap);
    };
    // The expert of chunk c: the largest e with item[e] <= c (an expert with chunks). By binary
    // search once, then onwards from the previous one (chunks are visited in increasing order).
    auto expert_search = [&](int c) {
        int lo = 0, hi = a.e;
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (item[mid] <= c) lo = mid;
            else hi = mid;
        }
        return lo;
    };
    auto expert_from = [&](int e, int c) {
        while (item[e + 1] <= c) ++e;
        return e;
    };
    // The warp's first unit from round rs on (p.rs set), if any.
    auto find_unit = [&](int rs, UnitPos& p) {
        while (rs < run_end) {
            const int re = round_end(rs);
            if (rs + warp < re) {
                p.rs = rs;
                return true;
            }
            rs = re;
        }
        return false;
    };
    // The warp's unit after p (same rule, incremental chunk, row group and expert).
    auto next_unit = [&](UnitPos& p) {
        const int prev = p.rs + warp;
        if (!find_unit(round_end(p.rs), p)) return false;
        p.rg += p.rs + warp - prev;
        while (p.rg >= n_rg) {
            p.rg -= n_rg;
            ++p.chunk;
        }
        p.e = expert_from(p.e, p.chunk);
        return true;
    };

    // Load side: the rows of tile rows g and g + 8 from byte 4t, and the scale row of tile row
    // lane / 2 from byte 2 (lane % 2) (the two scales this lane decodes); rows past N read row
    // N - 1 (their sums are never stored).
    const int half_k = a.k / 2;
    const uint8_t *lp0 = nullptr, *lp1 = nullptr, *lps = nullptr;
    auto point = [&](const UnitPos& p) {
        const uint64_t* te = tab + 4 * p.e;
        const int sr = lane >> 1;
        int r0, r1, rsc;
        const uint8_t *c0, *c1, *sc;
        if (MODE == DSV41_MOE_GATE_UP) {
            r0 = r1 = min(p.rg * 8 + g, a.n - 1);
            rsc = min(p.rg * 8 + (sr & 7), a.n - 1);
            c0 = reinterpret_cast<const uint8_t*>(te[0]);
            c1 = reinterpret_cast<const uint8_t*>(te[2]);
            sc = reinterpret_cast<const uint8_t*>(te[sr < 8 ? 1 : 3]);
        } else {
            r0 = min(p.rg * 16 + g, a.n - 1);
            r1 = min(p.rg * 16 + g + 8, a.n - 1);
            rsc = min(p.rg * 16 + sr, a.n - 1);
            c0 = c1 = reinterpret_cast<const uint8_t*>(te[0]);
            sc = reinterpret_cast<const uint8_t*>(te[1]);
        }
        lp0 = c0 + static_cast<int64_t>(r0) * half_k + 4 * t;
        lp1 = c1 + static_cast<int64_t>(r1) * half_k + 4 * t;
        lps = sc + static_cast<int64_t>(rsc) * a.kb + 2 * (lane & 1);
    };
    uint32_t cw[D][kGroup][2], scw[D];
    int lj = 0;  // partial path: the group index in its unit of the next load
    auto issue = [&](int s) {  // the next group into buffer s (lp0/lp1/lps at the stage's first group)
        if (FULL) {
#pragma unroll
            for (int i = 0; i < kGroup; ++i) {
                cw[s][i][0] = ldg32(lp0 + 64 * s + 16 * i);
                cw[s][i][1] = ldg32(lp1 + 64 * s + 16 * i);
            }
            scw[s] = __ldg(reinterpret_cast<const unsigned short*>(lps + 4 * s));
        } else {
#pragma unroll
            for (int i = 0; i < kGroup; ++i) {
                const bool ok = kGroup * lj + i < a.kb;
                cw[s][i][0] = ok ? ldg32(lp0 + 16 * i) : 0u;
                cw[s][i][1] = ok ? ldg32(lp1 + 16 * i) : 0u;
            }
            const int b = kGroup * lj + 2 * (lane & 1);
            scw[s] = (b < a.kb ? static_cast<uint32_t>(__ldg(lps)) : 0u) | (b + 1 < a.kb ? static_cast<uint32_t>(__ldg(lps + 1)) << 8 : 0u);
            ++lj;
        }
    };
    auto advance = [&]() {
        lp0 += 64 * D;
        lp1 += 64 * D;
        lps += 4 * D;
    };

    // Compute side: group jg of the unit from buffer s; pb / ab: this lane's panel and
    // activation-scale addresses of block 0 in the unit's slot.
    float* const sw_warp = reinterpret_cast<float*>(smem + L.sw) + warp * (kSwBufs * kSwFloats);
    const int h = lane & 1;
    auto compute = [&](int s, int jg, const uint8_t* pb, const uint8_t* ab, float (&acc)[4]) {
        // Weight scales: this lane decodes 2 of the group's 64 (tile row lane / 2, blocks 2h and
        // 2h + 1); the warp reads its fragment's 8 back.
        float* buf = sw_warp + (D > 1 ? s : (jg & 1)) * kSwFloats;
        *reinterpret_cast<float2*>(buf + (lane >> 1) * kGroup + 2 * h) = e8m0x2_f32(scw[s]);
        __syncwarp();
        const float4 swa = *reinterpret_cast<const float4*>(buf + g * kGroup);
        const float4 swb = *reinterpret_cast<const float4*>(buf + (g + 8) * kGroup);
        float4 sa = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int i = 0; i < kGroup; ++i) {
            const int kb = kGroup * jg + i;
            if (!FULL && kb >= a.kb) break;
            const uint4 b = *reinterpret_cast<const uint4*>(pb + 64 * kb);
            if ((i & 1) == 0) sa = *reinterpret_cast<const float4*>(ab + 32 * kb);
            const float sa0 = (i & 1) ? sa.z : sa.x, sa1 = (i & 1) ? sa.w : sa.y;
            const float sw0 = i == 0 ? swa.x : i == 1 ? swa.y : i == 2 ? swa.z : swa.w;
            const float sw1 = i == 0 ? swb.x : i == 1 ? swb.y : i == 2 ? swb.z : swb.w;
            const uint32_t wa = cw[s][i][0], wb = cw[s][i][1];
            const uint32_t ea = e2m1_even_e4m3(wa), oa = e2m1_odd_e4m3(wa), eb = e2m1_even_e4m3(wb), ob = e2m1_odd_e4m3(wb);
            const uint32_t a0[4] = {e4m3x2_lo_f16x2(ea), e4m3x2_lo_f16x2(eb), e4m3x2_lo_f16x2(oa), e4m3x2_lo_f16x2(ob)};
            const uint32_t a1[4] = {e4m3x2_hi_f16x2(ea), e4m3x2_hi_f16x2(eb), e4m3x2_hi_f16x2(oa), e4m3x2_hi_f16x2(ob)};
            const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            float p[4];
            mma16816(p, a0, b.x, b.y, zero);
            mma16816(p, a1, b.z, b.w, p);
            // (p · 2^sa · 64) · 2^sw: the first product is exact, the FMA rounds once; an all-zero
            // block stays 0 (the activation scale is finite for finite x).
            acc[0] = fmaf(p[0] * sa0, sw0, acc[0]);
            acc[1] = fmaf(p[1] * sa1, sw0, acc[1]);
            acc[2] = fmaf(p[2] * sa0, sw1, acc[2]);
            acc[3] = fmaf(p[3] * sa1, sw1, acc[3]);
        }
    };

    // A chunk into its slot (by the whole CTA, 64 threads per panel row): the panel rows and
    // activation scales of its slots by cp.async, the routing weights; its first slot and count.
    auto load_chunk = [&](int c, int e) {
        const int base = off[e] + (c - item[e]) * kTok, left = off[e + 1] - base, cnt = left < kTok ? left : kTok;
        const int sl = c & 1, nn = tid >> 6, q = tid & 63;
        const uint32_t dst = sbase + static_cast<uint32_t>(sl * L.slot);
        if (nn < cnt) {
            const int p = base + nn;
            const uint32_t tok = MODE == DSV41_MOE_GATE_UP ? __ldg(a.tok_sorted + p) : static_cast<uint32_t>(p);
            const uint16_t* src = a.panel + static_cast<int64_t>(tok) * a.k;
            for (int c8 = q; c8 < a.k / 8; c8 += 64) cp_async16_l2(dst + nn * L.prow + 16 * c8, src + 8 * c8);
            const float* ss = a.ascale + static_cast<int64_t>(tok) * a.kb;
            for (int b = q; b < a.kb; b += 64) cp_async4(dst + L.asc + 64 * (b >> 1) + 16 * (nn >> 1) + 8 * (b & 1) + 4 * (nn & 1), ss + b);
            if (MODE == DSV41_MOE_GATE_UP && q == 0) reinterpret_cast<float*>(smem + sl * L.slot + L.rw)[nn] = __ldg(a.rw_sorted + p);
        }
        if (tid == 0) {
            int* info = reinterpret_cast<int*>(smem + sl * L.slot + L.rw + kTok * 4);
            info[0] = base;
            info[1] = cnt;
        }
    };

    // The warp's first unit and its first D groups in flight.
    UnitPos cur{0, 0, 0, 0};
    if (find_unit(u0, cur)) {
        const int u = cur.rs + warp;
        cur.chunk = u / n_rg;
        cur.rg = u - cur.chunk * n_rg;
        cur.e = expert_search(cur.chunk);
        point(cur);
#pragma unroll
        for (int s = 0; s < D; ++s) issue(s);
        advance();
    }
    UnitPos nxt = cur;  // the unit whose groups are being issued

    for (int rs = u0; rs < run_end;) {
        const int re = round_end(rs), c_hi = (re - 1) / n_rg;
        if (c_hi > resident) {
            // Every warp is past the earlier rounds (whose chunks are older than this round's).
            const int c_lo = rs / n_rg, c_first = resident + 1 > c_lo ? resident + 1 : c_lo;
            int le = resident_e;
            __syncthreads();
            for (int c = c_first; c <= c_hi; ++c) {
                le = le < 0 ? expert_search(c) : expert_from(le, c);
                load_chunk(c, le);
            }
            cp_async_wait_all();
            if (tid == 0) {
                resident = c_hi;
                resident_e = le;
            }
            __syncthreads();
        }
        if (rs + warp < re) {  // the warp's unit `cur` of this round: groups 0..D-1 are in flight
            const int sl = cur.chunk & 1;
            const uint8_t* slot = smem + sl * L.slot;
            const uint8_t* pb = slot + g * L.prow + 16 * t;
            const uint8_t* ab = slot + L.asc + 16 * t;
            if (D == 1) __syncwarp();  // the scale buffers alternate by group parity within a unit
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int j = 0; j < a.groups; j += D) {
                if (j + D == a.groups) {  // this pass's loads are the next unit's first groups
                    // (without one, the same unit's again: unconditional loads keep their place in
                    // the schedule, and the warp's last D groups are read twice)
                    next_unit(nxt);
                    point(nxt);
                    lj = 0;
                }
#pragma unroll
                for (int s = 0; s < D; ++s) {
                    compute(s, j + s, pb, ab, acc);
                    issue(s);
                }
                advance();
            }
            // Epilogue: lane (g, t) holds tile rows g, g + 8 of slots 2t, 2t + 1 of the chunk.
            const int* info = reinterpret_cast<const int*>(slot + L.rw + kTok * 4);
            const int base = info[0], cnt = info[1];
            if (MODE == DSV41_MOE_GATE_UP) {
                const int row = cur.rg * 8 + g;
                const float* rw = reinterpret_cast<const float*>(slot + L.rw);
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int nn = 2 * t + c;
                    if (nn < cnt && row < a.n) {
                        const float av = __bfloat162float(__float2bfloat16_rn(acc[c]));
                        const float uv = __bfloat162float(__float2bfloat16_rn(acc[2 + c]));
                        a.out[static_cast<int64_t>(base + nn) * a.n + row] = __float2bfloat16_rn(swiglu(av, uv, rw[nn], a.limit));
                    }
                }
            } else {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = cur.rg * 16 + g + 8 * r;
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int nn = 2 * t + c;
                        if (nn < cnt && row < a.n) a.out[static_cast<int64_t>(base + nn) * a.n + row] = __float2bfloat16_rn(acc[2 * r + c]);
                    }
                }
            }
            cur = nxt;
        }
        rs = re;
    }
}

// One warp per (panel row, k32 block): Q1 of the block (spec §0.1b.8) as f16 e4m3 code values,
// the 8-groups stored in the stream kernel's order (positions 1 <-> 2 and 5 <-> 6 swapped), and
// the block scale. GATE_UP also writes, for each slot position p, its token row, its routing
// weight and pos[order[p]] = p (grid-stride over the first threads).
__global__ void __launch_bounds__(kPrepThreads) moe_prep_kernel(const __nv_bfloat16* __restrict__ x, uint16_t* __restrict__ panel,
                                                                 float* __restrict__ ascale, int64_t rows, int k, int kb,
                                                                 const uint32_t* __restrict__ order, const float* __restrict__ route_w,
                                                                 uint32_t* __restrict__ tok_sorted, float* __restrict__ rw_sorted,
                                                                 uint32_t* __restrict__ pos, int64_t slots, int topk) {
    grid_dep_wait();
    grid_dep_launch();
    const int64_t gid = static_cast<int64_t>(blockIdx.x) * kPrepThreads + threadIdx.x;
    if (order) dsv41_experts::sort_slots<kPrepThreads>(gid, order, route_w, tok_sorted, rw_sorted, pos, slots, topk);
    const int64_t gw = gid >> 5;
    const int lane = threadIdx.x & 31;
    if (gw >= rows * kb) return;  // whole warps leave together
    const int64_t row = gw / kb;
    const int blk = static_cast<int>(gw % kb);
    const float v = __bfloat162float(x[row * k + blk * 32 + lane]);
    using Q1 = QuantTraits<Quant::Fp8Ue8m0B32>;
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const BlockScale bs = Q1::scale(amax);
    const __half h = __float2half_rn(Q1::round(Q1::quotient(v, bs)));  // an e4m3 value: exact
    const int q = lane & 7, at = (lane & ~7) | (q & 4) | ((q & 1) << 1) | ((q >> 1) & 1);
    panel[row * k + blk * 32 + at] = *reinterpret_cast<const uint16_t*>(&h);
    if (lane == 0) ascale[row * kb + blk] = bs.s * 64.0f;  // 2^6: the e2m1 -> e4m3 shift of the weights
}

// One thread per (token, 8 columns).
__global__ void __launch_bounds__(256) moe_combine_kernel(const Dsv41MoeCombineParams p) {
    grid_dep_wait();
    const int chunks = (p.d + 7) / 8;
    const int64_t gid = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
    if (gid >= p.num_tokens * chunks) return;
    const int64_t tok = gid / chunks;
    const int c0 = static_cast<int>(gid % chunks) * 8;
    uint32_t ids[16], ps[16];
    for (int j = 0; j < p.k; ++j) {  // insertion sort by expert id (distinct ids)
        uint32_t id = p.ids[tok * p.k + j], ps_j = p.pos[tok * p.k + j];
        int i = j;
        while (i > 0 && ids[i - 1] > id) {
            ids[i] = ids[i - 1];
            ps[i] = ps[i - 1];
            --i;
        }
        ids[i] = id;
        ps[i] = ps_j;
    }
    const __nv_bfloat16* y = static_cast<const __nv_bfloat16*>(p.y);
    const __nv_bfloat16* sh = static_cast<const __nv_bfloat16*>(p.shared);
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    const bool vec = (p.d & 7) == 0;
    auto add_row = [&](const __nv_bfloat16* src) {
        if (vec) {
            const uint4 v = *reinterpret_cast<const uint4*>(src + c0);
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 f = __bfloat1622float2(h[i]);
                acc[2 * i] = __fadd_rn(acc[2 * i], f.x);
                acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], f.y);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (c0 + i < p.d) acc[i] = __fadd_rn(acc[i], __bfloat162float(src[c0 + i]));
        }
    };
    for (int j = 0; j < p.k; ++j) add_row(y + static_cast<int64_t>(ps[j]) * p.d);
    if (sh) add_row(sh + tok * p.d);
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + tok * p.d;
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (c0 + i < p.d) out[c0 + i] = __float2bfloat16_rn(acc[i]);
}

struct Plan {
    int kb, groups, n_rg;
    int64_t rows, slots, panel_off, ascale_off, tok_off, rw_off, bytes;
};

using dsv41_launch::align256;

// Row groups of a unit: GATE_UP 8 rows of w1 with the same 8 of w3, DOWN 16 rows of w2.
inline int64_t row_groups(const Dsv41MoeExpertsParams* p) { return p->mode == DSV41_MOE_GATE_UP ? (p->n + 7) / 8 : (p->n + 15) / 16; }

inline int validate(const Dsv41MoeExpertsParams* p, size_t params_size) {
    const int v = dsv41_experts::validate_common(p, params_size);
    if (v != DSV41_OK) return v;
    if (p->kdim > DSV41_MOE_EXPERTS_MAX_KDIM || smem_layout(p->kdim, p->num_experts).bytes > kMaxSmem) return DSV41_ERR_SHAPE;
    // The units (chunks x row groups) are numbered in 32 bits; a chunk holds at least one slot.
    if ((p->num_tokens * p->k + p->num_experts) * row_groups(p) >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    return DSV41_OK;
}

// Scratch: the panel [rows, K] f16, the activation scales [rows, K/32] f32, then the sorted slots.
inline Plan make_plan(const Dsv41MoeExpertsParams* p) {
    Plan q;
    q.slots = p->num_tokens * p->k;
    q.kb = p->kdim / 32;
    q.groups = (q.kb + kGroup - 1) / kGroup;
    q.n_rg = static_cast<int>(row_groups(p));
    q.rows = dsv41_experts::panel_rows(p);
    q.panel_off = 0;
    q.ascale_off = align256(q.rows * p->kdim * 2);
    const dsv41_experts::SlotScratch sorted = dsv41_experts::slot_scratch(p, q.ascale_off + align256(q.rows * q.kb * 4));
    q.tok_off = sorted.tok_off;
    q.rw_off = sorted.rw_off;
    q.bytes = sorted.bytes;
    return q;
}

template <int MODE, int D, bool FULL>
cudaError_t launch_variant(const Args& a, cudaStream_t st) {
    return dsv41_launch::launch_persistent<moe_stream_kernel<MODE, D, FULL>>(dim3(kThreads), smem_layout(a.k, a.e).bytes, kMaxSmem, st, a);
}

// Two load groups in flight when they divide the groups of a unit (4-byte scale words), else one;
// the byte path for K/32 not a multiple of 4.
template <int MODE>
cudaError_t launch_stream(const Args& a, cudaStream_t st) {
    if (a.kb % kGroup != 0) return launch_variant<MODE, 1, false>(a, st);
    if (a.groups % 2 == 0) return launch_variant<MODE, 2, true>(a, st);
    return launch_variant<MODE, 1, true>(a, st);
}

}  // namespace moe_x
}  // namespace dsv41

extern "C" int dsv41_moe_experts_scratch_bytes(const Dsv41MoeExpertsParams* p, size_t params_size, int64_t* bytes) {
    using namespace dsv41::moe_x;
    const int v = validate(p, params_size);
    if (v != DSV41_OK) return v;
    if (!bytes) return DSV41_ERR_NULL;
    *bytes = make_plan(p).bytes;
    return DSV41_OK;
}

extern "C" int dsv41_moe_experts(const Dsv41MoeExpertsParams* p, size_t params_size, void* stream) {
    using namespace dsv41::moe_x;
    const int v = validate(p, params_size);
    if (v != DSV41_OK) return v;
    if (p->num_tokens == 0) return DSV41_OK;
    const Plan q = make_plan(p);
    const int b = dsv41_experts::check_buffers(p, q.bytes);
    if (b != DSV41_OK) return b;
    const bool gu = p->mode == DSV41_MOE_GATE_UP;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    char* base = static_cast<char*>(p->scratch);
    auto* panel = reinterpret_cast<uint16_t*>(base + q.panel_off);
    auto* ascale = reinterpret_cast<float*>(base + q.ascale_off);
    auto* tok_sorted = reinterpret_cast<uint32_t*>(base + q.tok_off);
    auto* rw_sorted = reinterpret_cast<float*>(base + q.rw_off);

    const int64_t prep_blocks = dsv41_experts::prep_blocks(q.rows, q.kb, q.slots, kPrepThreads);
    if (prep_blocks < 0) return DSV41_ERR_SHAPE;
    cudaError_t e = dsv41_launch::launch_pdl(moe_prep_kernel, dim3(static_cast<unsigned>(prep_blocks)), dim3(kPrepThreads), 0, st, 1,
                                             static_cast<const __nv_bfloat16*>(p->x), panel, ascale, q.rows, p->kdim, q.kb,
                                             gu ? p->order : nullptr, p->route_w, tok_sorted, rw_sorted, gu ? p->pos : nullptr, q.slots,
                                             p->k);
    if (e != cudaSuccess) return static_cast<int>(e);

    Args a;
    dsv41_experts::set_common_args(a, p, tok_sorted, rw_sorted);
    a.panel = panel;
    a.ascale = ascale;
    a.groups = q.groups;
    a.n_rg = q.n_rg;
    e = gu ? launch_stream<DSV41_MOE_GATE_UP>(a, st) : launch_stream<DSV41_MOE_DOWN>(a, st);
    return static_cast<int>(e);
}

extern "C" int dsv41_moe_combine(const Dsv41MoeCombineParams* p, size_t params_size, void* stream) {
    using namespace dsv41::moe_x;
    if (params_size != sizeof(Dsv41MoeCombineParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_tokens < 0 || p->k < 1 || p->k > 16 || p->d < 1) return DSV41_ERR_SHAPE;
    if (p->num_tokens == 0) return DSV41_OK;
    if (!p->y || !p->ids || !p->pos || !p->out) return DSV41_ERR_NULL;
    if ((p->d & 7) == 0 && ((reinterpret_cast<uintptr_t>(p->y) & 15) != 0 || (p->shared && (reinterpret_cast<uintptr_t>(p->shared) & 15) != 0)))
        return DSV41_ERR_ALIGNMENT;
    const int64_t n = p->num_tokens * ((p->d + 7) / 8);
    const int64_t blocks = (n + 255) / 256;
    if (blocks >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    return static_cast<int>(dsv41_launch::launch_pdl(moe_combine_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256), 0,
                                                     static_cast<cudaStream_t>(stream), 1, *p));
}
