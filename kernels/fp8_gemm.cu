// fp8_gemm: the block-scaled FP8 linear of kernels/fp8_linear.cu at large m (prefill) on the
// Hopper tensor cores' FP8 products: y[m, n] = bf16( sum_k xq[m, k] * W[n, k] ), f32 accumulation,
// W[n, k] = e4m3(codes[n, k]) * 2^(S[n/32, k/32] - 127) (32x32 blocks, e8m0 scale bytes, 255 =
// NaN) and xq = Q1(x) (1x32 e4m3 activation quantization with a power-of-two scale, spec §0.1b.8;
// required here: with act quant off the caller dequantizes instead). CPU reference:
// quant::fp8_linear_ref; GPU tests: tests/cuda_fp8_linear.rs (the Gemm path).
//
// Layout: x [m, k] bf16, codes [n, k] u8, scales [n/32 rounded up, k/32] u8, out [m, n] bf16, all
// contiguous row-major; k a multiple of 128 (the launcher returns DSV41_ERR_SHAPE otherwise).
//
// Design (a warp-specialized, persistent GEMM of 128 x 128 output tiles):
//   * prep kernel: xq = Q1(x) as raw e4m3 bytes [m, k] (exact: the quantized values are e4m3
//     values), the activation block scales 2^e as f32 [k/32, mpad] (mpad = m rounded up to the
//     tile, 0 in the padding) and the weight block scales 2^(S - 127) as f32 [k/32, nbpad]
//     (transposed, nbpad = 4 x the n tiles, 0 in the padding), so that a k32 block's four weight
//     scales of a tile are one 16-byte word. The GEMM launches early (programmatic dependent
//     launch) and waits for it (griddepcontrol.wait).
//   * GEMM CTA: 384 threads = 3 warpgroups, one CTA per SM looping over the tiles tile =
//     blockIdx.x, + gridDim.x, ... (token tile fastest: the CTAs in flight share a few weight
//     tiles and read the activations from L2). Warpgroup 2 is the producer: per K stage of 128
//     bytes (4 k32 blocks) it copies with cp.async the x tile (128 tokens x 128 bytes, 16 KB), the weight tile (128 rows x 128 bytes, 16 KB), the
//     activation scales (4 x 128 f32) and the weight scales (4 x 4 f32) into a ring of STAGES
//     stages; rows past m / n are zero-filled. Each producer thread's copies complete one arrival
//     on the stage's `full` mbarrier (cp.async.mbarrier.arrive.noinc, 128 arrivals); it refills a
//     stage once the 8 consumer warps arrived on its `empty` mbarrier.
//   * Consumers: warpgroups 0 and 1, each 64 tokens x 128 weight rows.
//     Per k32 block j of a stage: wgmma m64n128k32 e4m3 x e4m3 -> f32 into a temporary (scale-d =
//     0), A = the x tile and B = the weight tile, both K-major from shared memory; the block is
//     selected by advancing the descriptors' start address by 32 j bytes inside the 128-byte
//     swizzle atom (as the bf16 k16 steps of kernels/sparse_attention.cu). Then the promotion
//     acc += tmp * (sa[token] * sw[row / 32]) in f32: the reference's per-block scales (a scale
//     product above 2^127 clamped to FLT_MAX, NaN kept, so that an all-zero block stays 0 as in
//     the stream kernel). One temporary per warpgroup: issue, wait, promote; the tensor cores
//     and the FMA pipes overlap across the two consumer warpgroups (one promotes while the other's
//     product runs, as DeepGEMM's FP8 kernels do). A stage goes back to the producer after its
//     last block was promoted (its scales are read from shared memory until then).
//   * Registers: 168 per thread for all (65536 / 384), no spills: acc 64 + tmp 64 fit. Tried and
//     dropped (ptxas -v, sm_90a): two alternating temporaries (block j + 1's product issued
//     before block j is promoted) need ~200 registers; with setmaxnreg 232 / 40 the producer
//     spills, and ptxas reports the products serialized anyway (C7514: accumulator registers of a
//     wgmma read before its wait_group), so the overlap would not happen.
//   * Epilogue: bf16 (RNE) stores straight from the accumulator fragments, bounds-checked for m
//     and n; the producer meanwhile fills the stages of the CTA's next tile.
//
// Shared memory (per stage, the tiles 1024-byte aligned for the 128-byte swizzle, whose pattern
// repeats every 8 rows): A [128 rows][128 bytes] and B [128 rows][128 bytes], 16-byte chunk c of
// row r at r * 128 + ((c ^ (r & 7)) << 4) (the wgmma 128-byte-swizzle K-major canonical layout,
// descriptor stride 1024 bytes per 8-row group); sa f32 [4 blocks][128 tokens]; sw f32 [4
// blocks][4 row blocks]; then the mbarriers full[STAGES], empty[STAGES].
//
// Numerics: products of e4m3 codes are exact on the tensor cores and a k32 block's 32 products
// are summed by the tensor core (order and internal precision unspecified: DeepSeek-V3's report
// measured about 14 bits kept by Hopper's FP8 accumulation, which is why every k32 block starts
// from zero here and is promoted to f32 at once); each block sum is scaled by the power of two sa *
// sw (exact unless it leaves the f32 range) and added in f32 in block order; outputs rounded to
// bf16 once (RNE). Scale byte 255 gives NaN outputs like the reference. Deterministic: fixed
// order everywhere, no atomics. Against the CPU reference (tests/cuda_fp8_linear.rs, H100): 4.4 %
// of outputs one bf16 ulp off, 0.66 % more, all within 2^-8 of the |products| sum (the worst case
// of a block accumulated with ~13 bits).
//
// Measured (docs/perf.md "FP8 linear", H100): the fastest FP8 path at m = 256 (wq_b 59.7 us) but
// 412-445 TFLOP/s at m = 4096: the promotion's FFMAs overlap the products only across the two
// consumer warpgroups.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <float.h>

