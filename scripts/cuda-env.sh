# Source me: `source scripts/cuda-env.sh` (bash). Installs the pinned CUDA 13.0 toolchain into
# <repo>/.cuda if needed (see scripts/install-cuda.sh) and exports CUDA_HOME, CUDA_PATH,
# CUDA_ROOT, PATH, CUDA_COMPUTE_CAP (default 90 = H100/H200), CUDAFORGE_THREADS (default: nproc)
# and LIBRARY_PATH (the link-time libcuda stub and the toolkit libraries).
_dsv41_env="$(bash "$(dirname "${BASH_SOURCE[0]}")/install-cuda.sh")" || return 1
eval "$_dsv41_env"
unset _dsv41_env
