// Device pieces shared by the FP8 linear's weight-streaming kernels (spec §2.4-§2.5, issue 21):
// kernels/fp8_linear.cu (the launcher, the prep kernel, the REGISTERS and PIPELINE variants; its
// header comment holds the design and the numerics), kernels/fp8_linear_warp.cu (the WARP
// variant): the code conversion, the mma, the weight loads, the kernels' arguments and the
// per-k32-block product with the block scales applied in f32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>
#include <stdint.h>

#include "dsv41_fp8.cuh"
#include "dsv41_fp8_linear.h"
#include "dsv41_numerics.cuh"

namespace dsv41 {
namespace fp8 {

// Two e4m3 codes -> bf16x2 (through f16 and f32, all exact).
__device__ __forceinline__ uint32_t e4m3x2_bf16x2(uint16_t h) {
    const uint32_t f = e4m3x2_f16x2(h);
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&f));
    const __nv_bfloat162 b = __floats2bfloat162_rn(v.x, v.y);
    return *reinterpret_cast<const uint32_t*>(&b);
}

template <bool ACTQ>
__device__ __forceinline__ uint32_t cvt_codes(uint16_t h) {
    if constexpr (ACTQ) return e4m3x2_f16x2(h);
    else return e4m3x2_bf16x2(h);
}

// d = a * b (+ c) for m16n8k16, f16 (ACTQ) or bf16 inputs, f32 accumulators.
template <bool ACTQ>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, const float (&c)[4]) {
    if constexpr (ACTQ) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    }
}

__device__ __forceinline__ uint64_t evict_first_policy() {
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

// 8 weight bytes at row[k0..k0+8) (zeros past k or for an invalid row). VEC: one 8-byte load
// (row and k0 8-byte aligned, k a multiple of 8); else byte loads.
template <bool VEC>
__device__ __forceinline__ uint2 load_w8(const uint8_t* row, int k0, int k, bool row_ok, uint64_t pol) {
    uint2 v = make_uint2(0u, 0u);
    if constexpr (VEC) {
        if (row_ok && k0 < k) {
            asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v2.u32 {%0,%1}, [%2], %3;"
                         : "=r"(v.x), "=r"(v.y)
                         : "l"(row + k0), "l"(pol));
        }
    } else {
        if (row_ok) {
#pragma unroll
            for (int b = 0; b < 8; ++b) {
                const uint32_t byte = k0 + b < k ? static_cast<uint32_t>(__ldg(row + k0 + b)) : 0u;
                if (b < 4) v.x |= byte << (8 * b);
                else v.y |= byte << (8 * (b - 4));
            }
        }
    }
    return v;
}

// What the stream kernels read (pointers into the caller's buffers and the scratch).
struct StreamArgs {
    const __nv_bfloat16* x;  // [m, k] (the fused activation of REGISTERS reads it)
    const uint8_t* codes;
    const uint8_t* scales;
    __nv_bfloat16* out;     // [m, n1] (features 0 .. n1)
    __nv_bfloat16* out2;    // [m, n - n1] (features n1 .. n); unused when n1 == n
    const uint16_t* panel;  // [mpad, kpad]
    const float* ascale;    // [kb, mpad] (ACTQ)
    float* ws;              // split-K / stream-K partials (the kernel's layout)
    unsigned* ctr;          // arrival counters: zero before the call, zero after it (the last arrival resets its own)
    int m, n, k, kb, kpad, mpad, mc, splits;
    int parts, prow;        // WARP: CTAs per split, bytes per panel row in shared memory
    int n1;                 // features of out: n, or Dsv41Fp8LinearParams::n_first (a multiple of 32)
};

// The output holding the features of one 32-row block (n1 is a multiple of 32): element (tok,
// feature r) of the block is o[tok * width + r - first]. Computed once per block, so the stores
// cost what they did with one output.
struct OutBlock {
    __nv_bfloat16* o;
    int width, first;
    __device__ __forceinline__ __nv_bfloat16* at(int tok, int r) const { return o + static_cast<int64_t>(tok) * width + (r - first); }
};
__device__ __forceinline__ OutBlock out_block(const StreamArgs& a, int row) {
    return row < a.n1 ? OutBlock{a.out, a.n1, 0} : OutBlock{a.out2, a.n - a.n1, a.n1};
}

