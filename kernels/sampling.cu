// sampling: one token per sequence from its logits row [B, V] — greedy, temperature, top-k, top-p,
// a seed per sequence and a step per draw — the algorithm of crates/deepseek-v41/src/sampling/
// (mod.rs defines it, reference.rs is the CPU reference `sample_row_ref`, math.rs the arithmetic
// this file mirrors). Only ids[B] is written; the host reads nothing but those ids.
//
// Design: one CTA of 512 threads per row; every pass reads the row from global memory (a 129280-
// entry f32 row is 505 KiB, more than shared memory), coalesced, one entry per thread per step.
//   pass 0   the row's argmax (max of key << 32 | ~id); greedy rows stop here.
//   level 1  (top-k or top-p only) a 1024-bin histogram of the top 10 key bits: counts, and with
//            top-p the fixed-point masses (integer shared-memory atomics: exact in any order); Z.
//   select   the k-th entry (counts) or the nucleus boundary (masses) by radix selection: the
//            crossing bin of level 1, then levels 2 and 3 (2048 bins of key bits 21..11, 10..0,
//            entries of the chosen bucket only) give the boundary key exactly, and how many of its
//            equal entries the candidates take. With both top-k and top-p, the top-k boundary
//            first; the nucleus selection (reusing level 1) only when the top-k prefix already
//            holds the target mass, i.e. when the nucleus is the shorter prefix.
//   ties     when the candidates take only some of the boundary key's entries, a block-wide scan
//            in id order finds the id after the last one taken (lower ids first).
//   draw     the argmax of x + Gumbel over the candidates (max of score key << 32 | ~id); an entry
//            with x below the row argmax's score minus 24 (an upper bound of a Gumbel value) can
//            neither win nor tie and skips its hash and logarithms.
//
// Numerics: bit for bit the CPU reference. Every float operation of the keys, x = (l − max)/T, the
// masses and the Gumbel values is an __f*_rn intrinsic (never contracted into an FMA) in the
// order of math.rs, the constants given exactly; the masses are integers; the reductions are
// maxima and integer sums. So the kernel picks the same id as `sample_row_ref` for every row
// (tests/cuda_sampling.rs).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "include/dsv41_float_io.cuh"
#include "include/dsv41_sampling.h"
#include "include/dsv41_warp.cuh"

