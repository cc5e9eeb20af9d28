// packed_insert: the three cache inserts (window, compressed, index keys) into the PACKED cache
// formats of spec §7.2 instead of bf16 rows: format A (window, 528 B per 512-wide row), B
// (compressed, 288 B) and E (MXFP4 index keys, 68 B per 128-wide row), in pages of `page_size`
// tokens with segregated data and scale regions (layout in dsv41_params.h).
//
//   [RMSNorm] -> RoPE -> quantize per block -> element codes + one scale byte per block
//
// The stored codes dequantize to exactly the values the bf16 inserts store (code * scale), so a
// packed cache holds the same numbers in 26% (A), 28% (B) or 27% (E) of the bytes.
//
// Design: the warp-per-row pipeline of dsv41_row.cuh (ROWS tokens per warp, loads issued
// first) up to RoPE; then each lane quantizes its
// D/32 contiguous elements with its block's scale (amax by xor shuffles across the block's
// lanes), writes its codes with one vector store (D/32 bytes of e4m3, or D/64 bytes of e2m1
// pairs, even element in the low nibble) and the first lane of each block writes the block's
// scale byte (ue8m0 = exponent + 127, or the e4m3 code of the Q2 scale). Format A's e4m3 codes
// come from the hardware conversion (cvt.rn.satfinite.e4m3x2.f32, two per instruction) for
// lanes without a NaN quotient. Format E rows of the V4.1 shape (D = 128, R = 64) take the
// quarter-warp-per-row path of dsv41_row128.cuh, their e2m1 codes computed from bf16 pairs
// (q3_codes4_raw_kc: 4 codes per 16 bits; one pair-or-element branch per row set), stored by each
// lane (2 bytes per 4-element chunk) and the 4 scale bytes as one word; power-of-two pages with
// 32-bit slots in a cache below 4 GiB (P32) take a shift-and-mask store path with 32-bit offsets
// and predicated stores (no branch around them), and the source rows are addressed with a
// 32-bit row stride (one wide multiply-add per row). Format B rows of the V4.1 shape (D = 512, R = 64, no norm, power-of-two
// pages) take packed_b512_kernel: the row stays in its loaded bf16 pairs, the e2m1 codes come
// from comparisons with the block's scaled tie points (q2_codes8, no quotient), the scale byte
// and value from the hardware e4m3 conversions (q2_scale_hw), the slots arrive by cp.async;
// two rows per warp, 6 resident blocks. Other B shapes keep the generic kernel (capped at 32
// registers, 8 resident blocks per SM, for the no-norm 512-wide rows).
//
// Numerics: identical to quant::packed::pack_row applied to the CPU reference rows (IEEE x/s,
// clamp, RNE to e4m3 / ties-to-even-code e2m1, the sign of zero kept in the code). The host
// check kernels/check/quant_exhaustive.cu compares the e4m3 bit path with CUDA's emulation of
// the hardware conversion for every bf16 value at every Q1 scale, and the format B pair codes
// and hardware scale with the element path / definitions for every bf16 value and scale.
#include <stdlib.h>
#include <string.h>

#include "include/dsv41_row128.cuh"

namespace dsv41 {

template <int N> struct ByteVec;
template <> struct ByteVec<2> { using T = uint16_t; };
template <> struct ByteVec<4> { using T = uint32_t; };
template <> struct ByteVec<8> { using T = uint2; };
template <> struct ByteVec<16> { using T = uint4; };

// The e4m3 bytes of lo (low byte) and hi: cvt.rn.satfinite.e4m3x2.f32 (sm_89+), round to
// nearest even, magnitudes above 448 (and inf) saturated to 448.
__device__ __forceinline__ uint32_t e4m3x2_rn_sat(float lo, float hi) {
    uint16_t v;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(v) : "f"(hi), "f"(lo));
    return v;
}

