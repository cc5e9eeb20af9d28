// moe_experts_gemm: the two grouped projections of kernels/moe_experts.cu (GATE_UP with the SwiGLU
// epilogue, DOWN; spec §8, weights MXFP4 as stored, spec §2.4) on the tensor cores, for many slots
// per expert (prefill). Same parameter block, inputs and outputs as dsv41_moe_experts (act / y in
// expert order [S, N] bf16, pos for the combine), so moe_experts.cu's combine follows unchanged;
// crates/deepseek-v41/src/cuda/moe_experts.rs picks this path when T·k > 8·E. Tests:
// tests/cuda_moe_experts_gemm.rs (the CPU path of model::Moe as the reference).
//
// Design:
//   * prep kernel: the Q1 fake-quantized inputs (spec §0.1b.8: e4m3 value x 2^s, exact in bf16) as
//     a bf16 panel [rows, kp] (kp = K rounded up to 128, zeros past K), the inputs of each
//     128-wide group stored at stage_pos() (below); GATE_UP also writes each slot's token row,
//     routing weight and pos, as the stream path's prep does.
//   * GEMM: a persistent grid (one CTA of 3 warpgroups per SM). An item is (expert, tile of up to
//     128 of its slots, tile of 128 weight rows: GATE_UP the same 64 rows of w1 and w3, DOWN 128
//     rows of w2); the items of all experts are numbered from an in-CTA scan of the counts (row
//     tiles fastest) and CTA b takes items b, b + grid, b + 2 grid, ...: the CTAs running at once
//     work on a window of consecutive items, the row tiles of a few experts, so the slot rows that
//     every row tile of an expert reads again stay in L2 (in contiguous runs per CTA, the 132
//     experts' panels in use at once outgrew L2 and came from DRAM again). The grid is fixed by
//     the device (graph capture) while the work follows the routing. Deterministic: an item is
//     computed by one CTA in a fixed order.
//   * producer warpgroup: per stage of 128 inputs, with cp.async, the slots' panel rows (gathered
//     by token for GATE_UP; 128-byte-swizzled K-major, two 64-input atoms), the 128 weight rows'
//     code bytes (64 per row) and scale bytes (4 per row) into a ring of kStages stages, mbarrier
//     hand-over as in kernels/fp8_gemm.cu.
//   * consumer warpgroups (64 weight rows each: the wgmma M, the weights being operand A): per
//     stage a thread loads its two rows' 16-byte code chunk (one k32 block of the row) and scale
//     bytes and turns them into the stage's bf16 A fragments in registers: code bits placed into
//     bf16 (sign at bit 15, e1 e0 m at bits 8..6: the value e2m1 x 2^-126, the code 0.5 a
//     subnormal), times 2^(s - 1) with one bf16x2 FMA, exact; then the stage's 8 wgmma m64nNk16
//     (N = the item's slots rounded up to 16) against the panel tile in one group, f32
//     accumulation over the whole K. The group is waited for before the next stage's conversion
//     (ptxas serializes products whose register inputs are written while an accumulation chain is
//     in flight), so the two consumer warpgroups alternate: one converts while the other's
//     products run. Which input a register holds is fixed by the code layout (thread t of a quad
//     takes block t of the stage, its word b feeds k32 step b), and stage_pos() stores the
//     activations in that order: a dot product does not care about the order of its terms.
//   * epilogue from the accumulators: GATE_UP rows g / g + 8 of a warp's 16 are the same output
//     row of w1 / w3 (a and u in one thread), bf16 + the SwiGLU of kernels/moe_experts.cu and the
//     routing weight; DOWN bf16. Stores bounds-checked (rows past N, slots past the count).
//
// Numerics: the A operand is exact (e2m1 x 2^(s - 127) for scale bytes s in [33, 128]), the
// activations are exact, products of such values are exact and normal in f32 (|x| >= 2^-31 for a
// nonzero Q1 value: block scales >= 2^-22 and e4m3 >= 2^-9; |w| >= 2^(s - 128) >= 2^-95), and
// the tensor core sums them in f32: a and u differ from the CPU reference (quant::mxfp4_linear_ref)
// only by the f32 summation order, the class of the dequantize + cuBLAS path. A block whose scale
// byte is outside [33, 128] contributes exactly 0 when all its codes are 0 (the factor is clamped
// into the range); otherwise (a scale above 2^1 or below 2^-94, or the NaN scale byte 255) the
// expert's projection is flagged once (dsv41_moe_gemm_flags, at GroupedExperts::new) and its items
// run the exact path: f32 weights e2m1 x e8m0_f32(s) (subnormals, inf and NaN as the reference)
// times the same bf16 activations, fmaf over K on the CUDA cores, same epilogue. Trained weights'
// scales lie far inside the range (the tests force the exact path with tiny and large bytes).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "include/dsv41_fp8.cuh"
#include "include/dsv41_hopper.cuh"
#include "include/dsv41_launch.cuh"
#include "include/dsv41_moe_experts_common.cuh"
#include "include/dsv41_moe_experts_gemm.h"
#include "include/dsv41_numerics.cuh"
#include "include/dsv41_wgmma_rs.cuh"