namespace dsv41_sample {

using u64 = unsigned long long;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins1 = 1024;   // level 1: key bits 31..22
constexpr int kBins23 = 2048;  // levels 2 and 3: key bits 21..11, 10..0
constexpr unsigned kFull = 0xFFFFFFFFu;

// math.rs, constant for constant.
constexpr float kGumbelBound = 24.0f;
constexpr float kMassCutoff = -28.0f;
constexpr u64 kGamma = 0x9E3779B97F4A7C15ull;
constexpr u64 kSeedSalt = 0x243F6A8885A308D3ull;
constexpr float kLn2Hi = 0x1.62e400p-1f;    // 0x3f317200
constexpr float kLn2Lo = 0x1.7f7d1cp-20f;   // 0x35bfbe8e
constexpr float kLog2e = 0x1.715476p+0f;    // 0x3fb8aa3b
constexpr uint32_t kSqrt2Bits = 0x3FB504F3u;
constexpr float kC3 = 0x1.555556p-1f;       // 0x3f2aaaab
constexpr float kC5 = 0x1.99999ap-2f;       // 0x3ecccccd
constexpr float kC7 = 0x1.24924ap-2f;       // 0x3e924925
constexpr float kC9 = 0x1.c71c72p-3f;       // 0x3e638e39
constexpr float kE3 = 0x1.555556p-3f;       // 0x3e2aaaab
constexpr float kE4 = 0x1.555556p-5f;       // 0x3d2aaaab
constexpr float kE5 = 0x1.111112p-7f;       // 0x3c088889
constexpr float kE6 = 0x1.6c16c2p-10f;      // 0x3ab60b61
constexpr float kE7 = 0x1.a01a02p-13f;      // 0x39500d01
constexpr float kTwoM33 = 0x1p-33f;
constexpr float kTwo40 = 0x1p40f;

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 row_stream(u64 seed, u64 step) { return mix64(mix64(seed ^ kSeedSalt) + step); }

__device__ __forceinline__ uint32_t element_bits(u64 stream, uint32_t i) {
    return static_cast<uint32_t>(mix64(stream + (static_cast<u64>(i) + 1ull) * kGamma) >> 32);
}

__device__ __forceinline__ float atanh2(float s) {
    const float z = __fmul_rn(s, s);
    float p = kC9;
    p = __fadd_rn(kC7, __fmul_rn(z, p));
    p = __fadd_rn(kC5, __fmul_rn(z, p));
    p = __fadd_rn(kC3, __fmul_rn(z, p));
    p = __fadd_rn(2.0f, __fmul_rn(z, p));
    return __fmul_rn(s, p);
}

__device__ __forceinline__ float ln_pos(float x) {
    const uint32_t b = __float_as_uint(x);
    int e = static_cast<int>(b >> 23) - 127;
    uint32_t mb = (b & 0x007FFFFFu) | 0x3F800000u;
    if (mb > kSqrt2Bits) {
        mb -= 0x00800000u;
        e += 1;
    }
    const float m = __uint_as_float(mb);
    const float s = __fdiv_rn(__fsub_rn(m, 1.0f), __fadd_rn(m, 1.0f));
    const float ef = static_cast<float>(e);
    return __fadd_rn(__fmul_rn(ef, kLn2Hi), __fadd_rn(__fmul_rn(ef, kLn2Lo), atanh2(s)));
}

__device__ __forceinline__ float exponential(uint32_t h) {
    if (h < 0xC0000000u) {
        const float u = __fmul_rn(__ull2float_rn(2ull * h + 1ull), kTwoM33);
        return -ln_pos(u);
    }
    const float v = __fmul_rn(__ull2float_rn((1ull << 33) - 2ull * h - 1ull), kTwoM33);
    return atanh2(__fdiv_rn(v, __fsub_rn(2.0f, v)));
}

__device__ __forceinline__ float gumbel(uint32_t h) { return -ln_pos(exponential(h)); }

__device__ __forceinline__ float exp_nonpos(float x) {
    if (!(x >= kMassCutoff)) return 0.0f;
    const float n = floorf(__fadd_rn(__fmul_rn(x, kLog2e), 0.5f));
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, kLn2Hi)), __fmul_rn(n, kLn2Lo));
    float p = kE7;
    p = __fadd_rn(kE6, __fmul_rn(r, p));
    p = __fadd_rn(kE5, __fmul_rn(r, p));
    p = __fadd_rn(kE4, __fmul_rn(r, p));
    p = __fadd_rn(kE3, __fmul_rn(r, p));
    p = __fadd_rn(0.5f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    return __fmul_rn(p, __uint_as_float(static_cast<uint32_t>(static_cast<int>(n) + 127) << 23));
}

__device__ __forceinline__ u64 mass_of(float x) { return __float2ull_rz(__fmul_rn(exp_nonpos(x), kTwo40)); }

// ceil(top_p · z) in f64, within [1, z] (z >= 2^40 here: the row's argmax weighs 2^40).
__device__ __forceinline__ u64 nucleus_target(float top_p, u64 z) {
    const double t = ceil(__dmul_rn(static_cast<double>(top_p), __ull2double_rn(z)));
    if (!(t >= 1.0)) return 1;
    const u64 r = static_cast<u64>(t);
    return r < z ? r : z;
}

// NaN -> -inf, -0 -> +0, then the order-preserving key.
__device__ __forceinline__ uint32_t order_key(float l) {
    uint32_t b = __float_as_uint(l);
    if (l != l) b = 0xFF800000u;
    else if (l == 0.0f) b = 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k); }

__device__ __forceinline__ u64 ranked(uint32_t key, uint32_t id) { return (static_cast<u64>(key) << 32) | (0xFFFFFFFFu - id); }