// Stores N bytes at an N-byte aligned address with one access.
template <int N>
__device__ __forceinline__ void store_bytes(uint8_t* dst, const uint8_t (&b)[N]) {
    if constexpr (N == 1) {
        *dst = b[0];
    } else {
        typename ByteVec<N>::T v;
        memcpy(&v, b, N);
        *reinterpret_cast<typename ByteVec<N>::T*>(dst) = v;
    }
}

// Quantizes the warp's row and, when `write`, stores codes at `data` (the row's data bytes) and
// scale bytes at `scales` (the row's scale bytes).
template <int D, Quant Q>
__device__ __forceinline__ void pack_row(const float (&x)[D / 32], int lane, bool write, uint8_t* data,
                                         uint8_t* scales) {
    constexpr int EPL = D / 32;
    constexpr int B = QuantTraits<Q>::kBlock;
    constexpr bool kFp4 = Q != Quant::Fp8Ue8m0B32;
    const BlockScale b = block_scale<D, Q>(x);
    if constexpr (Q == Quant::Fp8Ue8m0B32 && EPL >= 4) {
        // e4m3 codes by the hardware conversion (RNE, saturating to 448: e4m3_code_sat for
        // every non-NaN quotient), two per instruction, assembled into words; a lane holding a
        // NaN quotient (seen in the sum) takes the bit path, which keeps the NaN's sign.
        float y[EPL];
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
            y[k] = QuantTraits<Q>::quotient(x[k], b);
            acc = __fadd_rn(acc, y[k]);
        }
        uint32_t words[EPL / 4];
        if (acc == acc) {
#pragma unroll
            for (int q = 0; q < EPL / 4; ++q)
                words[q] = e4m3x2_rn_sat(y[4 * q], y[4 * q + 1]) | (e4m3x2_rn_sat(y[4 * q + 2], y[4 * q + 3]) << 16);
        } else {
#pragma unroll
            for (int q = 0; q < EPL / 4; ++q) {
                words[q] = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) words[q] |= static_cast<uint32_t>(QuantTraits<Q>::code(y[4 * q + k])) << (8 * k);
            }
        }
        if (write) {
            typename ByteVec<EPL>::T v;
            memcpy(&v, words, EPL);
            *reinterpret_cast<typename ByteVec<EPL>::T*>(data + lane * EPL) = v;
            if ((lane * EPL) % B == 0) scales[lane * EPL / B] = QuantTraits<Q>::scale_code(b.s);
        }
    } else {
        uint8_t codes[EPL];
#pragma unroll
        for (int k = 0; k < EPL; ++k) codes[k] = quant_code<Q>(x[k], b);
        if constexpr (kFp4) {
            uint8_t pairs[EPL / 2];
#pragma unroll
            for (int k = 0; k < EPL / 2; ++k) pairs[k] = static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
            if (write) store_bytes<EPL / 2>(data + lane * (EPL / 2), pairs);
        } else {
            if (write) store_bytes<EPL>(data + lane * EPL, codes);
        }
        if (write && (lane * EPL) % B == 0) scales[lane * EPL / B] = QuantTraits<Q>::scale_code(b.s);
    }
}

// Page and row of a slot >= 0: shift and mask for a power-of-two page size, else a 32-bit
// division when the slot fits (which it does in practice).
__device__ __forceinline__ void page_and_row(int64_t slot, int page_size, int64_t& page, int64_t& row) {
    if ((page_size & (page_size - 1)) == 0) {
        page = slot >> (__ffs(page_size) - 1);
        row = slot & (page_size - 1);
    } else if (slot <= 0x7fffffff) {
        const uint32_t s = static_cast<uint32_t>(slot), ps = static_cast<uint32_t>(page_size);
        const uint32_t q = s / ps;
        page = q;
        row = s - q * ps;
    } else {
        page = slot / page_size;
        row = slot % page_size;
    }
}