namespace dsv41 {
namespace moe_g {

using namespace dsv41_ptx;
using dsv41_experts::swiglu;

constexpr int kThreads = 384;         // consumer warpgroups 0 and 1, producer warpgroup 2
constexpr int kConsumerWarps = 8;
constexpr int kProd = 128;
constexpr int BM = 128;               // weight rows of an item
constexpr int BN = 128;               // slots of an item at most
constexpr int BK = 128;               // inputs per stage (4 k32 blocks)
constexpr int kStages = 5;
constexpr int kAtom = BN * 128;       // [128 slots][64 inputs] bf16, 128-byte swizzle
constexpr int SM_B = 0;               // the panel tile: 2 atoms
constexpr int SM_C = 2 * kAtom;       // code bytes [BM][64]
constexpr int SM_S = SM_C + BM * 64;  // scale bytes [BM][4]
constexpr int kStageBytes = (SM_S + BM * 4 + 1023) & ~1023;
constexpr uint32_t kFastLo = 33, kFastHi = 128;  // scale bytes the bf16 path multiplies exactly
constexpr int kPrepThreads = 256;
constexpr int kMaxSmem = 227 * 1024;
static_assert(kStageBytes % 1024 == 0, "stages keep the 1024-byte alignment of the swizzled tiles");

// Dynamic shared memory for E experts: the stages, the scans (slots, items; exclusive prefixes
// [E + 1]), the mbarriers, and the slack that aligns the base to 1024 bytes.
struct Smem {
    int off, item, bar, bytes;
};
__host__ __device__ inline Smem smem_layout(int e) {
    Smem m;
    m.off = kStages * kStageBytes;
    m.item = m.off + 4 * (e + 1);
    m.bar = (m.item + 4 * (e + 1) + 7) & ~7;
    m.bytes = m.bar + 2 * kStages * 8 + 1024;
    return m;
}

// Position of input o (0..127 inside its 128-input group) in the panel and in the products:
// o = 32 t + 8 b + i (block t of the stage, word b of the block's 16 code bytes, nibble i) goes to
// k32 step b, k16 half (i >> 1) & 1, register pair i & 1, column 2t + (i >> 2) of the A fragment
// (dsv41_wgmma_rs.cuh), which is where e2m1x2_bf16<P> puts nibble i of word b for thread t.
__host__ __device__ constexpr int stage_pos(int o) {
    return 32 * ((o >> 3) & 3) + 16 * ((o >> 1) & 1) + 8 * (o & 1) + 2 * (o >> 5) + ((o >> 2) & 1);
}

struct Args {
    const uint64_t* experts;       // [E, 4]
    const uint32_t* counts;        // [E]
    const uint32_t* flags;         // [E] DSV41_MOE_GEMM_FLAG_*
    const __nv_bfloat16* panel;    // [rows, kp]
    const uint32_t* tok_sorted;    // [S] (GATE_UP)
    const float* rw_sorted;        // [S] (GATE_UP)
    __nv_bfloat16* out;            // [S, n]
    int e, n, k, kb, kp, nk, n_rt;
    float limit;
};

struct Item {
    int e, rt, base, cnt;  // expert, weight-row tile, first slot (expert order), slots (1..128)
};

__device__ __forceinline__ int round16(int v) { return (v + 15) & ~15; }

// An expert's items for c slots.
__device__ __forceinline__ int items_of(int c, int n_rt) { return (c + BN - 1) / BN * n_rt; }

// Item idx: expert (the last with item[e] <= idx), slot tile j and row tile (row tiles fastest).
__device__ Item decode(int idx, const int* off, const int* item, int ne, int n_rt) {
    int lo = 0, hi = ne;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (item[mid] <= idx) lo = mid;
        else hi = mid;
    }
    const int i = idx - item[lo], j = i / n_rt;
    Item u;
    u.e = lo;
    u.rt = i - j * n_rt;
    u.base = off[lo] + j * BN;
    u.cnt = min(BN, off[lo + 1] - u.base);
    return u;
}

struct WRow {
    const uint8_t *codes, *scales;
};
// Weight row of tile row m (0..127) of row tile rt: GATE_UP rows 16w + 0..7 are w1 rows
// 64 rt + 8w + 0..7 and rows 16w + 8..15 the same rows of w3 (a and u meet in one thread); DOWN
// row m is w2 row 128 rt + m. Null past the last row.
template <int MODE>
__device__ __forceinline__ WRow weight_row(const uint64_t* te, int rt, int m, const Args& a) {
    const int w = MODE == DSV41_MOE_GATE_UP ? (m >> 3) & 1 : 0;
    const int row = MODE == DSV41_MOE_GATE_UP ? 64 * rt + 8 * (m >> 4) + (m & 7) : BM * rt + m;
    if (row >= a.n) return WRow{nullptr, nullptr};
    return WRow{reinterpret_cast<const uint8_t*>(__ldg(te + 2 * w)) + static_cast<int64_t>(row) * (a.k / 2),
                reinterpret_cast<const uint8_t*>(__ldg(te + 2 * w + 1)) + static_cast<int64_t>(row) * a.kb};
}

__device__ __forceinline__ void st_shared_u8(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u8 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// bf16x2 of nibbles P (low half) and P + 4 (high half) of w as e2m1 x 2^-126, exact: the sign to
// bit 15 / 31, (e1 e0 m) to bits 8..6 / 24..22, so e1 e0 is the exponent field and m the first
// mantissa bit (e = 0: the subnormal m x 2^-127).
template <int P>
__device__ __forceinline__ uint32_t e2m1x2_bf16(uint32_t w) {
    const uint32_t x = w << (12 - 4 * P);
    return (x & 0x80008000u) | ((x >> 6) & 0x01c001c0u);
}
// 2^(s - 1) in both halves of a bf16x2 for the scale byte s clamped to [kFastLo, kFastHi]: times
// e2m1 x 2^-126 it is the weight e2m1 x 2^(s - 127); an all-zero block stays 0 whatever its byte.
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t s) {
    s = min(max(s, kFastLo), kFastHi);
    return (s + 126u) * 0x00800080u;
}
// a * b in bf16x2 (fma with -0: exact products stay exact, signed zeros kept).
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}
// An e2m1 code as f32 (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6).
__device__ __forceinline__ float e2m1_f32(uint32_t c) {
    const uint32_t m = c & 7u;
    const uint32_t mag = m < 2 ? (m ? 0x3f000000u : 0u) : ((((m >> 1) + 126u) << 23) | ((m & 1u) << 22));
    return __uint_as_float(mag | ((c & 8u) << 28));
}

