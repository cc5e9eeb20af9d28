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
//     DOWN 16 rows of w2); the units of all experts are numbered from an in-CTA scan of the
//     counts and each CTA takes an equal contiguous run of them, so the grid is fixed by the
//     device (graph capture) while the work follows the routing. The run's code bytes stream
//     through a 6-stage cp.async ring (16 rows x 1024 bytes = 64 k32 blocks per stage, rows
//     padded to 1040 bytes: conflict-free 4-byte reads) with their scales and the stage's unit
//     (computed once by the issuing threads, read by the compute side); the chunk's panel rows
//     and activation scales are copied into shared memory once per chunk (consecutive units of a
//     run share it), so a stage's products read shared memory only. The 16 warps split each
//     stage's blocks and meet in shared memory at the end of the unit (fixed warp order:
//     deterministic), where the GATE_UP epilogue has a and u of the same row and token in one
//     thread (rows 0-7 of the mma tile are w1, 8-15 w3) and applies the SwiGLU.
//   * products: per k32 block a lane holds 8 nibbles of each of its 2 rows (4 bytes). e2m1 is
//     e4m3 shifted: placing the sign at bit 7 and (e1 e0 m) at bits 4-2 gives the e4m3 code of
//     the value · 2^-6 (also for the subnormal 0.5), so each 4-byte word becomes 8 e4m3 codes
//     with 7 integer ops (even and odd nibbles apart), then f16 by cvt.rn.f16x2.e4m3x2 (exact),
//     and mma.sync m16n8k16 f16 -> f32 against the panel. The K order inside a block is
//     permuted (a dot product does not care; the panel is written in the same order), so no
//     shuffles. Each block's product starts from zero and is added to the running sum times
//     (2^sa · 64) · 2^sw in f32.
//   * Where the time goes (ncu, docs/perf.md "MoE experts"): the kernel is instruction-bound, not
//     bandwidth-bound (~1.1 TB/s at B = 64 on an H100); keeping the panel in shared memory did not
//     help by itself, fewer bookkeeping instructions per stage did.
//
// Numerics: products of e4m3 panel codes and e2m1 weights are exact in f16 x f16 -> f32; a
// block's 32 products are summed by the tensor core in f32 and added to the running sum as
// fma((p · 2^sa · 64), 2^sw, acc): the first product is exact (a power of two, the activation
// scale finite for finite inputs), the FMA rounds once, and an all-zero block adds 0 whatever
// the scales (a NaN weight scale, byte 255, still gives NaN like the reference). So a and u
// equal the reference up to the order of the f32 summation; everything after (bf16 rounding,
// clamp, silu, the products, the combine's f32 sum) is the CPU's sequence. Scale bytes >= 253
// make weights overflow f32 in the reference too.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "include/dsv41_fp8.cuh"
#include "include/dsv41_launch.cuh"
#include "include/dsv41_moe_experts.h"
#include "include/dsv41_numerics.cuh"

namespace dsv41 {
namespace moe_x {

constexpr int kWarps = 16;
constexpr int kThreads = 32 * kWarps;
constexpr int kTok = 8;                            // slots per chunk: one n8 tile
constexpr int kRows = 16;                          // weight rows per unit
constexpr int kBps = 64;                           // k32 blocks per stage
constexpr int kRowBytes = kBps * 16;               // code bytes per row and stage
constexpr int kSrow = kRowBytes + 16;              // padded shared-memory row
constexpr int kScaleOff = kRows * kSrow;           // stage: scales [16][64] after the codes
constexpr int kInfoOff = kScaleOff + kRows * kBps; // then the stage's unit (expert, row group, first slot, count, chunk)
constexpr int kStages = 6;
constexpr int kRedBytes = kWarps * 4 * 32 * 4;
constexpr int kPrepThreads = 256;
constexpr int kMaxSmem = 226 * 1024;  // dynamic shared memory: the sm_90 opt-in limit (227 KB) less the static part

constexpr int align128(int v) { return (v + 127) & ~127; }
constexpr int kStageBytes = align128(kInfoOff + 5 * 4);

// Dynamic shared memory of the stream kernel for K inputs and E experts: the weight stages, the
// resident chunk (panel rows, activation scales, token rows and routing weights), the warps'
// partial sums, and the expert table with the two scans.
struct Smem {
    int prow;    // panel row stride in bytes: 2K + 64 (= 64 mod 128: conflict-free 16-byte reads)
    int arow;    // activation-scale row stride in floats: K/32 made odd (conflict-free)
    int panel, ascale, tok, red, tab, bytes;
};
__host__ __device__ inline Smem smem_layout(int k, int e) {
    Smem m;
    m.prow = 2 * k + 64;
    m.arow = (k / 32) | 1;
    m.panel = kStages * kStageBytes;
    m.ascale = m.panel + kTok * m.prow;
    m.tok = m.ascale + ((kTok * m.arow * 4 + 15) & ~15);
    m.red = m.tok + 2 * kTok * 4;
    m.tab = m.red + kRedBytes;
    m.bytes = m.tab + e * 32 + 2 * (e + 1) * 4;
    return m;
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0) : "memory");
}