// The f32 element path of a format E row (a block scale above 2^119), out of line (see
// dsv41_row128.cuh): the 4 code nibbles of each chunk of the lane and the row's 4 scale bytes.
struct Row128H8 { uint32_t h[8]; };
struct PackedECodes { uint32_t code[4]; uint32_t scales; };
static __device__ __noinline__ PackedECodes packed_e_codes_element(Row128H8 hh, uint32_t a0, uint32_t a1) {
    constexpr Quant Q = Quant::Fp4Ue8m0B32;
    const uint32_t amax2[2] = {a0, a1};
    PackedECodes c;
    c.scales = 0;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const int k = q3_block_k_row128(amax2, m);
        const BlockScale b = pow2_scale(k);
        c.code[m] = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t hw = hh.h[2 * m + i / 2];
            c.code[m] |= static_cast<uint32_t>(quant_code<Q>(i % 2 ? bf16x2_hi(hw) : bf16x2_lo(hw), b)) << (4 * i);
        }
        c.scales |= static_cast<uint32_t>((k + 127) & 0xff) << (8 * m);  // UE8M0: the bits of 2^k
    }
    return c;
}

// P32's stores without a branch (for `if (slot >= 0) { ... }` ptxas emits one around them with a
// convergence barrier, BSSY / BSYNC): the four 2-byte codes at d, d + 16, d + 32, d + 48 if slot_hi >= 0
// (the slot's high word: slot >= 0) and the scale word at ds if also j_bits == 0 (lane j = 0 of the
// group; j_bits = threadIdx.x << 29), as predicated st.global.
__device__ __forceinline__ void st_codes_scales_if(uint8_t* d, uint8_t* ds, const uint32_t (&code)[4], uint32_t scales,
                                                   int32_t slot_hi, int32_t j_bits) {
    asm volatile(
        "{\n\t.reg .pred q, q0;\n\t"
        "setp.ge.s32 q, %6, 0;\n\t"
        "setp.eq.and.s32 q0, %7, 0, q;\n\t"
        "@q st.global.b16 [%0], %2;\n\t"
        "@q st.global.b16 [%0+16], %3;\n\t"
        "@q st.global.b16 [%0+32], %4;\n\t"
        "@q st.global.b16 [%0+48], %5;\n\t"
        "@q0 st.global.b32 [%1], %8;\n\t}"
        :
        : "l"(d), "l"(ds), "h"(static_cast<unsigned short>(code[0])), "h"(static_cast<unsigned short>(code[1])),
          "h"(static_cast<unsigned short>(code[2])), "h"(static_cast<unsigned short>(code[3])), "r"(slot_hi), "r"(j_bits),
          "r"(scales)
        : "memory");
}

