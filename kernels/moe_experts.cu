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
//   * prep kernel: the Q1 panel of the inputs — e4m3 codes with the block scales 2^e as f32
//     [rows, K/32] — and, for GATE_UP, each slot's token row, its routing weight and
//     pos[order[p]] = p, all in expert order.
//   * stream kernel: a persistent grid (one CTA of 16 warps per SM). A unit is (chunk of up to
//     8 slots of one expert, group of 16 weight rows: GATE_UP 8 rows of w1 and the same 8 of w3,
//     DOWN 16 rows of w2) over the whole K; the units of all experts are numbered from an in-CTA
//     scan of the counts (chunk-major) and each CTA takes an equal contiguous run of them, so the
//     grid is fixed by the device (graph capture) while the work follows the routing.
//   * warp-owned units: each weight byte is used by one warp only, so each warp streams its
//     units' weights through its own ring in shared memory: S stages of SB k32 blocks of the
//     unit's 16 rows (SB = 8, S = 3 when K/32 is a multiple of 8; else SB = 4, S = 6), filled
//     by cp.async (16-byte pieces of the codes with an L2 fetch of the surrounding 256 bytes, the
//     scale bytes by 4-byte copies), S - 1 stages in flight while the products use one: 16 warps
//     x 4-5 KB in flight per SM, in shared memory rather than registers (the previous design
//     loaded into registers: 2 KB per warp at most, and the kernel ran at the same speed on an
//     H100 and an H200, latency-bound). The loads run ahead across units (a unit's last stages
//     are followed by the warp's next unit's first ones, several units ahead when units are
//     short). Per stage: one cp.async.wait_group and one __syncwarp before the stage is used and
//     the slot used before it is refilled. Pieces are placed in a stage XOR-swizzled by row so
//     that the lanes' 4-byte fragment reads (lane (g, t): bytes 4t..4t+3 of each block of tile
//     rows g and g + 8) are conflict-free. No CTA barrier per stage, no cross-warp reduction: the
//     unit's sums end in the warp, where the GATE_UP epilogue has a and u of the same row and
//     token in one lane (tile rows 0-7 are w1, 8-15 w3) and applies the SwiGLU.
//   * rounds: the CTA's run is cut into rounds of at most 16 consecutive units (warp w takes
//     unit w of the round) that span at most two chunks; the chunks' panel rows, activation
//     scales and routing weights are resident in two shared-memory slots (chunk c in slot
//     c % 2), loaded with cp.async by the whole CTA between two barriers only when a round needs
//     a chunk not yet resident (barriers per chunk, not per stage). The weight loads of the
//     warps' next units are already in flight during that load (the load's cp.async.wait_all
//     also waits for them). One CTA of 16 warps rather than two of 8: at B = 1 a run of ~13
//     units straddles a chunk boundary on some SMs, which a single slot per CTA would serialise.
//     Shared memory at K = 5120, E = 384: two slots 91 KB (panel rows as e4m3 bytes: half the
//     f16 form, converted at use), the rings 102 KB, decoded scales 8 KB, the table 15 KB. A
//     warp's unit (chunk, row group, expert) advances incrementally from its previous one.
//   * weight scales: a lane decodes SB / 2 of the 16 x SB scales of a stage from the ring (tile
//     row lane/2) and the warp shares them through a small shared-memory buffer (one __syncwarp
//     per stage), instead of every lane decoding the 2 SB its fragment needs.
//   * products: per k32 block a lane holds 8 nibbles of each of its 2 rows (4 bytes). e2m1 is
//     e4m3 shifted: placing the sign at bit 7 and (e1 e0 m) at bits 4-2 gives the e4m3 code of
//     the value · 2^-6 (also for the subnormal 0.5), so each 4-byte word becomes 8 e4m3 codes
//     with 7 integer ops (even and odd nibbles apart), then f16 by cvt.rn.f16x2.e4m3x2 (exact),
//     and mma.sync m16n8k16 f16 -> f32 against the panel (its e4m3 bytes converted the same
//     way). The K order inside a block is permuted (a dot product does not care; the panel is
//     written in the same order), so no shuffles. Each block's product starts from zero and is added to the running sum times
//     (2^sa · 64) · 2^sw in f32, blocks in ascending k.
//   * Where the time goes (ncu, H100, B = 64; docs/perf.md "MoE experts"): DRAM at 80-85 % of
//     peak and 0.74 warps issued per scheduler per cycle, near both limits; at B = 1 each warp
//     has one unit and the launch stays latency-bound.
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
constexpr int kTok = 8;     // slots per chunk: one n8 tile
constexpr int kSlots = 2;   // resident chunks: a round spans at most two
constexpr int kPrepThreads = 256;
constexpr int kMaxSmem = 226 * 1024;  // dynamic shared memory: the sm_90 opt-in limit (227 KB) less the static part