// Context of a consumer thread.
struct Consumer {
    uint32_t sbase, full, empty;
    const unsigned char* smem;
    int warp, lane, g, t, mrow;  // mrow: the thread's first tile row (64 wg + 16 (warp % 4) + g)
};

__device__ __forceinline__ void release(const Consumer& c, int s) {
    __syncwarp();
    if (c.lane == 0) mbar_arrive(c.empty + 8 * s);
}

// One item of N = 16 NV slot columns: its nk stages (the ring position s / phase ph advance), then
// the epilogue.
template <int MODE, int NV>
__device__ __forceinline__ void run_item(const Args& a, const Item& u, bool exact, const Consumer& c, int& s, uint32_t& ph) {
    float acc[8 * NV];
#pragma unroll
    for (int i = 0; i < 8 * NV; ++i) acc[i] = 0.0f;
    const int r0 = c.mrow * 64 + 16 * c.t, r1 = r0 + 8 * 64;  // the thread's code chunks in a stage
    if (!exact) {
        for (int kt = 0; kt < a.nk; ++kt) {
            mbar_wait(c.full + 8 * s, ph);
            fence_proxy_async();  // the stage (cp.async writes) is read by wgmma
            const uint32_t st = c.sbase + s * kStageBytes;
            const unsigned char* sp = c.smem + s * kStageBytes;
            const uint4 w0 = *reinterpret_cast<const uint4*>(sp + SM_C + r0);
            const uint4 w1 = *reinterpret_cast<const uint4*>(sp + SM_C + r1);
            const uint32_t f0 = scale_bf16x2(sp[SM_S + 4 * c.mrow + c.t]), f1 = scale_bf16x2(sp[SM_S + 4 * (c.mrow + 8) + c.t]);
            const uint32_t x0[4] = {w0.x, w0.y, w0.z, w0.w}, x1[4] = {w1.x, w1.y, w1.z, w1.w};
            // The stage's A fragments: k32 step b takes word b of both rows' chunks.
            uint32_t A[4][8];
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                A[b][0] = bf16x2_mul(e2m1x2_bf16<0>(x0[b]), f0);
                A[b][1] = bf16x2_mul(e2m1x2_bf16<0>(x1[b]), f1);
                A[b][2] = bf16x2_mul(e2m1x2_bf16<1>(x0[b]), f0);
                A[b][3] = bf16x2_mul(e2m1x2_bf16<1>(x1[b]), f1);
                A[b][4] = bf16x2_mul(e2m1x2_bf16<2>(x0[b]), f0);
                A[b][5] = bf16x2_mul(e2m1x2_bf16<2>(x1[b]), f1);
                A[b][6] = bf16x2_mul(e2m1x2_bf16<3>(x0[b]), f0);
                A[b][7] = bf16x2_mul(e2m1x2_bf16<3>(x1[b]), f1);
#pragma unroll
                for (int i = 0; i < 8; ++i) asm volatile("" : "+r"(A[b][i])::"memory");
            }
            // Every input register of the stage's products is defined before the fence and the
            // group is waited for before the next stage's conversion: ptxas serializes wgmma whose
            // register inputs are written while an accumulation chain is in flight (C7513). The
            // other consumer warpgroup's products run under this one's conversion.
            wg_fence_regs<8 * NV>(acc);
            wg_fence();
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const uint32_t bt = st + SM_B + (b >> 1) * kAtom + (b & 1) * 64;  // k32 step b: 32 inputs = 64 bytes
                wg_rs_bf16<NV>(acc, A[b], wg_desc(bt, 16, 1024));
                wg_rs_bf16<NV>(acc, A[b] + 4, wg_desc(bt + 32, 16, 1024));
            }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs<8 * NV>(acc);
            release(c, s);
            if (++s == kStages) {
                s = 0;
                ph ^= 1;
            }
        }
    } else {
        // The exact path: f32 weights, fmaf over the stage's inputs in their original order.
        for (int kt = 0; kt < a.nk; ++kt) {
            mbar_wait(c.full + 8 * s, ph);
            const unsigned char* sp = c.smem + s * kStageBytes;
            const int on = min(BK, a.k - kt * BK);
            for (int o = 0; o < on; ++o) {
                const uint32_t b0 = sp[SM_C + r0 - 16 * c.t + (o >> 1)], b1 = sp[SM_C + r1 - 16 * c.t + (o >> 1)];
                const float v0 = e2m1_f32(o & 1 ? b0 >> 4 : b0 & 15u) * fp8::e8m0_f32(sp[SM_S + 4 * c.mrow + (o >> 5)]);
                const float v1 = e2m1_f32(o & 1 ? b1 >> 4 : b1 & 15u) * fp8::e8m0_f32(sp[SM_S + 4 * (c.mrow + 8) + (o >> 5)]);
                const int pos = stage_pos(o), ch = (pos & 63) >> 3;
                const unsigned char* at = sp + SM_B + (pos >> 6) * kAtom + 2 * (pos & 7);
#pragma unroll
                for (int i = 0; i < 2 * NV; ++i) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int col = 8 * i + 2 * c.t + h;  // col & 7 = 2t + h
                        const float x = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(at + col * 128 + ((ch ^ (2 * c.t + h)) << 4)));
                        acc[4 * i + h] = fmaf(x, v0, acc[4 * i + h]);
                        acc[4 * i + 2 + h] = fmaf(x, v1, acc[4 * i + 2 + h]);
                    }
                }
            }
            release(c, s);
            if (++s == kStages) {
                s = 0;
                ph ^= 1;
            }
        }
    }

    // Epilogue: acc[4i + c] is tile row mrow + 8 (c / 2), slot column 8i + 2t + c % 2.
    if (MODE == DSV41_MOE_GATE_UP) {
        const int orow = 64 * u.rt + 8 * c.warp + c.g;
        if (orow < a.n) {
#pragma unroll
            for (int i = 0; i < 2 * NV; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int col = 8 * i + 2 * c.t + h;
                    if (col < u.cnt) {
                        const int64_t p = u.base + col;
                        const float av = __bfloat162float(__float2bfloat16_rn(acc[4 * i + h]));
                        const float uv = __bfloat162float(__float2bfloat16_rn(acc[4 * i + 2 + h]));
                        a.out[p * a.n + orow] = __float2bfloat16_rn(swiglu(av, uv, __ldg(a.rw_sorted + p), a.limit));
                    }
                }
            }
        }
    } else {
        const int o0 = BM * u.rt + c.mrow, o1 = o0 + 8;
#pragma unroll
        for (int i = 0; i < 2 * NV; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int col = 8 * i + 2 * c.t + h;
                if (col < u.cnt) {
                    const int64_t p = u.base + col;
                    if (o0 < a.n) a.out[p * a.n + o0] = __float2bfloat16_rn(acc[4 * i + h]);
                    if (o1 < a.n) a.out[p * a.n + o1] = __float2bfloat16_rn(acc[4 * i + 2 + h]);
                }
            }
        }
    }
}

