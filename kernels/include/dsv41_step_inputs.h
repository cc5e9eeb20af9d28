// Parameter block of kernels/step_inputs.cu (the batched decode step's position-derived inputs,
// attention::DecodeStepInputs::derive). Same conventions as dsv41_params.h: 8-byte fields first,
// then 4-byte fields; the Rust mirror is crates/deepseek-v41/src/cuda/step_inputs.rs and the
// launcher refuses a size mismatch.
#pragma once
#include <stdint.h>
#include <stddef.h>

#include "dsv41_params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const int64_t* positions;        // [rows]: p
    const int64_t* entry_positions;  // [rows]: the closing entry's position (compressed only)
    const int64_t* entry_slots;      // [rows]: its pool slot, < 0 when no group closes (compressed only)
    const int64_t* visible_in;       // [rows]: the entries p sees (compressed only)
    const float* inv_freq;           // [half] f32
    float* cos;                      // [rows, half] out: cos(f32(p)·inv_freq)
    float* sin;                      // [rows, half] out
    float* neg_sin;                  // [rows, half] out: −sin
    int64_t* window_indices;         // [rows, window] out: ring slots of p − W + 1 ..= p, −1 below 0
    float* entry_cos;                // [rows, half] out (compressed only, else NULL)
    float* entry_sin;                // [rows, half] out
    uint8_t* closing;                // [rows] out: entry_slots >= 0
    uint32_t* visible;               // [rows] out: (u32) visible_in
    int64_t rows;                    // >= 0
    int64_t window_stride;           // slots between two rows' window regions (row b's base: b·stride)
    int32_t half;                    // rope_dim / 2, >= 1
    int32_t window;                  // W >= 1
} Dsv41StepInputsParams;

int dsv41_step_inputs(const Dsv41StepInputsParams* p, size_t params_size, void* stream);

#ifdef __cplusplus
}
#endif