__host__ __device__ constexpr int align128(int v) { return (v + 127) & ~127; }

// A warp's weight ring: S stages of SB k32 blocks of its unit's 16 weight rows (the codes,
// 16 x SB x 16 bytes, then the scale bytes, 16 x SB).
template <int SB>
__host__ __device__ constexpr int stage_bytes() {
    return 16 * SB * 16 + 16 * SB;
}

// Dynamic shared memory of the stream kernel for K inputs and E experts: two chunk slots (panel
// rows, activation scales, routing weights), the warps' weight rings and decoded weight scales,
// and the expert table with the two scans.
struct Smem {
    int prow;  // panel row stride in bytes: K rounded up to 128, + 32 (conflict-free 8-byte reads)
    int asc;   // in a slot: activation scales [ceil(K/64)][4][2][2] f32 (block pair, t, block, token)
    int rw;    // in a slot: the chunk's routing weights [8] f32 (GATE_UP), then its first slot and count
    int slot;  // bytes per slot
    int ring, sw, tab, bytes;
};
template <int SB, int S>
__host__ __device__ inline Smem smem_layout(int k, int e) {
    Smem m;
    m.prow = align128(k) + 32;
    m.asc = kTok * m.prow;
    m.rw = m.asc + ((k / 32 + 1) / 2) * 64;
    m.slot = align128(m.rw + kTok * 4 + 8);
    m.ring = kSlots * m.slot;
    m.sw = m.ring + kWarps * S * stage_bytes<SB>();
    m.tab = m.sw + kWarps * 16 * SB * 4;
    m.bytes = m.tab + e * 32 + 2 * (e + 1) * 4;
    return m;
}

// The stream kernel's shared memory for K inputs and E experts (the variant launch_stream picks).
inline int smem_bytes(int k, int e) {
    return (k / 32) % 8 == 0 ? smem_layout<8, 3>(k, e).bytes : smem_layout<4, 6>(k, e).bytes;
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
    const uint8_t* panel;        // [rows, K] e4m3 codes, 8-groups permuted
    const float* ascale;         // [rows, kb] block scales · 64
    const uint32_t* tok_sorted;  // [S] (GATE_UP)
    const float* rw_sorted;      // [S] (GATE_UP)
    __nv_bfloat16* out;          // [S, N]
    int e, n, k, kb, n_rg;
    float limit;
};

// A unit of the warp: the start of its round (the unit is rs + warp), its chunk, row group and
// expert.
struct UnitPos {
    int rs, chunk, rg, e;
};