template <int MODE>
__global__ void __launch_bounds__(kThreads, 1) moe_gemm_kernel(const Args a) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t sbase = (raw + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (sbase - raw);
    const Smem L = smem_layout(a.e);
    int* off = reinterpret_cast<int*>(smem + L.off);
    int* item = reinterpret_cast<int*>(smem + L.item);
    const uint32_t full = sbase + L.bar, empty = full + 8 * kStages;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full + 8 * s, 2 * kProd);          // per producer thread: its cp.async arrival and a plain one
            mbar_init(empty + 8 * s, kConsumerWarps);    // one arrival per consumer warp
        }
    }
    grid_dep_wait();  // the routing's counts, the prep's panel and sorted rows

    // Warp 0: exclusive scans of the slots and items per expert (a lane per run of experts).
    if (warp == 0) {
        const int per = (a.e + 31) >> 5, e0 = lane * per;
        int sc = 0, si = 0;
        for (int i = 0; i < per; ++i) {
            if (e0 + i >= a.e) break;
            const int cnt = static_cast<int>(__ldg(a.counts + e0 + i));
            sc += cnt;
            si += items_of(cnt, a.n_rt);
        }
        int ic = sc, ii = si;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int vc = __shfl_up_sync(0xffffffffu, ic, d), vi = __shfl_up_sync(0xffffffffu, ii, d);
            if (lane >= d) {
                ic += vc;
                ii += vi;
            }
        }
        int rc = ic - sc, ri = ii - si;
        for (int i = 0; i < per; ++i) {
            const int e = e0 + i;
            if (e >= a.e) break;
            const int cnt = static_cast<int>(__ldg(a.counts + e));
            off[e] = rc;
            item[e] = ri;
            rc += cnt;
            ri += items_of(cnt, a.n_rt);
        }
        if (lane == 31) {
            off[a.e] = ic;
            item[a.e] = ii;
        }
    }
    __syncthreads();

    const int n_items = item[a.e];
    if (static_cast<int>(blockIdx.x) >= n_items) return;

    if (warp >= kConsumerWarps) {
        // Producer: thread p copies chunks p % 8 and 8 + p % 8 of tile rows p / 8 + 16 i of the
        // panel tile (a row's 8 chunks of an atom by 8 consecutive lanes), code chunk p % 4 of
        // weight rows p / 4 + 32 i, and the 4 scale bytes of weight row p.
        const int p = tid - kConsumerWarps * 32, cc = p & 7, c4 = p & 3;
        const bool scale_vec = (a.kb & 3) == 0;
        int s = 0;
        uint32_t ph = 0;
        for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
            const Item u = decode(it, off, item, a.e, a.n_rt);
            const int nfill = round16(u.cnt);
            int src[8];  // panel row; -1: zero fill (slot columns up to N); -2: not read
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int q = (p >> 3) + 16 * i;
                src[i] = q < u.cnt ? (MODE == DSV41_MOE_GATE_UP ? static_cast<int>(__ldg(a.tok_sorted + u.base + q)) : u.base + q)
                                   : (q < nfill ? -1 : -2);
            }
            const uint64_t* te = a.experts + 4 * u.e;
            const uint8_t* crow[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) crow[i] = weight_row<MODE>(te, u.rt, (p >> 2) + 32 * i, a).codes;
            const uint8_t* srow = weight_row<MODE>(te, u.rt, p, a).scales;
            for (int kt = 0; kt < a.nk; ++kt) {
                mbar_wait(empty + 8 * s, ph ^ 1);  // the first pass waits on the phase before init: returns at once
                const uint32_t st = sbase + s * kStageBytes;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    if (src[i] < -1) continue;
                    const int q = (p >> 3) + 16 * i;
                    const bool ok = src[i] >= 0;
                    const __nv_bfloat16* row = a.panel + static_cast<int64_t>(ok ? src[i] : 0) * a.kp + kt * BK + 8 * cc;
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        cp_async16_l2(st + SM_B + h * kAtom + q * 128 + ((cc ^ (q & 7)) << 4), row + 64 * h, ok);
                }
                const bool kin = kt * 4 + c4 < a.kb;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const bool ok = crow[i] != nullptr && kin;
                    const void* src_c = ok ? static_cast<const void*>(crow[i] + kt * 64 + 16 * c4) : static_cast<const void*>(a.panel);
                    cp_async16_l2(st + SM_C + ((p >> 2) + 32 * i) * 64 + 16 * c4, src_c, ok);
                }
                if (scale_vec) {
                    const bool ok = srow != nullptr;
                    cp_async4(st + SM_S + 4 * p, ok ? static_cast<const void*>(srow + 4 * kt) : static_cast<const void*>(a.panel), ok);
                } else {
                    // K / 32 not a multiple of 4 (small test models): byte loads; blocks past K get a
                    // finite scale (their codes are zero-filled).
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int blk = 4 * kt + j;
                        st_shared_u8(st + SM_S + 4 * p + j, srow != nullptr && blk < a.kb ? __ldg(srow + blk) : 127u);
                    }
                }
                cp_async_mbar_arrive(full + 8 * s);
                mbar_arrive(full + 8 * s);  // release: the byte stores above
                if (++s == kStages) {
                    s = 0;
                    ph ^= 1;
                }
            }
        }
        cp_async_wait_all();
        return;
    }

    Consumer c;
    c.sbase = sbase;
    c.full = full;
    c.empty = empty;
    c.smem = smem;
    c.warp = __shfl_sync(0xffffffffu, warp, 0);
    c.lane = lane;
    c.g = lane >> 2;
    c.t = lane & 3;
    c.mrow = 16 * c.warp + c.g;  // = 64 wg + 16 (warp % 4) + g
    const uint32_t flag = MODE == DSV41_MOE_GATE_UP ? DSV41_MOE_GEMM_FLAG_GATE_UP : DSV41_MOE_GEMM_FLAG_DOWN;
    int s = 0;
    uint32_t ph = 0;
    for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
        const Item u = decode(it, off, item, a.e, a.n_rt);
        const bool exact = (__ldg(a.flags + u.e) & flag) != 0;
        switch ((u.cnt + 15) >> 4) {
            case 1: run_item<MODE, 1>(a, u, exact, c, s, ph); break;
            case 2: run_item<MODE, 2>(a, u, exact, c, s, ph); break;
            case 3: run_item<MODE, 3>(a, u, exact, c, s, ph); break;
            case 4: run_item<MODE, 4>(a, u, exact, c, s, ph); break;
            case 5: run_item<MODE, 5>(a, u, exact, c, s, ph); break;
            case 6: run_item<MODE, 6>(a, u, exact, c, s, ph); break;
            case 7: run_item<MODE, 7>(a, u, exact, c, s, ph); break;
            default: run_item<MODE, 8>(a, u, exact, c, s, ph); break;
        }
    }
}