#include "include/dsv41_fp8.cuh"
#include "include/dsv41_fp8_linear.h"
#include "include/dsv41_hopper.cuh"
#include "include/dsv41_launch.cuh"
#include "include/dsv41_numerics.cuh"

namespace dsv41 {
namespace fp8g {

using namespace dsv41_ptx;
using fp8::e8m0_f32;

constexpr int BM = 128;          // tokens per tile
constexpr int BN = 128;          // weight rows per tile
constexpr int BK = 128;          // K bytes per stage (4 k32 blocks)
constexpr int STAGES = 5;
constexpr int THREADS = 384;     // 2 consumer warpgroups + the producer warpgroup
constexpr int PROD = 128;
constexpr int CONSUMER_WARPS = 8;
constexpr int TILE = BM * BK;    // bytes of one operand tile
static_assert(BM == BN, "the producer copies both tiles with one row mapping");

constexpr int SM_A = 0;                               // [STAGES][128][128] e4m3
constexpr int SM_B = SM_A + STAGES * TILE;            // [STAGES][128][128] e4m3
constexpr int SM_SA = SM_B + STAGES * TILE;           // f32 [STAGES][4][BM]
constexpr int SA_STAGE = 4 * BM * 4;
constexpr int SM_SW = SM_SA + STAGES * SA_STAGE;      // f32 [STAGES][4][4]
constexpr int SM_BAR = SM_SW + STAGES * 64;           // u64 full[STAGES], empty[STAGES]
constexpr int SMEM = SM_BAR + 2 * STAGES * 8;
constexpr int SMEM_ALLOC = SMEM + 1024;               // the base is aligned up to 1024 in the kernel
static_assert(SM_B % 1024 == 0 && TILE % 1024 == 0, "wgmma operand tiles start on 1024-byte boundaries");
static_assert(SMEM_ALLOC <= 227 * 1024, "shared memory");

constexpr int kPrepThreads = 256;

struct GemmArgs {
    const uint8_t* xq;       // [m, k] e4m3 bytes
    const float* ascale;     // [kb, mpad]
    const uint8_t* codes;    // [n, k]
    const float* wscale;     // [kb, nbpad]
    __nv_bfloat16* out;      // [m, n]
    int m, n, k, mpad, nbpad, mt, tiles;
};

// min(v, FLT_MAX) with NaN kept (min.NaN): a scale product of 2^128 or more becomes FLT_MAX.
__device__ __forceinline__ float clamp_scale(float v) {
    float r;
    asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(v), "f"(FLT_MAX));
    return r;
}

// acc += t * scale for k32 block j of the stage at sa_s / sw_s: t[4i + c] is token tok (c < 2) or
// tok + 8 (c >= 2) of the CTA tile, weight row 8i + 2 (lane % 4) + c % 2 (row block i / 4).
__device__ __forceinline__ void promote(float (&acc)[64], const float (&t)[64], const float* sa_s, const float* sw_s, int j, int tok) {
    const float a_lo = sa_s[j * BM + tok], a_hi = sa_s[j * BM + tok + 8];
    const float4 w = *reinterpret_cast<const float4*>(sw_s + 4 * j);
    const float wq[4] = {w.x, w.y, w.z, w.w};
    float s[2][4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        s[0][q] = clamp_scale(a_lo * wq[q]);
        s[1][q] = clamp_scale(a_hi * wq[q]);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[4 * i + c] = fmaf(t[4 * i + c], s[c >> 1][i >> 2], acc[4 * i + c]);
}

// tmp = A_j * B_j (k32 block j of the stage's descriptors), one commit group.
__device__ __forceinline__ void issue(float (&t)[64], uint64_t ad, uint64_t bd, int j) {
    wg_fence_regs<64>(t);  // the promotion's reads of t come first
    wg_fence();
    wg_m64n128k32_e4m3(t, ad + 2 * j, bd + 2 * j, 0);  // + 32 j bytes (the address field is in 16-byte units)
    wg_commit();
}

__device__ __forceinline__ void store_tile(const GemmArgs& a, const float (&acc)[64], int m0, int n0, int tok, int t4) {
    const bool even = (a.n & 1) == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = m0 + tok + 8 * h;
        if (row >= a.m) continue;
        __nv_bfloat16* o = a.out + static_cast<int64_t>(row) * a.n;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int col = n0 + 8 * i + 2 * t4;
            const float v0 = acc[4 * i + 2 * h], v1 = acc[4 * i + 2 * h + 1];
            if (even && col + 1 < a.n) {
                *reinterpret_cast<__nv_bfloat162*>(o + col) = __floats2bfloat162_rn(v0, v1);
            } else {
                if (col < a.n) o[col] = __float2bfloat16_rn(v0);
                if (col + 1 < a.n) o[col + 1] = __float2bfloat16_rn(v1);
            }
        }
    }
}