// The A fragments of one k32 block of the warp's 16 MT rows: w[i] = the lane's 8 code bytes of
// row g + 8i (k offsets 8t..8t+7 of the block), converted exactly; [m tile][k16 step][reg],
// a0/a2 = row g (+16), a1/a3 = row g + 8 (+16).
template <bool ACTQ, int MT>
__device__ __forceinline__ void weight_frags(uint32_t (&af)[MT][2][4], const uint2 (&w)[2 * MT]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const uint32_t lo = j == 0 ? w[2 * mt].x : w[2 * mt].y;
            const uint32_t hi = j == 0 ? w[2 * mt + 1].x : w[2 * mt + 1].y;
            af[mt][j][0] = cvt_codes<ACTQ>(static_cast<uint16_t>(lo & 0xffffu));
            af[mt][j][2] = cvt_codes<ACTQ>(static_cast<uint16_t>(lo >> 16));
            af[mt][j][1] = cvt_codes<ACTQ>(static_cast<uint16_t>(hi & 0xffffu));
            af[mt][j][3] = cvt_codes<ACTQ>(static_cast<uint16_t>(hi >> 16));
        }
}

// The scale product 2^(sa + sw) of one token and block; >= 2^128 is clamped so that an all-zero
// block contributes 0, not NaN.
__device__ __forceinline__ float scale_product(float sa, float sw) {
    const float s = sa * sw;
    return isinf(s) ? FLT_MAX : s;
}

// The products of G n8 token tiles n0.. of one k32 block: b[u] = the lane's 16 panel bytes of
// tile n0 + u (token 8 (n0 + u) + g, k offsets 8t..8t+7), s0 / s1[u] = the scale products of its
// tokens 2t and 2t + 1. 2G independent first-half products, then the second halves, then the
// scaled sums (no product waits on the one just issued).
template <int G, bool ACTQ, int MT, int NT>
__device__ __forceinline__ void group_products(float (&acc)[MT][NT][4], const uint32_t (&af)[MT][2][4], int n0, const uint4 (&b)[G],
                                               const float (&s0)[G], const float (&s1)[G]) {
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float p[MT][G][4];
#pragma unroll
    for (int u = 0; u < G; ++u)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma16816<ACTQ>(p[mt][u], af[mt][0], b[u].x, b[u].y, zero);
#pragma unroll
    for (int u = 0; u < G; ++u)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma16816<ACTQ>(p[mt][u], af[mt][1], b[u].z, b[u].w, p[mt][u]);
#pragma unroll
    for (int u = 0; u < G; ++u)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float* c = acc[mt][n0 + u];
            c[0] = fmaf(p[mt][u][0], s0[u], c[0]);
            c[1] = fmaf(p[mt][u][1], s1[u], c[1]);
            c[2] = fmaf(p[mt][u][2], s0[u], c[2]);
            c[3] = fmaf(p[mt][u][3], s1[u], c[3]);
        }
}