__device__ __forceinline__ u64 umax(u64 a, u64 b) { return a > b ? a : b; }

// A bin where the running total from the top crosses `want`, with the totals above it.
struct Crossing {
    u64 above_cnt;
    u64 above_mass;
    uint32_t bin;
    uint32_t bin_cnt;
};

// The selected boundary: its key, the entries above it, and how many of its own entries the
// candidates take (1 .. tie_cnt).
struct Selection {
    u64 above_mass;
    u64 take;
    uint32_t key;
    uint32_t tie_cnt;
};

struct Shared {
    u64 mass1[kBins1];
    u64 mass2[kBins23];
    uint32_t cnt1[kBins1];
    uint32_t cnt2[kBins23];
    u64 red[2 * kWarps];
    Crossing out;
    uint32_t warp_cnt[kWarps];
    uint32_t cut;
};

// Max over the block; every thread gets it.
__device__ __forceinline__ u64 block_max(u64 v, Shared& sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = umax(v, __shfl_xor_sync(kFull, v, o));
    if ((threadIdx.x & 31) == 0) sh.red[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 r = sh.red[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) r = umax(r, sh.red[w]);
    __syncthreads();
    return r;
}

// Sum over the block; every thread gets it.
__device__ __forceinline__ u64 block_sum(u64 v, Shared& sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    if ((threadIdx.x & 31) == 0) sh.red[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 r = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) r += sh.red[w];
    __syncthreads();
    return r;
}

// Exclusive prefix sums of (a, b) over the threads in thread order.
__device__ __forceinline__ void block_exclusive2(u64 a, u64 b, u64& ea, u64& eb, Shared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 ia = dsv41_warp::inclusive_sum(a, lane), ib = dsv41_warp::inclusive_sum(b, lane);
    if (lane == 31) {
        sh.red[warp] = ia;
        sh.red[kWarps + warp] = ib;
    }
    __syncthreads();
    u64 pa = 0, pb = 0;
    for (int w = 0; w < warp; ++w) {
        pa += sh.red[w];
        pb += sh.red[kWarps + w];
    }
    ea = pa + ia - a;
    eb = pb + ib - b;
    __syncthreads();
}

// The bin d of `BINS` (higher bins hold larger keys) with base + S(> d) < want <= base + S(>= d),
// S the counts or (by_mass) the masses; the caller guarantees one exists.
template <int BINS>
__device__ __forceinline__ Crossing find_crossing(const uint32_t* cnt, const u64* mass, bool by_mass, u64 want, u64 base_cnt, u64 base_mass,
                                  Shared& sh) {
    constexpr int PER = BINS / kThreads;
    const int top = BINS - 1 - static_cast<int>(threadIdx.x) * PER;  // this thread's bins: top, top − 1, …
    u64 lc = 0, lm = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        lc += cnt[top - j];
        lm += mass[top - j];
    }
    u64 c, ms;
    block_exclusive2(lc, lm, c, ms, sh);
    c += base_cnt;
    ms += base_mass;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int bin = top - j;
        const u64 before = by_mass ? ms : c;
        const u64 here = by_mass ? mass[bin] : cnt[bin];
        if (before < want && want <= before + here) sh.out = Crossing{c, ms, static_cast<uint32_t>(bin), cnt[bin]};
        c += cnt[bin];
        ms += mass[bin];
    }
    __syncthreads();
    const Crossing r = sh.out;
    __syncthreads();
    return r;
}

// x = (l − max l) / T of a key.
__device__ __forceinline__ float scaled(uint32_t key, float m, float temp) {
    return __fdiv_rn(__fsub_rn(key_value(key), m), temp);
}