__global__ void __launch_bounds__(THREADS, 1) fp8_gemm_kernel(const GemmArgs a) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t sbase = (raw + 1023u) & ~1023u;
    const unsigned char* smem = smem_raw + (sbase - raw);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const uint32_t full = sbase + SM_BAR, empty = full + 8 * STAGES;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, PROD);               // one cp.async arrival per producer thread
            mbar_init(empty + 8 * s, CONSUMER_WARPS);    // one arrival per consumer warp
        }
    }
    grid_dep_wait();  // the prep kernel's xq and scales
    __syncthreads();
    const int nk = a.k / BK;

    if (warp >= CONSUMER_WARPS) {
        // Producer warpgroup: thread p copies chunk p % 8 of rows p / 8 + 16 i of both tiles,
        // 16 bytes of the activation scales, and (p < 4) a k32 block's 4 weight scales.
        const int p = tid - CONSUMER_WARPS * 32, r0 = p >> 3, c = p & 7;
        int s = 0;
        uint32_t ph = 0;
        for (int tile = blockIdx.x; tile < a.tiles; tile += gridDim.x) {
            const int m0 = (tile % a.mt) * BM, n0 = (tile / a.mt) * BN;
            for (int kt = 0; kt < nk; ++kt) {
                mbar_wait(empty + 8 * s, ph ^ 1);  // the first pass waits on the phase before init: returns at once
                const int k0 = kt * BK;
                const uint32_t ta = sbase + SM_A + s * TILE, tb = sbase + SM_B + s * TILE;
#pragma unroll
                for (int i = 0; i < BM / 16; ++i) {
                    const int r = r0 + 16 * i;
                    const uint32_t off = r * 128 + ((c ^ (r & 7)) << 4);
                    const bool oka = m0 + r < a.m, okb = n0 + r < a.n;
                    cp_async16_l2(ta + off, oka ? a.xq + static_cast<int64_t>(m0 + r) * a.k + k0 + 16 * c : a.xq, oka);
                    cp_async16_l2(tb + off, okb ? a.codes + static_cast<int64_t>(n0 + r) * a.k + k0 + 16 * c : a.codes, okb);
                }
                const int j = p >> 5, q = p & 31;
                cp_async16(sbase + SM_SA + s * SA_STAGE + j * BM * 4 + 16 * q, a.ascale + static_cast<int64_t>(kt * 4 + j) * a.mpad + m0 + 4 * q, true);
                if (p < 4) cp_async16(sbase + SM_SW + s * 64 + 16 * p, a.wscale + static_cast<int64_t>(kt * 4 + p) * a.nbpad + n0 / 32, true);
                cp_async_mbar_arrive(full + 8 * s);
                if (++s == STAGES) {
                    s = 0;
                    ph ^= 1;
                }
            }
        }
        cp_async_wait_all();
        return;
    }

    // Consumer warpgroups. wg from lane 0 so that the compiler sees warp-uniform branches.
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
    const int tok = wg * 64 + (warp & 3) * 16 + (lane >> 2), t4 = lane & 3;
    float acc[64], t[64];
    int s = 0;
    uint32_t ph = 0;
    auto sa_of = [&](int st) { return reinterpret_cast<const float*>(smem + SM_SA + st * SA_STAGE); };
    auto sw_of = [&](int st) { return reinterpret_cast<const float*>(smem + SM_SW + st * 64); };
    auto release = [&](int st) {
        __syncwarp();  // every lane's scale reads of the stage are done
        if (lane == 0) mbar_arrive(empty + 8 * st);
    };
    for (int tile = blockIdx.x; tile < a.tiles; tile += gridDim.x) {
        const int m0 = (tile % a.mt) * BM, n0 = (tile / a.mt) * BN;
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
        for (int kt = 0; kt < nk; ++kt) {
            mbar_wait(full + 8 * s, ph);
            fence_proxy_async();  // the stage (cp.async, generic-proxy writes) is read by wgmma
            const uint64_t ad = wg_desc(sbase + SM_A + s * TILE + wg * 64 * 128, 16, 1024);
            const uint64_t bd = wg_desc(sbase + SM_B + s * TILE, 16, 1024);
            const float *sa = sa_of(s), *sw = sw_of(s);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                issue(t, ad, bd, j);
                wg_wait<0>();
                wg_fence_regs<64>(t);
                promote(acc, t, sa, sw, j, tok);
            }
            release(s);
            if (++s == STAGES) {
                s = 0;
                ph ^= 1;
            }
        }
        store_tile(a, acc, m0, n0, tok, t4);
    }
}

