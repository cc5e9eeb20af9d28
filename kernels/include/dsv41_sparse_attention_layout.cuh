// Constants, shared memory map, swizzles and trace slots of the sparse attention kernel
// (kernels/sparse_attention.cu; the design is in its header comment). Included by that file and
// by dsv41_sparse_attention_epilogue.cuh only (defines the __device__ trace buffer).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "dsv41_sparse_attention_common.cuh"

namespace dsv41_sa {

constexpr int HB = 64;          // heads per CTA
constexpr int THREADS = 256;    // compute threads: 8 warps = 2 warpgroups (the producer warpgroup: threads 256..383)
static_assert(THREADS == IDX_THREADS, "the compute threads compact the indices");
constexpr int PROD_REGS = 40;      // its registers after setmaxnreg (2 x 232 + 40 = 3 x 168; the packed-row expansion
                                   // spills 12 bytes at 40, but 56 / 224 made bf16 decode ~1.2 us slower)
constexpr int MMA_REGS = 232;      // the compute warpgroups' registers after setmaxnreg
constexpr int MAX_SPLITS = 8;   // portable cluster size

// Shared memory map (bytes). q and row tiles in the wgmma 128-byte-swizzle canonical layout:
// 8 planes of 64 dims, [dims / 64][row][128 bytes, 16-byte chunk c at c ^ (row & 7)] (8 KB per
// plane); K-major for Q.K^T (A = q, B = rows), MN-major for P.V (B = rows).
static_assert(HB == BLK, "the q tile has the row tile's shape");
constexpr int SM_Q = 0;                         // bf16 [64 heads][512]
constexpr int SM_K = SM_Q + TILEB;              // bf16 [2 stages][64 rows][512]
constexpr int PTILE = HB * BLK * 2;            // one P tile: bf16 [64 heads][64 rows], 128-byte swizzle
constexpr int SM_P = SM_K + 2 * TILEB;          // P tiles [2 tile parities] (epilogue: f32 [S][64] merge factors)
constexpr int SM_M = SM_P + 2 * PTILE;          // f32 [2 ping-pong][64 heads]: running max (after tile j: slot (j + 1) & 1)
constexpr int SM_ALPHA = SM_M + 2 * HB * 4;     // f32 [2 tile parities][64 heads]: e^{m_old - m_new} of tile j
constexpr int SM_DEN = SM_ALPHA + 2 * HB * 4;   // f32 [2 warpgroups][64 heads]: denominators
constexpr int SM_STAT = SM_DEN + 2 * HB * 4;    // f32 [2][64 heads]: (m, den) published to the cluster
constexpr int SM_CNT = SM_STAT + 2 * HB * 4;    // i32 [MAX_ROUNDS * 8] per-warp valid counts -> offsets
constexpr int SM_TOTAL = SM_CNT + MAX_ROUNDS * 8 * 4;  // i32 [1]: valid rows of the token
constexpr int SM_BAR = SM_TOTAL + 16;           // u64 [7] mbarriers: full[2], empty[2] (stage hand-over), rx (epilogue),
                                                // p_ready[2] (P tile hand-over between the compute warpgroups)
constexpr int SM_SINK = SM_BAR + 64;           // f32 [64 heads]: sink (cp.async with q)
constexpr int SM_ENT = SM_SINK + HB * 4;        // u32 [range]: (source << 31) | row
constexpr int SM_O = 0;                         // S > 2 epilogue: f32 [S slots][ceil(64 / S) heads][512] (over q + stage 0), swizzled
// S <= 2 epilogue (over q and the stages, free after the last tile): the chunk a CTA sends to
// the other = f32 [32 rows: hs <= 32 heads][512] raw O (sw2k layout) + f32 m[32] + f32 den[32];
// SM_RX receives the other CTA's chunk, SM_TX stages this CTA's; SM_OUTB2 (S = 2) or 0 (S = 1):
// bf16 [hs][512] out rows, 1040-byte stride (conflict-free fragment stores, 16-byte row reads).
constexpr int OROW = D * 4;                     // f32 O row bytes
constexpr int XSTAT = 256;                      // stats block of a chunk
constexpr int SM_RX = 0;
constexpr int SM_TX = 65 * 1024;
constexpr int OUTB_STRIDE = D * 2 + 16;
constexpr int SM_OUTB2 = 130 * 1024;            // S = 2 (S = 1: at 0, no chunks)
static_assert(SM_RX + (HB / 2) * OROW + XSTAT <= SM_TX && SM_TX + (HB / 2) * OROW + XSTAT <= SM_OUTB2, "epilogue chunks overlap");
static_assert(SM_OUTB2 + (HB / 2) * OUTB_STRIDE <= SM_P && HB * OUTB_STRIDE <= SM_P, "epilogue out rows overlap the P tile");
static_assert(SM_P % 1024 == 0 && SM_K % 1024 == 0, "wgmma operand tiles start on 1024-byte boundaries");
static_assert(SM_ENT + 4 * MAX_INDICES <= 227 * 1024, "shared memory of the largest index count");
// The pushed partial tiles (S slots of ceil(64 / S) f32 head rows, at most 7 x 10) stay below SM_P.
static_assert(SM_O + 7 * 10 * D * 4 <= SM_P && SM_O + HB * D * 4 <= SM_P, "partial O tiles overlap the P tile");

// Phase timestamps (SM clock) of CTA (0, 0, 0) in a traced call (the DIAG instantiation of a
// diagnostic build, DSV41_SPARSE_ATTENTION_TRACE=1), thread 0 unless said: [0] start, [23] indices loaded, [1]
// compaction done; per tile j < 16, by thread 0 / 128 of its owner warpgroup j % 2: [24 + j] its
// rows arrived, [48 + j] S_j done, [2 + j] P_j published; [22] thread 0's tile loop done; S > 2:
// [21] / [19] first / second cluster barrier passed, [18] partial tiles pushed + factors merged;
// S <= 2: [21] chunk staged, [18] chunk received, [44] second barrier, [41] / [42] / [43] factors
// / sync / combine; [20] end.
constexpr int TRACE_SLOTS = 64;
__device__ long long g_trace[TRACE_SLOTS];

// Barrier of the 256 compute threads only (named barrier 1; the producer warpgroup never joins).
__device__ __forceinline__ void compute_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory"); }
// Barrier of compute warpgroup w's 128 threads (named barriers 2, 3).
__device__ __forceinline__ void wg_sync(int w) { asm volatile("bar.sync %0, 128;\n" ::"r"(2 + w) : "memory"); }

// Byte offset of 16-byte chunk `c` (0..63) of row `r` in a q / row tile (64 rows).
__device__ __forceinline__ uint32_t wgsw(int r, int c) { return wgsw_rows<BLK>(r, c); }
// Same for the f32 O tile (2048-byte rows, 128 chunks): chunk c at c ^ 2 (row & 7) (8-byte
// fragment stores of four rows and 16-byte loads of eight consecutive chunks are both free of
// bank conflicts).
__device__ __forceinline__ uint32_t sw2k(int r, int c) { return static_cast<uint32_t>(r * 2048 + ((c ^ ((r & 7) << 1)) << 4)); }

}  // namespace dsv41_sa