// Format E rows of the V4.1 shape (D = 128, R = 64; dsv41_row128.cuh): grid = row128_grid,
// block = 256 threads. Lane j's codes of chunk m (4 elements, 16 bits by q3_codes4_raw_kc) are bytes
// 16 m + 2 j and 16 m + 2 j + 1 of the row: each lane stores them itself (4 two-byte stores; the
// row's 64 code bytes are written by its 8 lanes, 16 contiguous bytes per chunk and store
// instruction), and lane 0 of the group stores the row's 4 scale bytes as one word (at its code
// address plus page_size * 64 - 60 row). (Staging the codes in shared memory for one 8-byte
// store per lane costs ~13 more instructions per row set and two warp barriers; the direct stores
// measured 0.5 points faster on the H200.)
// P32 (packed_e_page32, chosen by the launcher): slots that fit 32 bits in power-of-two pages of
// at most 2^24 rows take the page and row by one shift and one mask, with 32-bit offsets inside
// the page; other layouts take page_and_row. With the unmasked codes (the 16-bit stores drop the
// high half) this cut ~20 instructions per row set and measured +1.8 / +2.5 points at G = 32768 /
// 65536 on the H200. P32 also requires the whole cache below 2^32 bytes, so that the
// code address is the cache pointer plus one 32-bit offset page * page_stride + 64 row + 2 j (one
// multiply-add and one 64-bit add instead of a 64-bit product), and P32 stores by predicated
// st.global (st_codes_scales_if) instead of branching around the stores (measured 6.72 -> 6.64 us
// at G = 32768). With the 32-bit source row stride (packed_e_rows32, kRow128Rows32) the 32-bit
// offsets measured 6.64 -> 6.62 us at G = 32768 and 11.52 -> 11.45 us at G = 65536 (either one
// alone was slower: 6.66 / 6.68 us).
inline bool packed_e_page32(const Dsv41PackedInsertParams& p) {
    const uint32_t ps = static_cast<uint32_t>(p.page_size);
    const uint64_t pages = (static_cast<uint64_t>(p.num_slots) + ps - 1) / ps;  // the cache's bytes below 2^32
    return (ps & (ps - 1)) == 0 && ps <= (1u << 24) && static_cast<uint64_t>(p.num_slots) <= 0xffffffffull &&
           pages * static_cast<uint64_t>(p.page_stride) <= 0xffffffffull;
}
// Whether the source rows' stride in bytes fits 32 bits (row128_loop's kRow128Rows32); else the generic kernel.
inline bool packed_e_rows32(const Dsv41PackedInsertParams& p) {
    return 2 * static_cast<uint64_t>(p.src_row_stride) <= 0xffffffffull;
}
// page_shift = log2(page_size), page_mask = page_size - 1, scale_off = page_size * 64 (used by P32
// only): per-launch constants as kernel arguments, read from the constant bank where used; computed
// in the kernel, the shift (FFS: LDC + BREV + FLO) was rematerialized in every row set for want of
// registers (measured -0.06 us at G = 32768 and 65536).
template <Norm N, bool P32>
__global__ void __launch_bounds__(kInsertThreads, kRow128BlocksPerSm) packed_e_row128_kernel(const Dsv41PackedInsertParams p,
                                                                                            const uint32_t page_shift,
                                                                                            const uint32_t page_mask,
                                                                                            const uint32_t scale_off) {
    row128_loop<N, kRow128Rows32>(p, [&](const Row128In& r, const float* w, int, int j, auto&& prefetch) {
        uint32_t h[8], amax2[2];
        // the norm etc., then the next set's loads (no early rows / tree min: slower here, 6.74 ->
        // 6.81 / 6.87 us at G = 32768)
        compute_row128<N, 0>(r, w, p.norm_eps, p.norm_inv_dim, j, h, amax2, prefetch);
        const Q3Blocks qb = q3_blocks_row128(amax2);
        uint32_t scales, code[4];
        if (qb.pairs_ok) {
#pragma unroll
            for (int m = 0; m < 4; ++m) {  // the codes by integer steps (q3_codes4_raw_kc, dsv41_numerics.cuh)
                const Q3Pair qp = q3_pair_from_bits2(qb.sb[m >> 1], m & 1);
                code[m] = q3_codes4_raw_kc(h[2 * m], h[2 * m + 1], qp, q3_codes4_kc(qp));
            }
            scales = prmt(qb.sb[0] >> 7, qb.sb[1] >> 7, 0x6420u);  // bytes k + 127 of blocks 0..3
        } else {  // a block scale above 2^119: the f32 element path
            Row128H8 hh;
#pragma unroll
            for (int i = 0; i < 8; ++i) hh.h[i] = h[i];
            const PackedECodes c = packed_e_codes_element(hh, amax2[0], amax2[1]);
#pragma unroll
            for (int m = 0; m < 4; ++m) code[m] = c.code[m];
            scales = c.scales;
        }
        if constexpr (P32) {
            const uint32_t s = static_cast<uint32_t>(r.slot), row = s & page_mask;
            // the whole cache below 2^32 bytes (packed_e_page32): 32-bit offsets
            uint8_t* d = p.cache + ((s >> page_shift) * static_cast<uint32_t>(p.page_stride) + (row * 64 + 2 * j));
            st_codes_scales_if(d, d + (scale_off - row * 60), code, scales, static_cast<int32_t>(static_cast<uint64_t>(r.slot) >> 32),
                               static_cast<int32_t>(threadIdx.x << 29));
        } else if (r.slot >= 0) {
            int64_t page, row;
            page_and_row(r.slot, p.page_size, page, row);
            uint8_t* base = p.cache + page * p.page_stride;
#pragma unroll
            for (int m = 0; m < 4; ++m) *reinterpret_cast<uint16_t*>(base + row * 64 + 16 * m + 2 * j) = static_cast<uint16_t>(code[m]);
            if (j == 0) *reinterpret_cast<uint32_t*>(base + static_cast<int64_t>(p.page_size) * 64 + row * 4) = scales;
        }
    });
}