// Blocks [0, qblocks): Q1 of x, 8 elements per thread, 4 threads per (token row, k32 block), the
// rows of one block consecutive (coalesced scale stores); rows m .. mpad get scale 0 (their x
// tile rows are zero-filled by the GEMM's copies). Blocks from qblocks on: the weight scales.
__global__ void __launch_bounds__(kPrepThreads) fp8_gemm_prep_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ scales,
                                                                      uint8_t* __restrict__ xq, float* __restrict__ ascale, float* __restrict__ wscale,
                                                                      int m, int k, int mpad, int nbn, int nbpad, unsigned qblocks) {
    grid_dep_launch();  // the GEMM may start; it waits for this grid before reading
    const int kb = k / 32;
    if (blockIdx.x >= qblocks) {
        const int64_t i = static_cast<int64_t>(blockIdx.x - qblocks) * kPrepThreads + threadIdx.x;
        if (i >= static_cast<int64_t>(kb) * nbpad) return;
        const int blk = static_cast<int>(i / nbpad), rb = static_cast<int>(i % nbpad);
        wscale[i] = rb < nbn ? e8m0_f32(scales[static_cast<int64_t>(rb) * kb + blk]) : 0.0f;
        return;
    }
    using Q1 = QuantTraits<Quant::Fp8Ue8m0B32>;
    const int64_t gid = static_cast<int64_t>(blockIdx.x) * kPrepThreads + threadIdx.x;
    const bool live = gid < static_cast<int64_t>(mpad) * kb * 4;  // whole warps run the shuffles
    const int part = static_cast<int>(gid & 3);
    const int64_t rb = gid >> 2;
    const int row = static_cast<int>(rb % mpad), blk = static_cast<int>(rb / mpad);
    const bool in = live && row < m;
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if (in) raw = __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(row) * k + blk * 32 + part * 8));
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    float v[8];
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        v[e] = __uint_as_float((e & 1 ? w[e >> 1] & 0xffff0000u : w[e >> 1] << 16));
        amax = fmaxf(amax, fabsf(v[e]));
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const BlockScale bs = Q1::scale(amax);
    uint32_t lo = 0u, hi = 0u;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const uint32_t code = Q1::code(Q1::quotient(v[e], bs));
        if (e < 4) lo |= code << (8 * e);
        else hi |= code << (8 * (e - 4));
    }
    if (in) *reinterpret_cast<uint2*>(xq + static_cast<int64_t>(row) * k + blk * 32 + part * 8) = make_uint2(lo, hi);
    if (live && part == 0) ascale[static_cast<int64_t>(blk) * mpad + row] = in ? bs.s : 0.0f;
}