// One warp per (panel row, 32-input block of kp): Q1 of the block (spec §0.1b.8) as bf16 values
// (e4m3 value x 2^s: exact), stored at stage_pos; blocks past K are zeros. GATE_UP also writes, for
// each slot position p, its token row, its routing weight and pos[order[p]] = p.
__global__ void __launch_bounds__(kPrepThreads) moe_gemm_prep_kernel(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ panel,
                                                                      int64_t rows, int k, int kb, int kp, const uint32_t* __restrict__ order,
                                                                      const float* __restrict__ route_w, uint32_t* __restrict__ tok_sorted,
                                                                      float* __restrict__ rw_sorted, uint32_t* __restrict__ pos, int64_t slots,
                                                                      int topk) {
    grid_dep_wait();
    grid_dep_launch();
    const int64_t gid = static_cast<int64_t>(blockIdx.x) * kPrepThreads + threadIdx.x;
    if (order) dsv41_experts::sort_slots<kPrepThreads>(gid, order, route_w, tok_sorted, rw_sorted, pos, slots, topk);
    const int kbp = kp / 32;
    const int64_t gw = gid >> 5;
    const int lane = threadIdx.x & 31;
    if (gw >= rows * kbp) return;  // whole warps leave together
    const int64_t row = gw / kbp;
    const int blk = static_cast<int>(gw % kbp);
    float q = 0.0f;
    if (blk < kb) {  // warp-uniform
        const float v = __bfloat162float(x[row * k + blk * 32 + lane]);
        using Q1 = QuantTraits<Quant::Fp8Ue8m0B32>;
        float amax = fabsf(v);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const BlockScale bs = Q1::scale(amax);
        q = __fmul_rn(Q1::round(Q1::quotient(v, bs)), bs.s);
    }
    panel[row * kp + (blk >> 2) * BK + stage_pos((blk & 3) * 32 + lane)] = __float2bfloat16_rn(q);
}

