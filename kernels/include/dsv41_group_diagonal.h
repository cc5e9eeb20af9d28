// Parameter block of kernels/group_diagonal.cu (the diagonal blocks of a stacked grouped product,
// nn::GroupedLinear). Same conventions as dsv41_params.h; the Rust mirror is
// crates/deepseek-v41/src/cuda/group_diagonal.rs and the launcher refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const void* y;   // [G·T, G·og] contiguous, `elem` bytes per element
    void* out;       // [T, G·og] out
    int64_t t;       // T >= 1
    int64_t og;      // >= 1
    int32_t groups;  // G >= 1
    int32_t elem;    // 2 or 4 (bytes per element)
} Dsv41GroupDiagonalParams;

int dsv41_group_diagonal(const Dsv41GroupDiagonalParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
