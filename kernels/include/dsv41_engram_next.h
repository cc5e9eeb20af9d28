// Parameter block of kernels/engram_next.cu (the tokens and Engram row ids of a decode step that
// follows the last one on the device, model::engram_next). Same conventions as dsv41_params.h:
// 8-byte fields first, then 4-byte fields; the Rust mirror is
// crates/deepseek-v41/src/cuda/engram_next.rs and the launcher refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const uint32_t* sampled;  // [rows]: the tokens the last step sampled
    const uint32_t* map;      // [vocab]: compressed id of each token (NULL when layers = 0)
    const int64_t* tables;    // [layers, ngram + 2·cols]: multipliers, primes, offsets (NULL when layers = 0)
    uint32_t* buf;            // [batch + layers·batch·cols + batch·(ngram − 1)] in/out: tokens, row ids, history
    int32_t batch;            // B >= rows
    int32_t rows;             // the first rows are written, >= 0
    int32_t layers;           // Engram layers in buf, >= 0
    int32_t cols;             // (ngram − 1)·heads
    int32_t ngram;            // >= 2 with layers > 0
    int32_t heads;            // >= 1 with layers > 0
    int32_t vocab;            // entries of map, >= 1 with layers > 0
} Dsv41EngramNextParams;

int dsv41_engram_next(const Dsv41EngramNextParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