// 8 e2m1 codes (a 4-byte word, code i in nibble i) -> 8 e4m3 codes of the values · 2^-6:
// even = codes 0, 2, 4, 6 (one per byte), odd = codes 1, 3, 5, 7.
__device__ __forceinline__ uint32_t e2m1_even_e4m3(uint32_t w) { return ((w << 2) & 0x1c1c1c1cu) | ((w << 4) & 0x80808080u); }
__device__ __forceinline__ uint32_t e2m1_odd_e4m3(uint32_t w) { return ((w >> 2) & 0x1c1c1c1cu) | (w & 0x80808080u); }

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
    int e, n, k, kb, parts, n_rg;
    float limit;
};

struct Unit {
    int e, rg, base, cnt;
    int chunk_id;  // global chunk index (the resident chunk changes with it)
};

// The SwiGLU of kernels/swiglu.cu on bf16-rounded a and u, times the routing weight.
__device__ __forceinline__ float swiglu(float a, float u, float w, float limit) {
    if (limit > 0.0f) {
        a = fminf(a, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    const float s = __fdiv_rn(a, __fadd_rn(1.0f, expf(-a)));
    return __fmul_rn(__fmul_rn(s, u), w);
}

template <int MODE>
__global__ void __launch_bounds__(kThreads, 1) moe_stream_kernel(const Args a) {
    extern __shared__ __align__(128) uint8_t smem[];
    const Smem L = smem_layout(a.k, a.e);
    uint8_t* panel_s = smem + L.panel;
    float* asc_s = reinterpret_cast<float*>(smem + L.ascale);
    uint32_t* tok_s = reinterpret_cast<uint32_t*>(smem + L.tok);
    float* rw_s = reinterpret_cast<float*>(tok_s + kTok);
    float* red = reinterpret_cast<float*>(smem + L.red);
    uint64_t* tab = reinterpret_cast<uint64_t*>(smem + L.tab);
    int* off = reinterpret_cast<int*>(tab + 4 * a.e);  // [E + 1] exclusive prefix of the counts
    int* item = off + (a.e + 1);                       // [E + 1] exclusive prefix of the chunks
    __shared__ int warp_sum[2][kWarps];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

    // The pointer table is the caller's static data: read it before waiting for the routing.
    for (int i = tid; i < 4 * a.e; i += kThreads) tab[i] = a.experts[i];
    asm volatile("griddepcontrol.wait;" ::: "memory");

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
    const int64_t units = static_cast<int64_t>(item[a.e]) * a.n_rg;
    const int u0 = static_cast<int>(units * blockIdx.x / gridDim.x), u1 = static_cast<int>(units * (blockIdx.x + 1) / gridDim.x);
    const int n_stages = (u1 - u0) * a.parts;
    if (n_stages == 0) return;

    auto unit_of = [&](int u) {
        const int it_id = static_cast<int>(static_cast<unsigned>(u) / static_cast<unsigned>(a.n_rg));
        int lo = 0, hi = a.e;  // the largest expert whose first chunk is <= it_id
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (item[mid] <= it_id) lo = mid;
            else hi = mid;
        }
        Unit un;
        un.e = lo;
        un.rg = u - it_id * a.n_rg;
        un.chunk_id = it_id;
        un.base = off[lo] + (it_id - item[lo]) * kTok;
        const int left = off[lo + 1] - un.base;
        un.cnt = left < kTok ? left : kTok;
        return un;
    };
    const int half_k = a.k / 2;
    struct RowPtrs {
        const uint8_t *codes, *scales;
    };
    // The weight row of tile row `row` (0..15) of the unit's row group: its codes and scales (null
    // past the last row).
    auto tile_row = [&](const Unit& un, int row) {
        const uint64_t* te = tab + 4 * un.e;
        const int w = MODE == DSV41_MOE_GATE_UP ? row >> 3 : 0;
        const int wr = MODE == DSV41_MOE_GATE_UP ? un.rg * 8 + (row & 7) : un.rg * 16 + row;
        if (wr >= a.n) return RowPtrs{nullptr, nullptr};
        return RowPtrs{reinterpret_cast<const uint8_t*>(te[2 * w]) + static_cast<int64_t>(wr) * half_k,
                       reinterpret_cast<const uint8_t*>(te[2 * w + 1]) + static_cast<int64_t>(wr) * a.kb};
    };
    // Issue side: this thread's copies of every stage are fixed (code chunks tid and tid + 512 =
    // rows tid / 64 and tid / 64 + 8 at byte 16 (tid % 64); scale piece tid % 16 of row tid / 16
    // for tid < 256, or scale bytes tid % 64 of rows tid / 64 and + 8), so their sources are set
    // once per unit and each stage adds its offset. Thread 0 also writes the stage's unit for
    // the compute side.
    const bool scale_vec = (a.kb & 3) == 0;
    const int crow = tid >> 6, cch = tid & 63;
    RowPtrs ip0{nullptr, nullptr}, ip1{nullptr, nullptr}, ips{nullptr, nullptr};
    Unit iun;
    int iss_part = 0, iss_unit = 0;
    auto issue = [&](int s) {  // the next stage in order (unit iss_unit, part iss_part) into slot s % S
        if (iss_part == 0) {
            iun = unit_of(u0 + iss_unit);
            ip0 = tile_row(iun, crow);
            ip1 = tile_row(iun, crow + 8);
            if (scale_vec && tid < kRows * 16) ips = tile_row(iun, tid >> 4);
        }
        const int part = iss_part;
        uint8_t* slot = smem + (s % kStages) * kStageBytes;
        const uint32_t base = smem_addr + static_cast<uint32_t>(s % kStages) * kStageBytes;
        const int col = part * kRowBytes + 16 * cch;
        const bool c0 = ip0.codes && col < half_k, c1 = ip1.codes && col < half_k;
        cp_async16(base + crow * kSrow + 16 * cch, c0 ? static_cast<const void*>(ip0.codes + col) : a.panel, c0);
        cp_async16(base + (crow + 8) * kSrow + 16 * cch, c1 ? static_cast<const void*>(ip1.codes + col) : a.panel, c1);
        if (scale_vec) {
            if (tid < kRows * 16) {
                const int scol = part * kBps + 4 * (tid & 15);
                const bool ok = ips.scales && scol < a.kb;
                cp_async4(base + kScaleOff + 4 * tid, ok ? static_cast<const void*>(ips.scales + scol) : a.ascale, ok);
            }
        } else {
            // K / 32 not a multiple of 4 (small test models): byte copies, synchronous.
            const int scol = part * kBps + cch;
            slot[kScaleOff + crow * kBps + cch] = (ip0.scales && scol < a.kb) ? ip0.scales[scol] : 0;
            slot[kScaleOff + (crow + 8) * kBps + cch] = (ip1.scales && scol < a.kb) ? ip1.scales[scol] : 0;
        }
        if (tid == 0) {
            int* info = reinterpret_cast<int*>(slot + kInfoOff);
            info[0] = iun.e;
            info[1] = iun.rg;
            info[2] = iun.base;
            info[3] = iun.cnt;
            info[4] = iun.chunk_id;
        }
        if (++iss_part == a.parts) {
            iss_part = 0;
            ++iss_unit;
        }
    };

    for (int d = 0; d < kStages - 1; ++d) {
        if (d < n_stages) issue(d);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    bool vg = false, v0 = false, v1 = false;  // tokens g, 2t, 2t + 1 of the chunk exist
    Unit un;
    int part = 0, resident = -1;
    for (int s = 0; s < n_stages; ++s) {
        asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2) : "memory");
        __syncthreads();  // stage s is complete for every thread; slot (s - 1) % S is free
        if (s + kStages - 1 < n_stages) issue(s + kStages - 1);
        asm volatile("cp.async.commit_group;" ::: "memory");

        const uint8_t* st = smem + (s % kStages) * kStageBytes;
        if (part == 0) {
            const int* info = reinterpret_cast<const int*>(st + kInfoOff);
            un.e = info[0];
            un.rg = info[1];
            un.base = info[2];
            un.cnt = info[3];
            un.chunk_id = info[4];
            if (un.chunk_id != resident) {
                // A new chunk of slots: its panel rows, activation scales, token rows and routing
                // weights into shared memory (every thread is past the previous unit's epilogue).
                if (tid < un.cnt) {
                    const int p = un.base + tid;
                    tok_s[tid] = MODE == DSV41_MOE_GATE_UP ? a.tok_sorted[p] : static_cast<uint32_t>(p);
                    rw_s[tid] = MODE == DSV41_MOE_GATE_UP ? a.rw_sorted[p] : 0.0f;
                }
                __syncthreads();
                const int vec = a.k / 8;  // 16-byte pieces per panel row
                for (int nn = 0; nn < un.cnt; ++nn) {
                    const uint4* src = reinterpret_cast<const uint4*>(a.panel + static_cast<int64_t>(tok_s[nn]) * a.k);
                    for (int c = tid; c < vec; c += kThreads) *reinterpret_cast<uint4*>(panel_s + nn * L.prow + 16 * c) = __ldg(src + c);
                    const float* srs = a.ascale + static_cast<int64_t>(tok_s[nn]) * a.kb;
                    for (int c = tid; c < a.kb; c += kThreads) asc_s[nn * L.arow + c] = __ldg(srs + c);
                }
                __syncthreads();
                resident = un.chunk_id;
            }
            vg = g < un.cnt;
            v0 = 2 * t < un.cnt;
            v1 = 2 * t + 1 < un.cnt;
        }

        // The warp's blocks of this stage (lb = warp + 16 i): weights, scales and the panel from
        // shared memory.
#pragma unroll
        for (int i = 0; i < kBps / kWarps; ++i) {
            const int lb = warp + kWarps * i, kb = part * kBps + lb;
            if (kb >= a.kb) break;
            const uint32_t wa = *reinterpret_cast<const uint32_t*>(st + g * kSrow + 16 * lb + 4 * t);
            const uint32_t wb = *reinterpret_cast<const uint32_t*>(st + (g + 8) * kSrow + 16 * lb + 4 * t);
            const float swa = fp8::e8m0_f32(st[kScaleOff + g * kBps + lb]);
            const float swb = fp8::e8m0_f32(st[kScaleOff + (g + 8) * kBps + lb]);
            const uint4 b = vg ? *reinterpret_cast<const uint4*>(panel_s + g * L.prow + 64 * kb + 16 * t) : make_uint4(0u, 0u, 0u, 0u);
            const float sa0 = v0 ? asc_s[2 * t * L.arow + kb] : 0.0f;
            const float sa1 = v1 ? asc_s[(2 * t + 1) * L.arow + kb] : 0.0f;
            const uint32_t ea = e2m1_even_e4m3(wa), oa = e2m1_odd_e4m3(wa), eb = e2m1_even_e4m3(wb), ob = e2m1_odd_e4m3(wb);
            const uint32_t a0[4] = {fp8::e4m3x2_f16x2(static_cast<uint16_t>(ea & 0xffffu)), fp8::e4m3x2_f16x2(static_cast<uint16_t>(eb & 0xffffu)),
                                    fp8::e4m3x2_f16x2(static_cast<uint16_t>(oa & 0xffffu)), fp8::e4m3x2_f16x2(static_cast<uint16_t>(ob & 0xffffu))};
            const uint32_t a1[4] = {fp8::e4m3x2_f16x2(static_cast<uint16_t>(ea >> 16)), fp8::e4m3x2_f16x2(static_cast<uint16_t>(eb >> 16)),
                                    fp8::e4m3x2_f16x2(static_cast<uint16_t>(oa >> 16)), fp8::e4m3x2_f16x2(static_cast<uint16_t>(ob >> 16))};
            const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            float p[4];
            mma16816(p, a0, b.x, b.y, zero);
            mma16816(p, a1, b.z, b.w, p);
            // (p · 2^sa · 64) · 2^sw: the first product is exact, the FMA rounds once; an all-zero
            // block stays 0 (the activation scale is finite for finite x).
            acc[0] = fmaf(p[0] * sa0, swa, acc[0]);
            acc[1] = fmaf(p[1] * sa1, swa, acc[1]);
            acc[2] = fmaf(p[2] * sa0, swb, acc[2]);
            acc[3] = fmaf(p[3] * sa1, swb, acc[3]);
        }
        if (++part != a.parts) continue;
        part = 0;

        // End of the unit: the warps' sums meet in red (fixed order), then the epilogue.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            red[(warp * 4 + i) * 32 + lane] = acc[i];
            acc[i] = 0.0f;
        }
        __syncthreads();
        auto sum_of = [&](int r, int nn) {  // tile row r (0..15), chunk column nn (0..7)
            const int i = (r >= 8 ? 2 : 0) + (nn & 1), ln = (r & 7) * 4 + (nn >> 1);
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) v += red[(w * 4 + i) * 32 + ln];
            return v;
        };
        if (MODE == DSV41_MOE_GATE_UP) {
            if (tid < 8 * kTok) {
                const int r = tid & 7, nn = tid >> 3, row = un.rg * 8 + r;
                if (nn < un.cnt && row < a.n) {
                    const float av = __bfloat162float(__float2bfloat16_rn(sum_of(r, nn)));
                    const float uv = __bfloat162float(__float2bfloat16_rn(sum_of(r + 8, nn)));
                    a.out[static_cast<int64_t>(un.base + nn) * a.n + row] = __float2bfloat16_rn(swiglu(av, uv, rw_s[nn], a.limit));
                }
            }
        } else if (tid < 16 * kTok) {
            const int r = tid & 15, nn = tid >> 4, row = un.rg * 16 + r;
            if (nn < un.cnt && row < a.n) a.out[static_cast<int64_t>(un.base + nn) * a.n + row] = __float2bfloat16_rn(sum_of(r, nn));
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
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
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int64_t gid = static_cast<int64_t>(blockIdx.x) * kPrepThreads + threadIdx.x;
    if (order) {
        for (int64_t p = gid; p < slots; p += static_cast<int64_t>(gridDim.x) * kPrepThreads) {
            const uint32_t s = order[p];
            tok_sorted[p] = s / static_cast<uint32_t>(topk);
            rw_sorted[p] = route_w[s];
            if (pos) pos[s] = static_cast<uint32_t>(p);
        }
    }
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
    asm volatile("griddepcontrol.wait;" ::: "memory");
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
    int kb, parts, n_rg;
    int64_t rows, slots, panel_off, ascale_off, tok_off, rw_off, bytes;
};

