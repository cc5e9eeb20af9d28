#!/usr/bin/env bash
# Builds and runs the host simulation of the CUDA kernels (no GPU needed; g++ with C++20 and
# the CUDA headers of scripts/install-cuda.sh). The kernels' launchers (everything after the
# "-- launcher" banner of each .cu, which uses <<<>>> syntax) are stripped first.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$REPO/scripts/cuda-env.sh"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
for f in "$REPO"/kernels/*.cu; do
    sed '/-- launcher/,$d' "$f" > "$TMP/$(basename "${f%.cu}").inc"
done
nice -n 19 g++ -std=c++20 -O1 -ffp-contract=off -pthread -I"$CUDA_HOME/include" -I"$REPO/kernels" -I"$TMP" \
    -I"$REPO/tools/kernel_hostsim" "$REPO/tools/kernel_hostsim/main.cpp" -o "$TMP/hostsim"
"$TMP/hostsim"