// One k32 block of the warp's 16 MT rows (MT m16 tiles: 2 for the 32-row blocks of REGISTERS and
// PIPELINE, 1 for the 16-row units of WARP): w[i] = the lane's 8 code bytes of row g + 8i (k
// offsets 8t..8t+7 of the block), sw = the block's weight scale. acc += (codes · panel) · 2^(sa + sw).
// pb: the lane's 16 panel bytes of the block for token tok0 + g (global or shared memory),
// pstride: uint4s from one n8 token tile to the next; sap (ACTQ): the block's activation scales
// from token tok0 on (global or shared memory).
template <int NT, bool ACTQ, int MT>
__device__ __forceinline__ void block_step(float (&acc)[MT][NT][4], const uint2 (&w)[2 * MT], float sw, int t, const uint4* pb, int pstride,
                                           const float* sap) {
    constexpr int G = NT < 4 ? NT : 4;  // n8 tiles per group of independent products
    uint32_t af[MT][2][4];
    weight_frags<ACTQ, MT>(af, w);
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += G) {
        uint4 b[G];
        float s0[G], s1[G];
#pragma unroll
        for (int u = 0; u < G; ++u) {
            b[u] = pb[(n0 + u) * pstride];
            s0[u] = sw;
            s1[u] = sw;
            if constexpr (ACTQ) {
                const float2 sa = *reinterpret_cast<const float2*>(sap + 8 * (n0 + u) + 2 * t);
                s0[u] = scale_product(sa.x, sw);
                s1[u] = scale_product(sa.y, sw);
            }
        }
        group_products<G, ACTQ>(acc, af, n0, b, s0, s1);
    }
}

// The fused activation of one k32 block (no prep kernel, no panel): what the prep kernel would
// have written for this lane - the 16 panel bytes of token tok = 8 u + g of the chunk (k offsets
// 8t..8t+7 of block kb: Q1's e4m3 values as f16 with ACTQ, else the bf16 x) - computed from x in
// registers, and the scale products of the tile's tokens 2t and 2t + 1. Q1's block scale is the
// amax of the token's 32 values, which the lane quad g holds (two xor shuffles); a token's scale
// then comes from its quad's lane 0. Every lane of the warp must call it (shuffles). x rows are
// 16-byte aligned (k % 8 == 0, x 16-byte aligned); tokens >= m and columns >= k read as zeros (tokens
// >= m with scale 0), as the prep kernel pads them.
template <bool ACTQ>
__device__ __forceinline__ void fused_activation(const __nv_bfloat16* __restrict__ x, int m, int k, int tok, int kb, int t, float sw, uint4& b,
                                                 float& s0, float& s1) {
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    const int k0 = kb * 32 + 8 * t;  // k % 8 == 0: a group of 8 lies wholly inside or past k (padding zeros)
    if (tok < m && k0 < k) raw = __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(tok) * k + k0));
    if constexpr (!ACTQ) {
        b = raw;
        s0 = sw;
        s1 = sw;
    } else {
        using Q1 = QuantTraits<Quant::Fp8Ue8m0B32>;
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        float v[8];
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
            v[2 * i] = f.x;
            v[2 * i + 1] = f.y;
            amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const BlockScale bs = Q1::scale(amax);
        uint32_t out[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const __half2 h = __halves2half2(__float2half_rn(Q1::round(Q1::quotient(v[2 * i], bs))),
                                             __float2half_rn(Q1::round(Q1::quotient(v[2 * i + 1], bs))));
            out[i] = *reinterpret_cast<const uint32_t*>(&h);
        }
        b = make_uint4(out[0], out[1], out[2], out[3]);
        const float mine = tok < m ? bs.s : 0.0f;
        // Token 2t's quad is lanes 8t..8t+3, token 2t + 1's 8t+4..8t+7.
        s0 = scale_product(__shfl_sync(0xffffffffu, mine, 8 * t), sw);
        s1 = scale_product(__shfl_sync(0xffffffffu, mine, 8 * t + 4), sw);
    }
}

// block_step with the activation fused (fused_activation per n8 tile) instead of read from a
// panel: tok0 = the chunk's first token.
template <int NT, bool ACTQ, int MT>
__device__ __forceinline__ void block_step_fused(float (&acc)[MT][NT][4], const uint2 (&w)[2 * MT], float sw, int g, int t,
                                                 const __nv_bfloat16* __restrict__ x, int m, int k, int tok0, int kb) {
    constexpr int G = NT < 4 ? NT : 4;
    uint32_t af[MT][2][4];
    weight_frags<ACTQ, MT>(af, w);
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += G) {
        uint4 b[G];
        float s0[G], s1[G];
#pragma unroll
        for (int u = 0; u < G; ++u) fused_activation<ACTQ>(x, m, k, tok0 + 8 * (n0 + u) + g, kb, t, sw, b[u], s0[u], s1[u]);
        group_products<G, ACTQ>(acc, af, n0, b, s0, s1);
    }
}