// Grid (E x 3 projections, y chunks): the flag of a projection with a block the bf16 path does not
// multiply exactly (scale byte 255, or a nonzero code under a byte outside [kFastLo, kFastHi]).
__global__ void __launch_bounds__(256) moe_gemm_flags_kernel(const Dsv41MoeGemmFlagsParams p) {
    const int e = blockIdx.x / 3, w = blockIdx.x % 3;
    const uint64_t* te = w < 2 ? p.gate_up + 4 * e + 2 * w : p.down + 4 * e;
    const int rows = w < 2 ? p.inter : p.hidden, kdim = w < 2 ? p.hidden : p.inter, kb = kdim / 32;
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(te[0]);
    const uint8_t* scales = reinterpret_cast<const uint8_t*>(te[1]);
    bool bad = false;
    const int64_t blocks = static_cast<int64_t>(rows) * kb;
    for (int64_t i = static_cast<int64_t>(blockIdx.y) * 256 + threadIdx.x; i < blocks; i += static_cast<int64_t>(gridDim.y) * 256) {
        const uint32_t sb = scales[i];
        if (sb == 255u) {
            bad = true;
        } else if (sb < kFastLo || sb > kFastHi) {
            const uint4 cw = *reinterpret_cast<const uint4*>(codes + (i / kb) * (kdim / 2) + (i % kb) * 16);
            bad |= ((cw.x | cw.y | cw.z | cw.w) & 0x77777777u) != 0;
        }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(p.flags + e, w < 2 ? DSV41_MOE_GEMM_FLAG_GATE_UP : DSV41_MOE_GEMM_FLAG_DOWN);
}

struct Plan {
    int kb, kp, nk, n_rt;
    int64_t rows, slots, panel_off, tok_off, rw_off, bytes;
};

using dsv41_launch::align256;

// Weight-row tiles of an item: GATE_UP the same 64 rows of w1 and w3, DOWN 128 rows of w2.
inline int64_t row_tiles(const Dsv41MoeExpertsParams* p) { return p->mode == DSV41_MOE_GATE_UP ? (p->n + 63) / 64 : (p->n + BM - 1) / BM; }

inline int validate(const Dsv41MoeExpertsParams* p, size_t params_size) {
    const int v = dsv41_experts::validate_common(p, params_size);
    if (v != DSV41_OK) return v;
    if (p->kdim > (1 << 24)) return DSV41_ERR_SHAPE;
    // Items (slot tiles x row tiles) and output rows are numbered in 32 bits.
    if ((p->num_tokens * p->k / BN + p->num_experts) * row_tiles(p) >= (int64_t{1} << 31) || p->n > (1 << 30)) return DSV41_ERR_SHAPE;
    return DSV41_OK;
}

// Scratch: the panel [rows, kp] bf16, then the sorted slots.
inline Plan make_plan(const Dsv41MoeExpertsParams* p) {
    Plan q;
    q.slots = p->num_tokens * p->k;
    q.kb = p->kdim / 32;
    q.kp = (p->kdim + BK - 1) / BK * BK;
    q.nk = q.kp / BK;
    q.n_rt = static_cast<int>(row_tiles(p));
    q.rows = dsv41_experts::panel_rows(p);
    q.panel_off = 0;
    const dsv41_experts::SlotScratch sorted = dsv41_experts::slot_scratch(p, align256(q.rows * q.kp * 2));
    q.tok_off = sorted.tok_off;
    q.rw_off = sorted.rw_off;
    q.bytes = sorted.bytes;
    return q;
}

template <int MODE>
cudaError_t launch_gemm(const Args& a, cudaStream_t st) {
    return dsv41_launch::launch_persistent<moe_gemm_kernel<MODE>>(dim3(kThreads), smem_layout(a.e).bytes, kMaxSmem, st, a);
}

}  // namespace moe_g
}  // namespace dsv41

