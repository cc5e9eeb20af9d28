// Parameter blocks of the deepseek-v41 CUDA kernels (FlashMLA `params.h` style).
//
// Every launcher takes one of these structs by pointer together with `sizeof` as the caller
// sees it (the Rust mirror in crates/deepseek-v41/src/cuda/ffi.rs), so a layout drift between
// the two languages is reported instead of silently misread. Field order: all 8-byte fields
// first, then 4-byte fields, so that C and Rust `#[repr(C)]` lay them out identically.
//
// Notation: T = num_tokens, D = head_dim, R = rope_dim, S = num_slots, H = num_heads.
// Strides are in elements, not bytes. "bf16" is __nv_bfloat16 / half::bf16.
#pragma once
#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// How a row is fake-quantized before it is stored (spec §2.3). Values are ABI.
enum Dsv41Quant {
    DSV41_QUANT_NONE = 0,          // store the RoPE'd bf16 row as is
    DSV41_QUANT_FP8_UE8M0_B32 = 1, // Q1: e4m3 elements, power-of-two scale, block 32 (window KV)
    DSV41_QUANT_FP4_E4M3_B16 = 2,  // Q2: e2m1 elements, e4m3 scale, block 16 (compressed KV)
    DSV41_QUANT_FP4_UE8M0_B32 = 3, // Q3: e2m1 elements, power-of-two scale, block 32 (index keys)
};

// Launcher return codes besides 0 (success) and positive cudaError_t values.
enum Dsv41Status {
    DSV41_OK = 0,
    DSV41_ERR_PARAMS_SIZE = -1,  // params_size != sizeof(struct): Rust/C layout mismatch
    DSV41_ERR_HEAD_DIM = -2,     // head_dim not in {64, 128, 256, 512}
    DSV41_ERR_ROPE_DIM = -3,     // rope_dim odd, zero or > head_dim
    DSV41_ERR_QUANT = -4,        // quant value unknown, or not allowed by this launcher
    DSV41_ERR_ALIGNMENT = -5,    // a row pointer or row stride breaks the vector alignment
    DSV41_ERR_NULL = -6,         // a required pointer is NULL
    DSV41_ERR_SHAPE = -7,        // a count is negative / too large
};

// One row per token: [RMSNorm] -> GPT-J RoPE on the last R dims -> [fake quant] -> scatter
// into a row cache. Used by window_insert, compressed_insert and index_key_insert.
typedef struct {
    // bf16 [T, D]: source rows, row t at src + t * src_row_stride. 16-byte aligned rows
    // (or 2*D/32 bytes when that is smaller).
    const void* src;
    // f32 [T, R/2], contiguous: cos of the angle of token t's position, pair i at cos[t*R/2 + i].
    const float* cos;
    // f32 [T, R/2], contiguous: sin, same indexing as cos.
    const float* sin;
    // i64 [T]: destination row of token t in the cache; a value < 0 or >= num_slots skips the
    // token (nothing is written). Non-negative values must be unique within a call.
    const int64_t* slots;
    // f32 [D]: RMSNorm weight applied before RoPE, or NULL. Only read when apply_norm != 0.
    const float* norm_weight;
    // bf16 [S, D]: the cache, row s at cache + s * cache_row_stride. Same alignment as src.
    void* cache;
    int64_t src_row_stride;   // elements between consecutive source rows (>= D)
    int64_t cache_row_stride; // elements between consecutive cache rows (>= D)
    int64_t num_slots;        // S
    int32_t num_tokens;       // T (>= 0; 0 launches nothing)
    int32_t head_dim;         // D in {64, 128, 256, 512}
    int32_t rope_dim;         // R: even, 0 < R <= D; RoPE rotates dims [D-R, D)
    int32_t quant;            // enum Dsv41Quant
    int32_t apply_norm;       // 0: no norm; 1: RMSNorm x / sqrt(mean(x^2) + eps) [* weight]
    float norm_eps;           // eps of the norm, as f32
    float norm_inv_dim;       // (float)(1.0 / D), the mean's factor as candle computes it
    int32_t _pad;             // keeps sizeof a multiple of 8 on both sides
} Dsv41RowInsertParams;

