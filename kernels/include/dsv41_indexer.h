// Parameter blocks and launchers of the lightning indexer kernels (spec §6.3-§6.4, §0.1b.1-2):
// kernels/indexer_scores.cu (index scores, candidate-block bitmask) and kernels/indexer_select.cu
// (top-k / candidate blocks of a score row). Mirrored by crates/deepseek-v41/src/cuda/ffi.rs
// (`IndexerScoresParams`, `IndexerMaskParams`, `IndexerSelectParams`); field order and types are
// ABI (8-byte fields first). Status codes: dsv41_params.h.
//
// Notation: T = tokens of the launch, H = index heads (1..32), D = 128 (index head dim),
// N = score columns (entries), L_t = visible entries of token t (see `visible`).
#pragma once
#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

// Key row formats of the index-key cache.
enum Dsv41IndexKeyFormat {
    DSV41_INDEX_KEYS_BF16 = 0,    // bf16 rows [R, D], row r at keys + r * key_row_stride (elements)
    DSV41_INDEX_KEYS_MXFP4 = 1,   // packed 68 B rows (spec §7.2 E) in pages of page_size slots:
                                  // page p = [page_size x 64 B e2m1 pairs][page_size x 4 B ue8m0],
                                  // page p at keys + p * key_row_stride (bytes)
};

// Visible entries of token t: L_t = min(N, visible[t]) when `visible` is set, else
// min(N, (start + t + 1) / ratio) (the causal rule j < (p + 1) div r of one sequence).
//
// S[t, j] = bf16( sum_{h=0..H-1, in order} bf16( relu(bf16(q[t,h] . K[row(t, j)])) * w[t,h] ) )
//           for j < L_t and (allowed == NULL or bit j / allowed_block of allowed[t] is set),
//           -inf otherwise; row(t, j) = (key_base ? key_base[t] : 0) + j, and a row >= num_key_rows
//           also gives -inf (never read). With a page table (key_base NULL): row(t, j) =
//           page_table[t * page_table_stride + j / P] * P + j % P (P = table_page_size, a power of
//           two); a visible entry's page must lie in the cache (else its score is unspecified: it
//           reads row 0, never past the cache).
// Launches without key_base and page_table of at least DSV41_INDEXER_SHARED_KEY_TOKENS tokens (prefill over one
// sequence's keys) score 4 tokens per CTA; all others one token per CTA (decode shapes).
#define DSV41_INDEXER_SHARED_KEY_TOKENS 528
typedef struct {
    const void* q;             // bf16 [T, H, D], contiguous
    const float* w;            // f32 [T, H], contiguous (bf16-exact head weights)
    const void* keys;          // key cache, see Dsv41IndexKeyFormat
    const uint32_t* key_base;  // u32 [T] first key row / slot of token t, or NULL (0)
    const uint32_t* visible;   // u32 [T] visible entries of token t, or NULL (causal rule)
    const uint32_t* allowed;   // u32 [T, allowed_words] bitmask of allowed blocks, or NULL (all)
    const int64_t* page_table; // i64 [T, >= ceil(N / P)] pages of token t's entries, or NULL (key_base)
    void* scores;              // bf16 [T, N], row t at scores + t * score_row_stride
    int64_t key_row_stride;    // bf16: elements between rows (multiple of 8); mxfp4: page bytes (< 2^32)
    int64_t num_key_rows;      // R: rows (bf16) or slots (mxfp4, < 2^32) the cache holds
    int64_t score_row_stride;  // elements (multiple of 8, >= N)
    int64_t start;             // position of token 0 (causal rule)
    int64_t page_table_stride; // elements between two tokens' page-table rows
    int32_t num_tokens;        // T
    int32_t num_heads;         // H in 1..=32
    int32_t head_dim;          // D (128 only)
    int32_t num_cols;          // N
    int32_t key_format;        // Dsv41IndexKeyFormat
    int32_t page_size;         // mxfp4: slots per page (multiple of 4)
    int32_t ratio;             // causal rule divisor (>= 1)
    int32_t allowed_words;     // u32 words per token of `allowed`
    int32_t allowed_block;     // entries per allowed block (>= 1)
    int32_t table_page_size;   // P: entries per page-table page (power of two; with page_table)
} Dsv41IndexerScoresParams;

// allowed[t, :] = bitmask of the blocks listed in blocks[t, :] (i64, -1 = none; ids outside
// [0, 32 * words) are ignored).
typedef struct {
    const int64_t* blocks;     // i64 [T, n_blocks], contiguous
    uint32_t* allowed;         // u32 [T, words], contiguous
    int32_t num_tokens;        // T
    int32_t n_blocks;          // kept-block columns
    int32_t words;             // u32 words per token (<= 12288)
    int32_t _pad;
} Dsv41IndexerMaskParams;

// Order key of a bf16 score (larger key = larger score, the order of f32::total_cmp): u = bits |
// 0x8000 for a clear sign bit, ~bits (16 bits) otherwise. The selection is a radix selection on
// u: an 11-bit high digit u >> 5 (DSV41_SELECT_HIST_BINS bins; -inf: bin 3) and a 5-bit low digit.
#define DSV41_SELECT_HIST_BINS 2048
// Top-k launches with N <= DSV41_TOPK_MAX_N and k <= DSV41_TOPK_MAX_K run the one-read kernel of
// kernels/indexer_topk.cu; the others (and candidate blocks) kernels/indexer_select.cu's.
#define DSV41_TOPK_MAX_N 65536
#define DSV41_TOPK_MAX_K 2048
//
// Selection modes of dsv41_indexer_select.
enum Dsv41SelectMode {
    // Top-k entries: the best min(k, L_t) of S[t, 0..L_t) (descending score, ties -> lower id,
    // -inf entries included), written ascending, -1 padded to k.
    DSV41_SELECT_TOPK = 0,
    // Candidate blocks (§6.4): element b = max of S[t, b*block .. min((b+1)*block, L_t)) for
    // b < ceil(L_t / block), the block of entry L_t - 1 pinned to +inf; the best min(k, n) with
    // ties -> lower id, only those with a score > -inf kept, written ascending, -1 padded to k.
    DSV41_SELECT_BLOCKS = 1,
};

typedef struct {
    const void* scores;        // bf16 [T, N], row t at scores + t * score_row_stride
    const uint32_t* visible;   // u32 [T] or NULL (causal rule, as in the scores params)
    int64_t* out;              // i64 [T, k], row t at out + t * out_row_stride
    int64_t score_row_stride;  // elements (multiple of 8)
    int64_t out_row_stride;    // elements
    int64_t start;             // causal rule
    int32_t num_tokens;        // T
    int32_t num_cols;          // N
    int32_t k;                 // outputs per token (>= 1)
    int32_t mode;              // Dsv41SelectMode
    int32_t block;             // entries per block (blocks mode, >= 1)
    int32_t ratio;             // causal rule divisor (>= 1)
} Dsv41IndexerSelectParams;

int dsv41_indexer_scores(const Dsv41IndexerScoresParams* p, size_t params_size, void* stream);
int dsv41_indexer_allowed_mask(const Dsv41IndexerMaskParams* p, size_t params_size, void* stream);
int dsv41_indexer_select(const Dsv41IndexerSelectParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