// ------------------------------------------------------------------------------ stream-K pieces
// The stream-K variant (PIPELINE in kernels/fp8_linear.cu; the design is fp8_streamk_kernel's
// comment): units of 128 rows x 128 bytes of K (4 row blocks of 32 rows, one per warp, x 4 k32
// blocks), each CTA an equal contiguous run of them.
constexpr int kStepBlocks = 4;  // k32 blocks per unit (128 bytes of each row)
constexpr int kSrow = 144;      // bytes per staged row (128 + 16: conflict-free 8-byte reads)
constexpr int kWarpStage = 32 * kSrow;
constexpr int kPst = 320;       // bytes per staged panel row (256 + 64: conflict-free 16-byte reads)
constexpr int kMinUnits = 3;    // units per CTA at least (fewer contributors per row group)

// Stage layout: weights [4][32][kSrow] | panel [TOK][kPst] | act scales [4][TOK] f32 | weight scales [4][4] u8.
template <int NT>
__host__ __device__ constexpr int streamk_stage_bytes() { return 4 * kWarpStage + 8 * NT * kPst + 4 * 8 * NT * 4 + 16; }

// The first unit of CTA c's range [c U / C, (c+1) U / C), and the CTA whose range holds unit u.
__device__ __forceinline__ int64_t unit_begin(int c, int64_t units, int ctas) { return static_cast<int64_t>(c) * units / ctas; }
__device__ __forceinline__ int cta_of(int64_t u, int64_t units, int ctas) { return static_cast<int>(((u + 1) * ctas - 1) / units); }

// Stores the warp's 32 rows x 8 NT tokens from acc-shaped registers (bf16, bounds-checked).
template <int NT>
__device__ __forceinline__ void store_rows(const StreamArgs& a, const float (&acc)[2][NT][4], int row0, int tok0, int g, int t) {
    const OutBlock ob = out_block(a, row0);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row0 + 16 * mt + g + (e >= 2 ? 8 : 0), tok = tok0 + 8 * nt + 2 * t + (e & 1);
                if (r < a.n && tok < a.m) *ob.at(tok, r) = __float2bfloat16_rn(acc[mt][nt][e]);
            }
}

// acc = 0 (the next row group's sums).
template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[2][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
}

// Where CTA c's range leaves the row group grp (of chunk x 128 rows) after its last unit there:
// the warp's sums acc are the whole group's (the group lies in the range) and are stored, or the
// CTA's partial goes to one of its two slots in a.ws (registers as they are: [warp][register]
// [lane]) and the last of the group's contributors to arrive (a counter per group, left zero)
// adds the partials in CTA order and stores: deterministic. Every thread of the CTA calls it
// (two CTA barriers); is_last: a shared int.
template <int NT>
__device__ __forceinline__ void streamk_leave_group(float (&acc)[2][NT][4], const StreamArgs& a, int* is_last, int64_t grp, int64_t u0,
                                                    int64_t units, int c, int ctas, int warp, int lane, int g, int t, int row0, int tok0) {
    constexpr int R = 2 * NT * 4;
    const int sk = a.kb / kStepBlocks;
    const int64_t g_first = grp * sk, g_last = g_first + sk - 1;
    const int c_first = cta_of(g_first, units, ctas), c_last = cta_of(g_last, units, ctas);
    if (c_first == c_last) {
        store_rows<NT>(a, acc, row0, tok0, g, t);
        return;
    }
    const int slot = 2 * c + (g_first <= u0 ? 0 : 1);  // 2c: the range's first group
    float* mine = a.ws + (static_cast<int64_t>(slot) * 4 + warp) * R * 32 + lane;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) mine[((mt * NT + nt) * 4 + e) * 32] = acc[mt][nt][e];
    __threadfence();
    __syncthreads();
    if (warp == 0 && lane == 0) *is_last = atomicAdd(a.ctr + grp, 1u) == static_cast<unsigned>(c_last - c_first);
    __syncthreads();
    if (!*is_last) return;
    __threadfence();
    // The partials in CTA order, B contributors' loads in flight at a time.
    constexpr int B = R >= 64 ? 1 : 64 / R;
    float sum[R];
