// dsv41_cuda_error_string: the text of a cudaError_t returned by one of the launchers, for the
// Rust side's error messages (src/cuda/ffi.rs). Lives here so that the Rust crate needs no
// binding to the CUDA runtime of its own.
#include <cuda_runtime.h>

#include "include/dsv41_params.h"

extern "C" const char* dsv41_cuda_error_string(int code) {
    const char* s = cudaGetErrorString(static_cast<cudaError_t>(code));
    return s ? s : "unknown CUDA error";
}