struct Plan {
    int mt, nt, mpad, nbn, nbpad, kb;
    int64_t xq_off, ascale_off, wscale_off, bytes;
};

using dsv41_launch::align256;

inline int validate(const Dsv41Fp8LinearParams* p, size_t params_size) {
    if (params_size != sizeof(Dsv41Fp8LinearParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->m < 1 || p->n < 1 || p->k < BK || p->k % BK != 0 || !p->act_quant) return DSV41_ERR_SHAPE;
    if (p->n_first != 0) return DSV41_ERR_SHAPE;  // one output (the caller splits a stacked product)
    // Tile counts and the scratch indices in int: m, n below 2^31 - 128.
    if (p->m > INT32_MAX - BM || p->n > INT32_MAX - BN) return DSV41_ERR_SHAPE;
    const int64_t tiles = static_cast<int64_t>((p->m + BM - 1) / BM) * ((p->n + BN - 1) / BN);
    if (tiles > INT32_MAX) return DSV41_ERR_SHAPE;
    return DSV41_OK;
}

inline Plan make_plan(const Dsv41Fp8LinearParams* p) {
    Plan q;
    q.mt = (p->m + BM - 1) / BM;
    q.nt = (p->n + BN - 1) / BN;
    q.mpad = q.mt * BM;
    q.nbn = (p->n + 31) / 32;
    q.nbpad = q.nt * (BN / 32);
    q.kb = p->k / 32;
    q.xq_off = 0;
    q.ascale_off = align256(static_cast<int64_t>(p->m) * p->k);
    q.wscale_off = q.ascale_off + align256(static_cast<int64_t>(q.kb) * q.mpad * 4);
    q.bytes = q.wscale_off + align256(static_cast<int64_t>(q.kb) * q.nbpad * 4);
    return q;
}

using dsv41_launch::sm_count;

}  // namespace fp8g
}  // namespace dsv41

