#!/usr/bin/env bash
# Installs the CUDA 13.0 compiler toolchain (nvcc, ptxas, NVVM, cudart, CCCL, NVRTC, cuBLAS, cuRAND)
# from PyPI wheels into a gitignored prefix inside the repository, so that
# `cargo build --features cuda` works on a machine without a GPU or a system CUDA install.
#
# Idempotent: a stamp file records the pinned requirement; re-running is a no-op once it matches.
#
#   scripts/install-cuda.sh            # install (or verify) and print the environment to export
#   source scripts/cuda-env.sh         # install if needed and export the environment in this shell
#
# Prefix: $DSV41_CUDA_PREFIX, default <repo>/.cuda (gitignored). CUDA_HOME = $PREFIX/nvidia/cu13.
#
# Why 13.0.x: the H200 driver (580) is CUDA 13.0 and cannot JIT PTX from newer compilers, and
# cudarc 0.19 refuses newer toolkits. The link-time stub libcuda.so (below) is only for linking;
# at run time the real driver library must be found instead (never put the stub on
# LD_LIBRARY_PATH).
set -euo pipefail

REQ='cuda-toolkit[nvcc,crt,nvvm,cudart,cccl,nvrtc,cublas,curand]==13.0.2'
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${DSV41_CUDA_PREFIX:-$REPO/.cuda}"
HOME_CU="$PREFIX/nvidia/cu13"
STAMP="$PREFIX/.installed"
STAMP_CONTENT="$REQ stub-v1"
PYTHON="${PYTHON:-python3}"

log() { echo "install-cuda: $*" >&2; }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_CONTENT" && -x "$HOME_CU/bin/nvcc" \
      && -f "$HOME_CU/lib/stubs/libcuda.so" ]]; then
    log "already installed in $PREFIX"
else
    log "installing $REQ into $PREFIX"
    mkdir -p "$PREFIX"
    rm -f "$STAMP"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
        --upgrade --target "$PREFIX" "$REQ"
    [[ -x "$HOME_CU/bin/nvcc" ]] || { log "nvcc not found at $HOME_CU/bin/nvcc after install"; exit 1; }

    # nvcc.profile searches $CUDA_HOME/lib64 (and lib64/stubs); the wheels install lib/.
    if [[ ! -e "$HOME_CU/lib64" ]]; then ln -s lib "$HOME_CU/lib64"; fi

    # The wheels ship only the SONAME files (libfoo.so.13); the linker wants libfoo.so.
    for base in libcudart libnvrtc libcublas libcublasLt libcurand; do
        if [[ ! -e "$HOME_CU/lib/$base.so" ]]; then
            versioned="$(cd "$HOME_CU/lib" && ls $base.so.* 2>/dev/null | sort | head -n1 || true)"
            [[ -n "$versioned" ]] || { log "no $base.so.* in $HOME_CU/lib"; exit 1; }
            ln -s "$versioned" "$HOME_CU/lib/$base.so"
        fi
    done

    # Link-time stub of the driver library (libcuda.so, SONAME libcuda.so.1): one empty function
    # per `cu*` entry point declared by cuda.h after its `_v2` renaming macros are applied.
    STUBDIR="$HOME_CU/lib/stubs"
    mkdir -p "$STUBDIR"
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    gcc -E -P -I"$HOME_CU/include" -x c "$HOME_CU/include/cuda.h" -o "$TMP/cuda.i"
    { grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' "$TMP/cuda.i" | tr -d ' \t(' ;
      printf '%s\n' cuProfilerInitialize cuProfilerStart cuProfilerStop ; } | sort -u > "$TMP/names"
    [[ "$(wc -l < "$TMP/names")" -gt 100 ]] || { log "too few cu* symbols parsed from cuda.h"; exit 1; }
    sed 's/.*/void &(void) {}/' "$TMP/names" > "$TMP/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUBDIR/libcuda.so" "$TMP/stub.c"
    log "libcuda.so stub with $(wc -l < "$TMP/names") symbols"

    echo "$STAMP_CONTENT" > "$STAMP"
    log "done: $("$HOME_CU/bin/nvcc" --version | tail -n2 | head -n1)"
fi

# With DSV41_NCCL=1: NCCL for the `nccl` feature (cudarc links libnccl at build time; its
# bindings are NCCL 2.30's), from the nvidia-nccl-cu13 wheel into $PREFIX/nccl. At run time the
# GPU machine's own libnccl.so.2 is used (e.g. torch's nvidia/nccl/lib).
NCCL_REQ='nvidia-nccl-cu13==2.30.7'
NCCL_LIB="$PREFIX/nccl/nvidia/nccl/lib"
if [[ "${DSV41_NCCL:-0}" == 1 ]]; then
    if [[ ! -f "$PREFIX/nccl/.installed" || "$(cat "$PREFIX/nccl/.installed")" != "$NCCL_REQ" ]]; then
        log "installing $NCCL_REQ into $PREFIX/nccl"
        rm -rf "$PREFIX/nccl"
        "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
            --target "$PREFIX/nccl" "$NCCL_REQ"
        [[ -f "$NCCL_LIB/libnccl.so.2" ]] || { log "no libnccl.so.2 in $NCCL_LIB after install"; exit 1; }
        ln -sf libnccl.so.2 "$NCCL_LIB/libnccl.so"
        echo "$NCCL_REQ" > "$PREFIX/nccl/.installed"
    fi
    echo "export LIBRARY_PATH=\"$NCCL_LIB\${LIBRARY_PATH:+:\$LIBRARY_PATH}\""
fi

# The environment to export (also what scripts/cuda-env.sh sets).
cat <<ENV
export CUDA_HOME="$HOME_CU"
export CUDA_PATH="$HOME_CU"
export CUDA_ROOT="$HOME_CU"
export PATH="$HOME_CU/bin:\$PATH"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
export CUDAFORGE_THREADS="\${CUDAFORGE_THREADS:-$(nproc)}"
export LIBRARY_PATH="$HOME_CU/lib/stubs:$HOME_CU/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
ENV