extern "C" int dsv41_moe_gemm_scratch_bytes(const Dsv41MoeExpertsParams* p, size_t params_size, int64_t* bytes) {
    using namespace dsv41::moe_g;
    const int v = validate(p, params_size);
    if (v != DSV41_OK) return v;
    if (!bytes) return DSV41_ERR_NULL;
    *bytes = make_plan(p).bytes;
    return DSV41_OK;
}

extern "C" int dsv41_moe_gemm(const Dsv41MoeExpertsParams* p, size_t params_size, const uint32_t* flags, void* stream) {
    using namespace dsv41::moe_g;
    const int v = validate(p, params_size);
    if (v != DSV41_OK) return v;
    if (p->num_tokens == 0) return DSV41_OK;
    if (!flags) return DSV41_ERR_NULL;
    const Plan q = make_plan(p);
    const int b = dsv41_experts::check_buffers(p, q.bytes);
    if (b != DSV41_OK) return b;
    const bool gu = p->mode == DSV41_MOE_GATE_UP;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    char* base = static_cast<char*>(p->scratch);
    auto* panel = reinterpret_cast<__nv_bfloat16*>(base + q.panel_off);
    auto* tok_sorted = reinterpret_cast<uint32_t*>(base + q.tok_off);
    auto* rw_sorted = reinterpret_cast<float*>(base + q.rw_off);

    const int64_t prep_blocks = dsv41_experts::prep_blocks(q.rows, q.kp / 32, q.slots, kPrepThreads);
    if (prep_blocks < 0) return DSV41_ERR_SHAPE;
    cudaError_t e = dsv41_launch::launch_pdl(moe_gemm_prep_kernel, dim3(static_cast<unsigned>(prep_blocks)), dim3(kPrepThreads), 0, st, 1,
                                             static_cast<const __nv_bfloat16*>(p->x), panel, q.rows, p->kdim, q.kb, q.kp,
                                             gu ? p->order : nullptr, p->route_w, tok_sorted, rw_sorted, gu ? p->pos : nullptr, q.slots, p->k);
    if (e != cudaSuccess) return static_cast<int>(e);

    Args a;
    dsv41_experts::set_common_args(a, p, tok_sorted, rw_sorted);
    a.flags = flags;
    a.panel = panel;
    a.kp = q.kp;
    a.nk = q.nk;
    a.n_rt = q.n_rt;
    e = gu ? launch_gemm<DSV41_MOE_GATE_UP>(a, st) : launch_gemm<DSV41_MOE_DOWN>(a, st);
    return static_cast<int>(e);
}