extern "C" int dsv41_fp8_gemm_scratch_bytes(const Dsv41Fp8LinearParams* p, size_t params_size, int64_t* bytes) {
    using namespace dsv41::fp8g;
    const int v = validate(p, params_size);
    if (v != DSV41_OK) return v;
    if (!bytes) return DSV41_ERR_NULL;
    *bytes = make_plan(p).bytes;
    return DSV41_OK;
}

extern "C" int dsv41_fp8_gemm(const Dsv41Fp8LinearParams* p, size_t params_size, void* stream) {
    using namespace dsv41::fp8g;
    const int v = validate(p, params_size);
    if (v != DSV41_OK) return v;
    if (!p->x || !p->codes || !p->scales || !p->out || !p->scratch) return DSV41_ERR_NULL;
    const Plan q = make_plan(p);
    if (p->scratch_bytes < q.bytes) return DSV41_ERR_SHAPE;
    auto mis = [](const void* ptr, uintptr_t mask) { return (reinterpret_cast<uintptr_t>(ptr) & mask) != 0; };
    if (mis(p->scratch, 255) || mis(p->x, 15) || mis(p->codes, 15) || mis(p->scales, 3) || mis(p->out, 3)) return DSV41_ERR_ALIGNMENT;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    char* base = static_cast<char*>(p->scratch);
    auto* xq = reinterpret_cast<uint8_t*>(base + q.xq_off);
    auto* ascale = reinterpret_cast<float*>(base + q.ascale_off);
    auto* wscale = reinterpret_cast<float*>(base + q.wscale_off);

    const int64_t qthreads = static_cast<int64_t>(q.mpad) * q.kb * 4, wthreads = static_cast<int64_t>(q.kb) * q.nbpad;
    const int64_t qblocks = (qthreads + kPrepThreads - 1) / kPrepThreads, wblocks = (wthreads + kPrepThreads - 1) / kPrepThreads;
    if (qblocks + wblocks > INT32_MAX) return DSV41_ERR_SHAPE;
    fp8_gemm_prep_kernel<<<static_cast<unsigned>(qblocks + wblocks), kPrepThreads, 0, st>>>(
        static_cast<const __nv_bfloat16*>(p->x), p->scales, xq, ascale, wscale, p->m, p->k, q.mpad, q.nbn, q.nbpad, static_cast<unsigned>(qblocks));
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return static_cast<int>(e);

    static thread_local int configured_dev = -1;
    int dev = 0;
    e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = dsv41_launch::set_max_dynamic_smem(fp8_gemm_kernel, dev, SMEM_ALLOC, configured_dev);
    if (e != cudaSuccess) return static_cast<int>(e);
    GemmArgs a;
    a.xq = xq;
    a.ascale = ascale;
    a.codes = p->codes;
    a.wscale = wscale;
    a.out = static_cast<__nv_bfloat16*>(p->out);
    a.m = p->m;
    a.n = p->n;
    a.k = p->k;
    a.mpad = q.mpad;
    a.nbpad = q.nbpad;
    a.mt = q.mt;
    a.tiles = q.mt * q.nt;
    const int sms = sm_count();
    const int grid = a.tiles < sms ? a.tiles : sms;
    e = dsv41_launch::launch_pdl(fp8_gemm_kernel, dim3(grid), dim3(THREADS), SMEM_ALLOC, st, 1, a);
    return static_cast<int>(e);
}