#pragma unroll
    for (int j = 0; j < R; ++j) sum[j] = 0.0f;
    for (int c0 = c_first; c0 <= c_last; c0 += B) {
        float v[B][R];
#pragma unroll
        for (int q = 0; q < B; ++q) {
            const int cc = c0 + q;
            if (cc > c_last) break;
            const int slot_cc = 2 * cc + (g_first <= unit_begin(cc, units, ctas) ? 0 : 1);
            const float* p = a.ws + (static_cast<int64_t>(slot_cc) * 4 + warp) * R * 32 + lane;
#pragma unroll
            for (int j = 0; j < R; ++j) v[q][j] = __ldcg(p + j * 32);
        }
#pragma unroll
        for (int q = 0; q < B; ++q) {
            if (c0 + q > c_last) break;
#pragma unroll
            for (int j = 0; j < R; ++j) sum[j] += v[q][j];
        }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = sum[(mt * NT + nt) * 4 + e];
    store_rows<NT>(a, acc, row0, tok0, g, t);
}

// The products of one unit staged in shared memory (stage: its layout above) for the warp's
// row block: 4 k32 blocks into acc.
template <int NT, bool ACTQ>
__device__ __forceinline__ void streamk_stage_products(float (&acc)[2][NT][4], const uint8_t* stage, int warp, int g, int t) {
    constexpr int TOK = 8 * NT, kPanelOff = 4 * kWarpStage, kAsOff = kPanelOff + TOK * kPst, kWsOff = kAsOff + 4 * TOK * 4;
    const uint8_t* wst = stage + warp * kWarpStage;
    const uint32_t wsc = *reinterpret_cast<const uint32_t*>(stage + kWsOff + 4 * warp);
#pragma unroll
    for (int ub = 0; ub < kStepBlocks; ++ub) {
        uint2 w[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) w[r] = *reinterpret_cast<const uint2*>(wst + (g + 8 * r) * kSrow + 32 * ub + 8 * t);
        const uint4* pb = reinterpret_cast<const uint4*>(stage + kPanelOff + g * kPst + 64 * ub + 16 * t);
        const float* sap = reinterpret_cast<const float*>(stage + kAsOff) + ub * TOK;
        block_step<NT, ACTQ>(acc, w, e8m0_f32((wsc >> (8 * ub)) & 0xffu), t, pb, 8 * kPst / 16, sap);
    }
}

// The WARP variant (kernels/fp8_linear_warp.cu; m <= kWarpMaxM, one token chunk): its launch
// shape and shared memory, chosen by warp_plan from the shape alone (scratch_bytes and the launch
// see the same plan).
constexpr int kWarpMaxM = DSV41_FP8_WARP_MAX_M;
struct WarpPlan {
    int splits;  // K splits (whole 4-block groups each)
    int parts;   // CTAs per split (each an equal contiguous run of 16-row units)
    int prow;    // bytes per panel row in shared memory
    int smem;    // dynamic shared memory bytes
};
// tok: the token tile (8 NT); splits: the caller's factor (0 = choose).
WarpPlan warp_plan(int n, int kb, int tok, bool act_quant, int splits);
// Launches the WARP kernel for a.m <= kWarpMaxM (nt = 1, 2, 4 or 8 n8 tiles; vec8: k % 8 == 0
// and the codes 8-byte aligned).
cudaError_t launch_warp(const StreamArgs& a, const WarpPlan& w, int nt, bool act_quant, bool vec8, cudaStream_t st);

}  // namespace fp8
}  // namespace dsv41