// Query RoPE: GPT-J rotation of the last R dims of every head of q [T, H, D], optionally after
// a weightless per-head RMSNorm (V4.0's q norm; off for V4.1), written in place (out == q) or to
// a separate tensor.
typedef struct {
    // bf16 [T, H, D]: element (t, h, d) at q + t * q_token_stride + h * q_head_stride + d.
    const void* q;
    // bf16 [T, H, D]: output, element (t, h, d) at out + t * out_token_stride + h * out_head_stride
    // + d. May be the same memory as q with the same strides (in place); other overlaps are not
    // allowed.
    void* out;
    // f32 [T, R/2], contiguous: cos of token t's angles.
    const float* cos;
    // f32 [T, R/2], contiguous: sin of token t's angles.
    const float* sin;
    int64_t q_token_stride;   // elements
    int64_t q_head_stride;    // elements
    int64_t out_token_stride; // elements
    int64_t out_head_stride;  // elements
    int32_t num_tokens;       // T
    int32_t num_heads;        // H
    int32_t head_dim;         // D in {64, 128, 256, 512}
    int32_t rope_dim;         // R: even, 0 < R <= D
    int32_t apply_norm;       // 0 or 1 (weightless per-head RMSNorm before RoPE)
    float norm_eps;           // eps of the norm
    float norm_inv_dim;       // (float)(1.0 / D)
    int32_t _pad;
} Dsv41QRopeParams;

// Packed insert (spec §7.2, formats A, B and E): the same pipeline as Dsv41RowInsertParams, but
// the quantized row is stored as element codes plus one scale byte per block, in pages of
// `page_size` tokens whose data and scale regions are segregated:
//
//   page p (at cache + p * page_stride bytes):
//     [page_size rows x row_data_bytes][page_size rows x row_scale_bytes]
//   slot s -> page s / page_size, row s % page_size
//
//   format (quant)            row_data_bytes        row_scale_bytes   D = 512 / 128
//   A  FP8_UE8M0_B32 (window) D e4m3 bytes          D/32 ue8m0        528 B
//   B  FP4_E4M3_B16 (compr.)  D/2 e2m1 pairs        D/16 e4m3         288 B
//   E  FP4_UE8M0_B32 (index)  D/2 e2m1 pairs        D/32 ue8m0        68 B (D = 128)
//
// Two e2m1 codes per byte, the even element in the low nibble; ue8m0 byte = exponent + 127.
typedef struct {
    // bf16 [T, D]: source rows, row t at src + t * src_row_stride.
    const void* src;
    // f32 [T, R/2], contiguous.
    const float* cos;
    // f32 [T, R/2], contiguous.
    const float* sin;
    // i64 [T]: destination slot of token t; outside [0, num_slots): skipped. Unique.
    const int64_t* slots;
    // f32 [D]: RMSNorm weight (apply_norm != 0), or NULL.
    const float* norm_weight;
    // u8 [num_slots / page_size, page_stride]: the paged cache (16-byte aligned pages).
    uint8_t* cache;
    int64_t src_row_stride;   // elements
    int64_t page_stride;      // bytes between pages (>= page_size * (row_data_bytes + row_scale_bytes)), multiple of 16
    int64_t num_slots;        // pages * page_size
    int32_t num_tokens;       // T
    int32_t head_dim;         // D in {64, 128, 256, 512}
    int32_t rope_dim;         // R
    int32_t quant;            // DSV41_QUANT_FP8_UE8M0_B32, _FP4_E4M3_B16 or _FP4_UE8M0_B32
    int32_t apply_norm;       // 0 or 1 (RMSNorm with norm_weight before RoPE)
    int32_t page_size;        // tokens per page (>= 1)
    float norm_eps;
    float norm_inv_dim;
} Dsv41PackedInsertParams;

// Launchers (each in its own .cu). `stream` is a cudaStream_t / CUstream. Return 0, a negative
// Dsv41Status or a positive cudaError_t.
int dsv41_window_insert(const Dsv41RowInsertParams* p, size_t params_size, void* stream);
int dsv41_compressed_insert(const Dsv41RowInsertParams* p, size_t params_size, void* stream);
int dsv41_index_key_insert(const Dsv41RowInsertParams* p, size_t params_size, void* stream);
int dsv41_packed_insert(const Dsv41PackedInsertParams* p, size_t params_size, void* stream);
int dsv41_q_rope(const Dsv41QRopeParams* p, size_t params_size, void* stream);
// Text of a positive cudaError_t value (NULL-safe: never NULL).
const char* dsv41_cuda_error_string(int code);

#ifdef __cplusplus
}
#endif
