// Parameter block of kernels/page_rows.cu (the batched decode step's top-k entries mapped to
// page-pool rows, attention::page_rows). Same conventions as dsv41_params.h; the Rust mirror is
// crates/deepseek-v41/src/cuda/page_rows.rs and the launcher refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const int64_t* topk;        // [rows, k]: entry ids, < 0 for none
    const int64_t* page_table;  // [rows, max_pages]: each row's pages, -1 past those it holds
    int64_t* out;               // [rows, k]: pool rows table[b][j / P]·P + j mod P, -1 for none
    int64_t rows;               // >= 0
    int32_t k;                  // >= 1
    int32_t max_pages;          // >= 1
    int32_t page;               // P >= 1
    int32_t _pad;
} Dsv41PageRowsParams;

int dsv41_page_rows(const Dsv41PageRowsParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
