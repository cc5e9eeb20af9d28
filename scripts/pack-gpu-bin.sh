#!/usr/bin/env bash
# Builds the CUDA test and benchmark binaries (tests/cuda_insert.rs, tests/cuda_sparse_attention.rs,
# examples/bench_insert.rs, examples/bench_sparse_attention.rs) (release, feature `cuda`) and packs them for a
# GPU machine without Rust into "$DIR"/ (gitignored): stripped + xz-compressed binaries,
# SHA256SUMS of the unpacked binaries, run.sh (scripts/gpu-bin-run.sh) and, when available, the
# compute-sanitizer wheel (pip download, cached in .cuda/wheels) for the memcheck run.
#
#   scripts/pack-gpu-bin.sh          # then copy "$DIR"/ to the GPU machine: bash "$DIR"/run.sh
#
# Environment: PACK_TESTS / PACK_BENCHES (space-separated target names, "" = none; unset: the CUDA tests /
# benches below), PACK_DIR (output folder, default gpu-bin), PACK_FEATURES (cargo features, default
# cuda; "cuda,cuda-diag" for the sparse attention diagnostics of `bench_sparse_attention --trace /
# --diag`, never for timing or test figures). The chosen names are written to
# $PACK_DIR/TARGETS so run.sh runs exactly what was packed; run.sh's BENCH_ARGS / TEST_FILTER
# pass arguments through.
# FP8 linear (issue 21): PACK_TESTS="cuda_fp8_linear" PACK_BENCHES="bench_fp8_linear"; its torch
# anchors are examples/anchors/scaled_mm.py (run with /opt/torch/.venv/bin/python on the GPU machine).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
source scripts/cuda-env.sh
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-2}"
NICE="nice -n 19"

# Build and collect the executables' paths from cargo's JSON messages.
msgs="$(mktemp)"
read -r -a TESTS <<< "${PACK_TESTS-cuda_insert cuda_sparse_attention}"
read -r -a BENCHES <<< "${PACK_BENCHES-bench_insert bench_sparse_attention}"
DIR="${PACK_DIR:-gpu-bin}"
FEATURES="${PACK_FEATURES:-cuda}"
: > "$msgs"
((${#TESTS[@]} == 0)) || $NICE cargo test --release --features "$FEATURES" "${TESTS[@]/#/--test=}" --no-run --message-format=json >> "$msgs"
((${#BENCHES[@]} == 0)) || $NICE cargo build --release --features "$FEATURES" "${BENCHES[@]/#/--example=}" --message-format=json >> "$msgs"
exe_of() {
    python3 - "$msgs" "$1" <<'PY'
import json, sys
path, name = sys.argv[1], sys.argv[2]
found = None
for line in open(path):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == name and m.get("executable"):
        found = m["executable"]
print(found or "")
PY
}
mkdir -p "$DIR"
rm -f "$DIR"/*.xz "$DIR"/SHA256SUMS
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for b in "${TESTS[@]}" "${BENCHES[@]}"; do
    exe="$(exe_of "$b")"
    [[ -x "$exe" ]] || { echo "pack-gpu-bin: executable of $b not found" >&2; exit 1; }
    cp "$exe" "$tmp/$b"
    strip "$tmp/$b"
done
rm -f "$msgs"
(cd "$tmp" && sha256sum "${TESTS[@]}" "${BENCHES[@]}") > "$DIR"/SHA256SUMS
for b in "${TESTS[@]}" "${BENCHES[@]}"; do
    $NICE xz -T2 -6 -c "$tmp/$b" > ""$DIR"/$b.xz"
done
cp scripts/gpu-bin-run.sh "$DIR"/run.sh
printf 'TESTS=(%s)\nBENCHES=(%s)\n' "${TESTS[*]}" "${BENCHES[*]}" > "$DIR"/TARGETS
chmod +x "$DIR"/run.sh

# compute-sanitizer for memcheck (the GPU image may not have one; the H200 image has
# /usr/local/cuda-13.0/bin/compute-sanitizer, so PACK_SANITIZER=0 saves 14 MB of upload).
WHEEL_REQ="nvidia-cuda-sanitizer-api==13.0.85"
rm -f "$DIR"/nvidia_cuda_sanitizer_api-*.whl
if [[ "${PACK_SANITIZER:-1}" == 1 ]]; then
mkdir -p .cuda/wheels
if ! ls .cuda/wheels/nvidia_cuda_sanitizer_api-13.0.85-*.whl >/dev/null 2>&1; then
    python3 -m pip download --no-deps --quiet --disable-pip-version-check -d .cuda/wheels "$WHEEL_REQ" \
        || echo "pack-gpu-bin: could not download $WHEEL_REQ; run.sh will look for a system compute-sanitizer"
fi
cp .cuda/wheels/nvidia_cuda_sanitizer_api-13.0.85-*.whl "$DIR"/ 2>/dev/null || true
fi
(cd "$DIR" && sha256sum ./*.xz ./*.whl 2>/dev/null) > "$DIR"/SHA256SUMS.packed || true
ls -la "$DIR"
cat "$DIR"/SHA256SUMS