using dsv41_launch::align256;

inline int validate(const Dsv41MoeExpertsParams* p, size_t params_size) {
    if (params_size != sizeof(Dsv41MoeExpertsParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_experts < 1 || p->num_experts > DSV41_MOE_EXPERTS_MAX_E || p->k < 1 || p->num_tokens < 0) return DSV41_ERR_SHAPE;
    if (p->n < 1 || p->kdim < 32 || p->kdim % 32 != 0) return DSV41_ERR_SHAPE;
    if (p->mode != DSV41_MOE_GATE_UP && p->mode != DSV41_MOE_DOWN) return DSV41_ERR_SHAPE;
    if (p->num_tokens * p->k >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    if (p->kdim > DSV41_MOE_EXPERTS_MAX_KDIM || smem_layout(p->kdim, p->num_experts).bytes > kMaxSmem) return DSV41_ERR_SHAPE;
    // The units (chunks x row groups) are numbered in 32 bits; a chunk holds at least one slot.
    const int64_t n_rg = p->mode == DSV41_MOE_GATE_UP ? (p->n + 7) / 8 : (p->n + 15) / 16;
    if ((p->num_tokens * p->k + p->num_experts) * n_rg >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    return DSV41_OK;
}

inline Plan make_plan(const Dsv41MoeExpertsParams* p) {
    Plan q;
    q.slots = p->num_tokens * p->k;
    q.kb = p->kdim / 32;
    q.parts = (q.kb + kBps - 1) / kBps;
    q.n_rg = p->mode == DSV41_MOE_GATE_UP ? (p->n + 7) / 8 : (p->n + 15) / 16;
    q.rows = p->mode == DSV41_MOE_GATE_UP ? p->num_tokens : q.slots;
    q.panel_off = 0;
    q.ascale_off = align256(q.rows * p->kdim * 2);
    q.tok_off = q.ascale_off + align256(q.rows * q.kb * 4);
    q.rw_off = q.tok_off + (p->mode == DSV41_MOE_GATE_UP ? align256(q.slots * 4) : 0);
    q.bytes = q.rw_off + (p->mode == DSV41_MOE_GATE_UP ? align256(q.slots * 4) : 0);
    if (q.bytes == 0) q.bytes = 256;
    return q;
}

using dsv41_launch::sm_count;

template <int MODE>
cudaError_t launch_stream(const Args& a, cudaStream_t st) {
    static thread_local int configured_dev = -1;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    if (configured_dev != dev) {
        err = cudaFuncSetAttribute(moe_stream_kernel<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem);
        if (err != cudaSuccess) return err;
        configured_dev = dev;
    }
    const int smem = smem_layout(a.k, a.e).bytes;
    return dsv41_launch::launch_pdl(moe_stream_kernel<MODE>, dim3(sm_count()), dim3(kThreads), smem, st, 1, a);
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
    const bool gu = p->mode == DSV41_MOE_GATE_UP;
    if (!p->experts || !p->x || !p->counts || !p->order || !p->out || !p->scratch || (gu && !p->route_w)) return DSV41_ERR_NULL;
    const Plan q = make_plan(p);
    if (p->scratch_bytes < q.bytes) return DSV41_ERR_SHAPE;
    if ((reinterpret_cast<uintptr_t>(p->scratch) & 255) != 0 || (reinterpret_cast<uintptr_t>(p->out) & 1) != 0 ||
        (reinterpret_cast<uintptr_t>(p->x) & 1) != 0)
        return DSV41_ERR_ALIGNMENT;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    char* base = static_cast<char*>(p->scratch);
    auto* panel = reinterpret_cast<uint16_t*>(base + q.panel_off);
    auto* ascale = reinterpret_cast<float*>(base + q.ascale_off);
    auto* tok_sorted = reinterpret_cast<uint32_t*>(base + q.tok_off);
    auto* rw_sorted = reinterpret_cast<float*>(base + q.rw_off);

    const int64_t prep_threads = q.rows * q.kb * 32 > q.slots ? q.rows * q.kb * 32 : q.slots;
    const int64_t prep_blocks = (prep_threads + kPrepThreads - 1) / kPrepThreads;
    if (prep_blocks >= (int64_t{1} << 31)) return DSV41_ERR_SHAPE;
    cudaError_t e = dsv41_launch::launch_pdl(moe_prep_kernel, dim3(static_cast<unsigned>(prep_blocks)), dim3(kPrepThreads), 0, st, 1,
                                             static_cast<const __nv_bfloat16*>(p->x), panel, ascale, q.rows, p->kdim, q.kb,
                                             gu ? p->order : nullptr, p->route_w, tok_sorted, rw_sorted, gu ? p->pos : nullptr, q.slots,
                                             p->k);
    if (e != cudaSuccess) return static_cast<int>(e);

    Args a;
    a.experts = p->experts;
    a.counts = p->counts;
    a.panel = panel;
    a.ascale = ascale;
    a.tok_sorted = tok_sorted;
    a.rw_sorted = rw_sorted;
    a.out = static_cast<__nv_bfloat16*>(p->out);
    a.e = p->num_experts;
    a.n = p->n;
    a.k = p->kdim;
    a.kb = q.kb;
    a.parts = q.parts;
    a.n_rg = q.n_rg;
    a.limit = p->limit;
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