// SB: k32 blocks per ring stage; S: stages per warp ring (S - 1 in flight while one is used);
// FULL: K/32 a multiple of SB (whole stages, the scales copied by 4-byte cp.async: 4-byte
// aligned, as the launcher checks), otherwise a partial last stage whose scale bytes the issuing
// lanes read and store themselves.
template <int MODE, int SB, int S, bool FULL>
__global__ void __launch_bounds__(kThreads, 1) moe_stream_kernel(const Args a) {
    static_assert(SB == 4 || SB == 8, "a stage's scales: one 4-byte word per half row (SB = 8) or per row (SB = 4)");
    static_assert(S >= 2, "one stage in use, at least one in flight");
    constexpr int kStage = stage_bytes<SB>();
    constexpr int kRowB = 16 * SB;      // a weight row's codes in a stage
    constexpr int kRpl = 8 / SB;        // weight rows per 128-byte line of a stage
    constexpr int kPieces = SB / 2;     // 16-byte code pieces per lane and stage
    constexpr int kPieceRows = 32 / SB; // rows between a lane's pieces
    extern __shared__ __align__(128) uint8_t smem[];
    const Smem L = smem_layout<SB, S>(a.k, a.e);
    uint64_t* tab = reinterpret_cast<uint64_t*>(smem + L.tab);
    int* off = reinterpret_cast<int*>(tab + 4 * a.e);  // [E + 1] exclusive prefix of the counts
    int* item = off + (a.e + 1);                       // [E + 1] exclusive prefix of the chunks
    __shared__ int warp_sum[2][kWarps];
    // CTA-uniform round state kept in shared memory: the end of the run, the last chunk loaded
    // and its expert.
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

    // Load side: the issuing position (unit isu, stage ist of its spu) runs S - 1 stages ahead of
    // the products, across units. Lane piece j: tile row (lane + 32 j) / SB, block lane % SB of
    // the stage; scale word: tile row lane / 2, bytes 4 (lane % 2) (SB = 8), or tile row lane,
    // lanes < 16 (SB = 4). Tile rows: GATE_UP 0-7 = w1, 8-15 = w3 (the same 8 rows), DOWN 16
    // rows of w2; rows past N read row N - 1 (their sums are never stored). In a stage, piece
    // (row r, block b) lands at r · 16 SB + 16 (b ^ ((r / kRpl) % SB)): the products' 4-byte reads
    // of rows g and g + 8 are conflict-free.
    const int half_k = a.k / 2, spu = (a.kb + SB - 1) / SB, pblk = lane % SB;
    const int srow = SB == 8 ? lane >> 1 : lane & 15;
    const uint8_t* pc[kPieces];
    uint32_t dofs[kPieces];
    const uint8_t* ps = nullptr;
#pragma unroll
    for (int j = 0; j < kPieces; ++j) {
        const int r = lane / SB + kPieceRows * j;
        dofs[j] = static_cast<uint32_t>(r * kRowB + 16 * (pblk ^ ((r / kRpl) % SB)));
    }
    auto point = [&](const UnitPos& p) {
        const uint64_t* te = tab + 4 * p.e;
#pragma unroll
        for (int j = 0; j < kPieces; ++j) {
            const int r = lane / SB + kPieceRows * j;
            const int row = MODE == DSV41_MOE_GATE_UP ? p.rg * 8 + (r & 7) : p.rg * 16 + r;
            const uint8_t* base = reinterpret_cast<const uint8_t*>(te[MODE == DSV41_MOE_GATE_UP && r >= 8 ? 2 : 0]);
            pc[j] = base + static_cast<int64_t>(min(row, a.n - 1)) * half_k + 16 * pblk;
        }
        const int row = MODE == DSV41_MOE_GATE_UP ? p.rg * 8 + (srow & 7) : p.rg * 16 + srow;
        const uint8_t* base = reinterpret_cast<const uint8_t*>(te[MODE == DSV41_MOE_GATE_UP && srow >= 8 ? 3 : 1]);
        ps = base + static_cast<int64_t>(min(row, a.n - 1)) * a.kb + (SB == 8 ? 4 * (lane & 1) : 0);
    };
    const uint32_t ring_w = sbase + static_cast<uint32_t>(L.ring + warp * (S * kStage));
    UnitPos isu{0, 0, 0, 0};
    int ist = 0;
    bool live = find_unit(u0, isu);
    if (live) {
        const int u = isu.rs + warp;
        isu.chunk = u / n_rg;
        isu.rg = u - isu.chunk * n_rg;
        isu.e = expert_search(isu.chunk);
        point(isu);
    }
    // The next stage into ring slot `slot` (a group committed in any case, empty past the warp's
    // last unit).
    auto issue = [&](int slot) {
        if (live && ist == spu) {
            live = next_unit(isu);
            if (live) point(isu);
            ist = 0;
        }
        if (live) {
            const uint32_t d = ring_w + static_cast<uint32_t>(slot * kStage);
            const int b0 = ist * SB;
#pragma unroll
            for (int j = 0; j < kPieces; ++j)
                if (FULL || b0 + pblk < a.kb) cp_async16_l2(d + dofs[j], pc[j] + 16 * b0);
            if (FULL) {
                if (SB == 8 || lane < 16) cp_async4(d + 16 * kRowB + 4 * lane, ps + b0);
            } else if (lane < 16) {  // SB = 4: this lane's row, the blocks left (0: never read)
                uint32_t w = 0;
#pragma unroll
                for (int i = 0; i < SB; ++i)
                    if (b0 + i < a.kb) w |= static_cast<uint32_t>(__ldg(ps + b0 + i)) << (8 * i);
                asm volatile("st.shared.b32 [%0], %1;" ::"r"(d + 16 * kRowB + 4 * lane), "r"(w) : "memory");
            }
            ++ist;
        }
        cp_async_commit();
    };

    // Compute side: stage st of the unit from ring slot `slot`; pb / ab: this lane's panel and
    // activation-scale addresses of block 0 in the unit's chunk slot.
    const uint8_t* const ring_p = smem + L.ring + warp * (S * kStage);
    float* const sw_warp = reinterpret_cast<float*>(smem + L.sw) + warp * (16 * SB);
    const int fg = 16 * ((g / kRpl) % SB);  // the swizzle of tile rows g and g + 8
    auto compute = [&](int slot, int st, const uint8_t* pb, const uint8_t* ab, float (&acc)[4]) {
        const uint8_t* rb = ring_p + slot * kStage;
        // Weight scales: this lane decodes SB / 2 of the stage's 16 x SB (tile row lane / 2,
        // blocks (SB / 2)(lane % 2) ...); the warp reads its fragment's back.
        if (SB == 8) {
            const uint32_t w = *reinterpret_cast<const uint32_t*>(rb + 16 * kRowB + 4 * lane);
            const float2 lo = e8m0x2_f32(w), hi = e8m0x2_f32(w >> 16);
            *reinterpret_cast<float4*>(sw_warp + 4 * lane) = make_float4(lo.x, lo.y, hi.x, hi.y);
        } else {
            const uint32_t w = *reinterpret_cast<const uint16_t*>(rb + 16 * kRowB + 2 * lane);
            *reinterpret_cast<float2*>(sw_warp + 2 * lane) = e8m0x2_f32(w);
        }
        __syncwarp();
        const uint8_t* wr0 = rb + g * kRowB + 4 * t;
        const uint8_t* wr1 = wr0 + 8 * kRowB;
        float4 sa = make_float4(0.0f, 0.0f, 0.0f, 0.0f), swa = sa, swb = sa;
#pragma unroll
        for (int i = 0; i < SB; ++i) {
            const int kb = st * SB + i;
            if (!FULL && kb >= a.kb) break;
            if (i % 4 == 0) {
                swa = *reinterpret_cast<const float4*>(sw_warp + g * SB + i);
                swb = *reinterpret_cast<const float4*>(sw_warp + (g + 8) * SB + i);
            }
            if ((i & 1) == 0) sa = *reinterpret_cast<const float4*>(ab + 32 * kb);
            const uint2 b = *reinterpret_cast<const uint2*>(pb + 32 * kb);
            const float sa0 = (i & 1) ? sa.z : sa.x, sa1 = (i & 1) ? sa.w : sa.y;
            const int q = i % 4;
            const float sw0 = q == 0 ? swa.x : q == 1 ? swa.y : q == 2 ? swa.z : swa.w;
            const float sw1 = q == 0 ? swb.x : q == 1 ? swb.y : q == 2 ? swb.z : swb.w;
            const int wo = (16 * i) ^ fg;
            const uint32_t wa = *reinterpret_cast<const uint32_t*>(wr0 + wo), wb = *reinterpret_cast<const uint32_t*>(wr1 + wo);
            const uint32_t ea = e2m1_even_e4m3(wa), oa = e2m1_odd_e4m3(wa), eb = e2m1_even_e4m3(wb), ob = e2m1_odd_e4m3(wb);
            const uint32_t a0[4] = {e4m3x2_lo_f16x2(ea), e4m3x2_lo_f16x2(eb), e4m3x2_lo_f16x2(oa), e4m3x2_lo_f16x2(ob)};
            const uint32_t a1[4] = {e4m3x2_hi_f16x2(ea), e4m3x2_hi_f16x2(eb), e4m3x2_hi_f16x2(oa), e4m3x2_hi_f16x2(ob)};
            const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            float p[4];
            mma16816(p, a0, e4m3x2_lo_f16x2(b.x), e4m3x2_hi_f16x2(b.x), zero);
            mma16816(p, a1, e4m3x2_lo_f16x2(b.y), e4m3x2_hi_f16x2(b.y), p);
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
            const uint8_t* src = a.panel + static_cast<int64_t>(tok) * a.k;
            for (int c16 = q; c16 < a.k / 16; c16 += 64) cp_async16_l2(dst + nn * L.prow + 16 * c16, src + 16 * c16);
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

    // The warp's first S - 1 stages in flight.
#pragma unroll
    for (int s = 0; s < S - 1; ++s) issue(s);
    int rp = 0;  // the ring slot of the next stage to use

    for (int rs = u0; rs < run_end;) {
        const int re = round_end(rs), c_hi = (re - 1) / n_rg;
        if (c_hi > resident) {
            // Every warp is past the earlier rounds (whose chunks are older than this round's).
            // The wait also takes the warps' weight stages in flight (cp.async completes in
            // groups, oldest first); they were issued before the chunk and arrive with it.
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
        if (rs + warp < re) {  // the warp's unit of this round: its first stages are in flight
            const int u = rs + warp, chunk = u / n_rg, rg = u - chunk * n_rg;
            const uint8_t* slot = smem + (chunk & 1) * L.slot;
            const uint8_t* pb = slot + g * L.prow + 8 * t;
            const uint8_t* ab = slot + L.asc + 16 * t;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int st = 0; st < spu; ++st) {
                cp_async_wait_group<S - 2>();
                __syncwarp();  // stage st is in for every lane; every lane is done with the previous one
                issue(rp == 0 ? S - 1 : rp - 1);
                compute(rp, st, pb, ab, acc);
                rp = rp + 1 == S ? 0 : rp + 1;
            }
            // Epilogue: lane (g, t) holds tile rows g, g + 8 of slots 2t, 2t + 1 of the chunk.
            const int* info = reinterpret_cast<const int*>(slot + L.rw + kTok * 4);
            const int base = info[0], cnt = info[1];
            if (MODE == DSV41_MOE_GATE_UP) {
                const int row = rg * 8 + g;
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
                    const int row = rg * 16 + g + 8 * r;
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int nn = 2 * t + c;
                        if (nn < cnt && row < a.n) a.out[static_cast<int64_t>(base + nn) * a.n + row] = __float2bfloat16_rn(acc[2 * r + c]);
                    }
                }
            }
        }
        rs = re;
    }
}