template <Norm N, bool P32>
int launch_packed_e_row128_p(const Dsv41PackedInsertParams& p, cudaStream_t s) {
    const int64_t sets = (static_cast<int64_t>(p.num_tokens) + 3) / 4;
    const uint32_t ps = static_cast<uint32_t>(p.page_size);
    const uint32_t shift = ps ? static_cast<uint32_t>(__builtin_ctz(ps)) : 0u;  // log2 for P32's power-of-two pages
    packed_e_row128_kernel<N, P32><<<row128_grid<packed_e_row128_kernel<N, P32>>(sets), kInsertThreads, 0, s>>>(
        p, shift, ps - 1, ps * 64);
    return static_cast<int>(cudaGetLastError());
}
template <Norm N>
int launch_packed_e_row128(const Dsv41PackedInsertParams& p, cudaStream_t s) {
    return packed_e_page32(p) ? launch_packed_e_row128_p<N, true>(p, s) : launch_packed_e_row128_p<N, false>(p, s);
}

// Format B rows of the V4.1 compressed-cache shape (D = 512, R = 64, no norm, power-of-two
// pages) on bf16 pairs: grid = ceil(T / (8 ROWS)), block = 256 threads, one warp per row, ROWS
// rows per warp (loads of all of them first; the slots by cp.async into shared memory). Lane L
// keeps its 16 elements (one Q2 block) as the 8 loaded bf16x2 words; the rotated dims
// [448, 512) (the words of lanes 28..31) go through shared memory so that lane i rotates pair
// i (f32, rounded to bf16 as rope_loaded_row); the block max is a bf16x2 max of |w|
// (NaN-ignoring like fmaxf), the scale byte and value come from the hardware e4m3 conversions
// (q2_scale_hw), and the codes from tie-point comparisons (q2_codes8, no quotient). Lane L
// writes its 8 code bytes as one 8-byte store and its scale byte.
template <int ROWS, int MIN_BLOCKS>
__global__ void __launch_bounds__(kInsertThreads, MIN_BLOCKS) packed_b512_kernel(const Dsv41PackedInsertParams p) {
    __shared__ __align__(16) uint32_t rope_buf[kInsertWarps][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const int64_t t0 = (static_cast<int64_t>(blockIdx.x) * kInsertWarps + warp) * ROWS;
    if (t0 >= p.num_tokens) return;
    uint32_t* buf = rope_buf[warp];
    // The slots go to shared memory by cp.async (lane r fetches row r's): a slot loaded into a
    // register is only needed by the stores, and ptxas sinks such a load below the arithmetic
    // (a second memory latency per row); the copy is issued with the row loads.
    __shared__ __align__(8) int64_t slot_buf[kInsertWarps][ROWS];
    if (lane < ROWS) {
        const int64_t t = t0 + lane < p.num_tokens ? t0 + lane : p.num_tokens - 1;
        const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(&slot_buf[warp][lane]));
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(p.slots + t) : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    RowIn<512> in[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) load_row_data<512>(p, t0 + r, lane, in[r]);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        uint32_t w[8];
        memcpy(w, in[r].raw, sizeof(w));
        if (lane >= 28) {
            reinterpret_cast<uint4*>(buf)[2 * (lane - 28)] = in[r].raw[0];
            reinterpret_cast<uint4*>(buf)[2 * (lane - 28) + 1] = in[r].raw[1];
        }
        __syncwarp();
        {
            const uint32_t v = buf[lane];
            float x0 = bf16x2_lo(v), x1 = bf16x2_hi(v);
            rotate_pair(x0, x1, in[r].cos, in[r].sin);
            buf[lane] = pack_bf16x2_rn(x0, x1);  // lane-private word: no hazard
        }
        __syncwarp();
        if (lane >= 28) {
            const uint4 a = reinterpret_cast<const uint4*>(buf)[2 * (lane - 28)];
            const uint4 b = reinterpret_cast<const uint4*>(buf)[2 * (lane - 28) + 1];
            w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
            w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
        }
        __syncwarp();  // buf is reused by the next row
        uint32_t m = w[0] & 0x7fff7fffu;
#pragma unroll
        for (int i = 1; i < 8; ++i) m = bf16x2_max(m, w[i] & 0x7fff7fffu);
        const Q2Scale sc = q2_scale_hw(fmaxf(bf16x2_lo(m), bf16x2_hi(m)));
        const Q2Pair tp = q2_pair(sc.s);
        const uint32_t out0 = q2_codes8(w[0], w[1], w[2], w[3], tp), out1 = q2_codes8(w[4], w[5], w[6], w[7], tp);
        if (r == 0) {
            asm volatile("cp.async.wait_all;\n" ::: "memory");
            __syncwarp();
        }
        const int64_t slot = slot_buf[warp][r];
        if (t0 + r < p.num_tokens && slot >= 0 && slot < p.num_slots) {
            uint8_t* base = p.cache + (slot >> (__ffs(p.page_size) - 1)) * p.page_stride;  // power-of-two pages
            const int64_t row = slot & (p.page_size - 1);
            *reinterpret_cast<uint2*>(base + row * 256 + lane * 8) = make_uint2(out0, out1);
            base[(static_cast<int64_t>(p.page_size) * 8 + row) * 32 + lane] = static_cast<uint8_t>(sc.code);
        }
    }
}