extern "C" int dsv41_moe_gemm_flags(const Dsv41MoeGemmFlagsParams* p, size_t params_size, void* stream) {
    using namespace dsv41::moe_g;
    if (params_size != sizeof(Dsv41MoeGemmFlagsParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_experts < 1 || p->num_experts > DSV41_MOE_EXPERTS_MAX_E || p->hidden < 32 || p->inter < 32 || p->hidden % 32 != 0 ||
        p->inter % 32 != 0)
        return DSV41_ERR_SHAPE;
    if (!p->gate_up || !p->down || !p->flags) return DSV41_ERR_NULL;
    const int64_t blocks = static_cast<int64_t>(p->hidden) * (p->inter / 32) > static_cast<int64_t>(p->inter) * (p->hidden / 32)
                               ? static_cast<int64_t>(p->hidden) * (p->inter / 32)
                               : static_cast<int64_t>(p->inter) * (p->hidden / 32);
    const int64_t chunks = (blocks + 256 * 64 - 1) / (256 * 64);  // ~64 blocks per thread
    const dim3 grid(static_cast<unsigned>(3 * p->num_experts), static_cast<unsigned>(chunks < 65535 ? chunks : 65535));
    dsv41::moe_g::moe_gemm_flags_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(*p);
    return static_cast<int>(cudaGetLastError());
}