// One warp per (panel row, k32 block): Q1 of the block (spec §0.1b.8) as e4m3 codes,
// the 8-groups stored in the stream kernel's order (positions 1 <-> 2 and 5 <-> 6 swapped), and
// the block scale. GATE_UP also writes, for each slot position p, its token row, its routing
// weight and pos[order[p]] = p (grid-stride over the first threads).
__global__ void __launch_bounds__(kPrepThreads) moe_prep_kernel(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ panel,
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
    const uint8_t code = e4m3_code(Q1::round(Q1::quotient(v, bs)));  // an e4m3 value: exact
    const int q = lane & 7, at = (lane & ~7) | (q & 4) | ((q & 1) << 1) | ((q >> 1) & 1);
    panel[row * k + blk * 32 + at] = code;
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
    int kb, n_rg;
    int64_t rows, slots, panel_off, ascale_off, tok_off, rw_off, bytes;
};

using dsv41_launch::align256;

// Row groups of a unit: GATE_UP 8 rows of w1 with the same 8 of w3, DOWN 16 rows of w2.
inline int64_t row_groups(const Dsv41MoeExpertsParams* p) { return p->mode == DSV41_MOE_GATE_UP ? (p->n + 7) / 8 : (p->n + 15) / 16; }

inline int validate(const Dsv41MoeExpertsParams* p, size_t params_size) {
    const int v = dsv41_experts::validate_common(p, params_size);
    if (v != DSV41_OK) return v;
    if (p->kdim > DSV41_MOE_EXPERTS_MAX_KDIM || smem_bytes(p->kdim, p->num_experts) > kMaxSmem) return DSV41_ERR_SHAPE;
    // The units (chunks x row groups) are numbered in 32 bits; a chunk holds at least one slot.
    if ((p->num_tokens * p->k + p->num_experts) * row_groups(p) >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    return DSV41_OK;
}

// Scratch: the panel [rows, K] e4m3, the activation scales [rows, K/32] f32, then the sorted slots.
inline Plan make_plan(const Dsv41MoeExpertsParams* p) {
    Plan q;
    q.slots = p->num_tokens * p->k;
    q.kb = p->kdim / 32;
    q.n_rg = static_cast<int>(row_groups(p));
    q.rows = dsv41_experts::panel_rows(p);
    q.panel_off = 0;
    q.ascale_off = align256(q.rows * p->kdim);
    const dsv41_experts::SlotScratch sorted = dsv41_experts::slot_scratch(p, q.ascale_off + align256(q.rows * q.kb * 4));
    q.tok_off = sorted.tok_off;
    q.rw_off = sorted.rw_off;
    q.bytes = sorted.bytes;
    return q;
}

template <int MODE, int SB, int S, bool FULL>
cudaError_t launch_variant(const Args& a, cudaStream_t st) {
    const int bytes = smem_layout<SB, S>(a.k, a.e).bytes;
    return dsv41_launch::launch_persistent<moe_stream_kernel<MODE, SB, S, FULL>>(dim3(kThreads), bytes, kMaxSmem, st, a);
}

// Stages of 8 blocks (3 per ring) when they divide K/32, else of 4 (6 per ring): the same shared
// memory, 4 KB (16 warps: 64 KB per SM) or 5 KB (80 KB) of weights in flight per warp.
template <int MODE>
cudaError_t launch_stream(const Args& a, cudaStream_t st) {
    if (a.kb % 8 == 0) return launch_variant<MODE, 8, 3, true>(a, st);
    if (a.kb % 4 == 0) return launch_variant<MODE, 4, 6, true>(a, st);
    return launch_variant<MODE, 4, 6, false>(a, st);
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
    auto* panel = reinterpret_cast<uint8_t*>(base + q.panel_off);
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