// Histogram of the entries whose key >> prefix_shift equals prefix (all when prefix_shift is 32)
// by the digit (key >> digit_shift) & (bins − 1): counts, and masses when with_mass.
template <typename T>
__device__ __forceinline__ void histogram(const T* row, int vocab, int prefix_shift, uint32_t prefix, int digit_shift, uint32_t bins, bool with_mass,
                          float m, float temp, uint32_t* cnt, u64* mass) {
    for (uint32_t j = threadIdx.x; j < bins; j += kThreads) {
        cnt[j] = 0;
        mass[j] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
        const uint32_t key = order_key(dsv41::load_f32(row, i));
        if (prefix_shift < 32 && (key >> prefix_shift) != prefix) continue;
        const uint32_t d = (key >> digit_shift) & (bins - 1);
        atomicAdd(&cnt[d], 1u);
        if (with_mass) {
            const u64 q = mass_of(scaled(key, m, temp));
            if (q) atomicAdd(&mass[d], q);
        }
    }
    __syncthreads();
}

// Radix selection of the boundary where the running count (or mass) from the largest key reaches
// `want`, levels 2 and 3 from level 1's histogram (already in sh.cnt1 / sh.mass1).
template <typename T>
__device__ __forceinline__ Selection select_boundary(const T* row, int vocab, bool by_mass, u64 want, bool with_mass, float m, float temp, Shared& sh) {
    const Crossing c1 = find_crossing<kBins1>(sh.cnt1, sh.mass1, by_mass, want, 0, 0, sh);
    histogram(row, vocab, 22, c1.bin, 11, kBins23, with_mass, m, temp, sh.cnt2, sh.mass2);
    const Crossing c2 = find_crossing<kBins23>(sh.cnt2, sh.mass2, by_mass, want, c1.above_cnt, c1.above_mass, sh);
    histogram(row, vocab, 11, (c1.bin << 11) | c2.bin, 0, kBins23, with_mass, m, temp, sh.cnt2, sh.mass2);
    const Crossing c3 = find_crossing<kBins23>(sh.cnt2, sh.mass2, by_mass, want, c2.above_cnt, c2.above_mass, sh);
    Selection s;
    s.key = (c1.bin << 22) | (c2.bin << 11) | c3.bin;
    s.tie_cnt = c3.bin_cnt;
    s.above_mass = c3.above_mass;
    if (by_mass) {
        const u64 q = mass_of(scaled(s.key, m, temp));  // > 0: the crossing bin holds mass
        s.take = (want - c3.above_mass + q - 1) / q;
    } else {
        s.take = want - c3.above_cnt;
    }
    return s;
}