// grid.x = ceil(T / (8 * ROWS)), block = 256 threads (8 warps, ROWS tokens each); MIN_BLOCKS:
// the resident blocks per SM the registers are capped for (__launch_bounds__), 0 = no cap
// (an explicit 1 is not the same: it let ptxas give the format A kernel 50 registers instead of
// 40, 4 resident blocks instead of 6, and cost it 10 points of the read ceiling on the H200).
template <int D, int ROWS, Quant Q, Norm N, int MIN_BLOCKS = 0>
__global__ void __launch_bounds__(kInsertThreads, MIN_BLOCKS) packed_insert_kernel(const Dsv41PackedInsertParams p) {
    __shared__ float squares[N != Norm::None ? kInsertWarps : 1][N != Norm::None ? D : 1];
    float* smem = N != Norm::None ? squares[threadIdx.x / 32] : nullptr;
    warp_rows<D, ROWS, N>(p, smem, [&](const RowIn<D>& r, float (&x)[D / 32]) {
        constexpr int kDataBytes = Q == Quant::Fp8Ue8m0B32 ? D : D / 2;
        constexpr int kScaleBytes = D / QuantTraits<Q>::kBlock;
        int64_t page, row;
        page_and_row(r.slot >= 0 ? r.slot : 0, p.page_size, page, row);
        uint8_t* base = p.cache + page * p.page_stride;
        pack_row<D, Q>(x, threadIdx.x & 31, r.slot >= 0, base + row * kDataBytes,
                       base + static_cast<int64_t>(p.page_size) * kDataBytes + row * kScaleBytes);
    });
}

}  // namespace dsv41

// ------------------------------------------------------------------------------------ launcher