// One past the id of the take-th entry (in id order, 1-based) whose key is `key`.
template <typename T>
__device__ __forceinline__ uint32_t tie_cut(const T* row, int vocab, uint32_t key, u64 take, Shared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) sh.cut = static_cast<uint32_t>(vocab);  // ordered before any write by the loop's first barrier
    u64 seen = 0;
    for (int base = 0; base < vocab; base += kThreads) {
        const int i = base + static_cast<int>(threadIdx.x);
        const bool f = i < vocab && order_key(dsv41::load_f32(row, i)) == key;
        const uint32_t ballot = __ballot_sync(kFull, f);
        if (lane == 0) sh.warp_cnt[warp] = __popc(ballot);
        __syncthreads();
        u64 before = seen, total = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            before += w < warp ? sh.warp_cnt[w] : 0u;
            total += sh.warp_cnt[w];
        }
        before += __popc(ballot & ((1u << lane) - 1u));
        if (f && before + 1 == take) sh.cut = static_cast<uint32_t>(i) + 1;
        seen += total;
        __syncthreads();
        if (seen >= take) break;
    }
    return sh.cut;  // written before the last barrier
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sampling_kernel(Dsv41SamplingParams p) {
    __shared__ Shared sh;
    const int vocab = p.vocab;
    const T* row = static_cast<const T*>(p.logits) + static_cast<int64_t>(blockIdx.x) * p.row_stride;
    const uint32_t* prm = p.table + static_cast<int64_t>(blockIdx.x) * DSV41_SAMPLING_TABLE_WORDS;
    const float temp = __uint_as_float(prm[0]);
    const uint32_t top_k = prm[1];
    const float top_p = __uint_as_float(prm[2]);
    const u64 seed = static_cast<u64>(prm[4]) | (static_cast<u64>(prm[5]) << 32);
    const u64 step = static_cast<u64>(prm[6]) | (static_cast<u64>(prm[7]) << 32);

    // Pass 0: the argmax (largest key, lowest id).
    u64 best = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) best = umax(best, ranked(order_key(dsv41::load_f32(row, i)), i));
    best = block_max(best, sh);
    const uint32_t a = 0xFFFFFFFFu - static_cast<uint32_t>(best);
    const float m = key_value(static_cast<uint32_t>(best >> 32));
    if (!(temp > 0.0f) || !isfinite(m)) {
        if (threadIdx.x == 0) p.ids[blockIdx.x] = a;
        return;
    }

    // The candidates: key > cut_key, or key == cut_key and id < cut_id (all entries by default:
    // every key is above 0).
    uint32_t cut_key = 0, cut_id = 0;
    const bool k_on = top_k != 0 && top_k < static_cast<uint32_t>(vocab);
    const bool p_on = top_p < 1.0f;
    if (k_on || p_on) {
        histogram(row, vocab, 32, 0, 22, kBins1, p_on, m, temp, sh.cnt1, sh.mass1);
        u64 target = 0;
        if (p_on) {
            u64 z = 0;
            for (int j = threadIdx.x; j < kBins1; j += kThreads) z += sh.mass1[j];
            target = nucleus_target(top_p, block_sum(z, sh));
        }
        Selection sel{};
        bool by_mass = !k_on;
        if (k_on) {
            sel = select_boundary(row, vocab, false, top_k, p_on, m, temp, sh);
            // The nucleus is the shorter prefix when the top-k prefix already holds its mass.
            if (p_on) by_mass = sel.above_mass + sel.take * mass_of(scaled(sel.key, m, temp)) >= target;
        }
        if (by_mass) sel = select_boundary(row, vocab, true, target, true, m, temp, sh);
        if (sel.take >= sel.tie_cnt) {
            cut_key = sel.key - 1;  // every entry of the boundary key
        } else {
            cut_key = sel.key;
            cut_id = tie_cut(row, vocab, sel.key, sel.take, sh);
        }
    }

    // The draw: argmax of x + Gumbel over the candidates, lower id on ties.
    const u64 stream = row_stream(seed, step);
    const float lb = __fadd_rn(scaled(order_key(m), m, temp), gumbel(element_bits(stream, a)));
    const float skip_below = __fsub_rn(lb, kGumbelBound);
    best = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
        const uint32_t key = order_key(dsv41::load_f32(row, i));
        if (key < cut_key || (key == cut_key && static_cast<uint32_t>(i) >= cut_id)) continue;
        const float x = scaled(key, m, temp);
        if (x < skip_below) continue;
        const float s = __fadd_rn(x, gumbel(element_bits(stream, i)));
        best = umax(best, ranked(order_key(s), i));
    }
    best = block_max(best, sh);
    if (threadIdx.x == 0) p.ids[blockIdx.x] = 0xFFFFFFFFu - static_cast<uint32_t>(best);
}

}  // namespace dsv41_sample

extern "C" int dsv41_sampling(const Dsv41SamplingParams* p, size_t params_size, void* stream) {
    using namespace dsv41_sample;
    if (params_size != sizeof(Dsv41SamplingParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->batch < 0 || p->vocab < 1 || p->vocab > DSV41_SAMPLING_MAX_VOCAB || (p->batch > 1 && p->row_stride < p->vocab))
        return DSV41_ERR_SHAPE;
    if (p->batch == 0) return DSV41_OK;
    if (!p->logits || !p->table || !p->ids) return DSV41_ERR_NULL;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const dim3 grid(static_cast<unsigned>(p->batch));
    if (p->x_f32) sampling_kernel<float><<<grid, kThreads, 0, s>>>(*p);
    else sampling_kernel<__nv_bfloat16><<<grid, kThreads, 0, s>>>(*p);
    return static_cast<int>(cudaGetLastError());
}