namespace {

template <int D, dsv41::Quant Q>
int launch_packed(const Dsv41PackedInsertParams* p, cudaStream_t s) {
    using namespace dsv41;
    return with_insert_rows<D>(p->num_tokens, false, [&](auto rows) -> int {
        constexpr int ROWS = decltype(rows)::value;
        const dim3 grid(insert_blocks(p->num_tokens, ROWS));
        // Format B rows (512-wide, Q2, no norm): the bf16-pair kernel for R = 64 and power-of-two
        // pages (56.6 -> 76.9 % of the read ceiling, measured on the H200); else the generic
        // kernel capped at 32 registers (no spills) for 8 resident blocks per SM instead of 6
        // (instruction-bound, it gained ~2 points).
        if constexpr (ROWS == 1 && D == 512 && Q == Quant::Fp4E4m3B16) {
            if (!p->apply_norm && p->rope_dim == 64 && (p->page_size & (p->page_size - 1)) == 0) {
                // Two rows per warp, 6 resident blocks (40 registers); the alternatives measured
                // one row / 8 blocks 77.4 %, two rows / 4 blocks 74.7 %.
                const dim3 grid2(insert_blocks(p->num_tokens, 2));
                packed_b512_kernel<2, 6><<<grid2, kInsertThreads, 0, s>>>(*p);
                return static_cast<int>(cudaGetLastError());
            }
            if (!p->apply_norm) {
                packed_insert_kernel<D, ROWS, Q, Norm::None, 8><<<grid, kInsertThreads, 0, s>>>(*p);
                return static_cast<int>(cudaGetLastError());
            }
        }
        if (p->apply_norm) packed_insert_kernel<D, ROWS, Q, Norm::Weighted><<<grid, kInsertThreads, 0, s>>>(*p);
        else packed_insert_kernel<D, ROWS, Q, Norm::None><<<grid, kInsertThreads, 0, s>>>(*p);
        return static_cast<int>(cudaGetLastError());
    });
}

}  // namespace

extern "C" int dsv41_packed_insert(const Dsv41PackedInsertParams* p, size_t params_size, void* stream) {
    using namespace dsv41;
    if (params_size != sizeof(Dsv41PackedInsertParams)) return DSV41_ERR_PARAMS_SIZE;
    if (p->num_tokens < 0 || p->num_slots < 0 || p->page_size < 1) return DSV41_ERR_SHAPE;
    const int d = p->head_dim;
    if (d != 64 && d != 128 && d != 256 && d != 512) return DSV41_ERR_HEAD_DIM;
    if (p->rope_dim <= 0 || p->rope_dim % 2 != 0 || p->rope_dim > d) return DSV41_ERR_ROPE_DIM;
    int data, scales;
    switch (p->quant) {
        case DSV41_QUANT_FP8_UE8M0_B32: data = d; scales = d / 32; break;
        case DSV41_QUANT_FP4_E4M3_B16: data = d / 2; scales = d / 16; break;
        case DSV41_QUANT_FP4_UE8M0_B32: data = d / 2; scales = d / 32; break;
        default: return DSV41_ERR_QUANT;
    }
    if (p->page_stride < static_cast<int64_t>(p->page_size) * (data + scales)) return DSV41_ERR_SHAPE;
    if (p->num_tokens == 0) return DSV41_OK;
    if (!p->src || !p->cos || !p->sin || !p->slots || !p->cache) return DSV41_ERR_NULL;
    if (p->apply_norm && !p->norm_weight) return DSV41_ERR_NULL;
    const int align = 2 * (d / 32 < 8 ? d / 32 : 8);
    if (p->src_row_stride < d || !aligned_rows(p->src, p->src_row_stride, align)) return DSV41_ERR_ALIGNMENT;
    if (reinterpret_cast<uintptr_t>(p->cache) % 16 != 0 || p->page_stride % 16 != 0) return DSV41_ERR_ALIGNMENT;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return with_head_dim(d, [&](auto dd) -> int {
        constexpr int D = decltype(dd)::value;
        switch (p->quant) {
            case DSV41_QUANT_FP8_UE8M0_B32: return launch_packed<D, Quant::Fp8Ue8m0B32>(p, s);
            case DSV41_QUANT_FP4_E4M3_B16: return launch_packed<D, Quant::Fp4E4m3B16>(p, s);
            default:
                if constexpr (D == 128) {
                    if (row128_applies(*p) && packed_e_rows32(*p))
                        return p->apply_norm ? launch_packed_e_row128<Norm::Weighted>(*p, s)
                                             : launch_packed_e_row128<Norm::None>(*p, s);
                }
                return launch_packed<D, Quant::Fp4Ue8m0B32>(p, s);
        }
    });
}
