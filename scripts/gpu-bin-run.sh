#!/usr/bin/env bash
# Runs the packed CUDA test and benchmark binaries on a GPU machine that has no Rust toolchain.
# Copied as gpu-bin/run.sh by scripts/pack-gpu-bin.sh; self-contained: needs bash, xz or
# python3, and the NVIDIA driver. Logs go to $OUT (default: gpu-bin/out).
#
#   bash gpu-bin/run.sh            # tests, compute-sanitizer memcheck of the tests, benchmark
#   SKIP_MEMCHECK=1 TEST_FILTER=name BENCH_ARGS="--quick" bash gpu-bin/run.sh
#   MEMCHECK_TESTS="cuda_layer" bash gpu-bin/run.sh                          # memcheck a subset
#   ARGS_golden="tests/fixtures/v41-tiny --device cuda" bash gpu-bin/run.sh   # per-binary arguments
#
# Exit status: 0 when the tests (and memcheck, when it ran) passed; the bench never fails it.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "run.sh: $*" | tee -a "$SUMMARY"; }
with_timeout() { local s=$1; shift; if command -v timeout >/dev/null; then timeout "$s" "$@"; else "$@"; fi; }

unxz_to() {  # unxz_to SRC.xz DST
    if command -v xz >/dev/null; then xz -dc "$1" > "$2"
    else python3 -c 'import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; fi
}

{ nvidia-smi || echo "nvidia-smi not available"; } > "$OUT/nvidia-smi.txt" 2>&1
TESTS=(cuda_insert cuda_sparse_attention)
BENCHES=(bench_insert bench_sparse_attention)
[[ -f "$HERE/TARGETS" ]] && source "$HERE/TARGETS"   # written by pack-gpu-bin.sh
read -r -a TEST_FILTER_ARR <<< "${TEST_FILTER:-}"
read -r -a BENCH_ARGS_ARR <<< "${BENCH_ARGS:-}"
SKIP_MEMCHECK="${SKIP_MEMCHECK:-0}"
read -r -a MEMCHECK_ARR <<< "${MEMCHECK_TESTS:-${TESTS[*]}}"   # which test binaries run under memcheck
for b in "${TESTS[@]}" "${BENCHES[@]}"; do
    unxz_to "$HERE/$b.xz" "$WORK/$b" || { say "cannot unpack $b.xz"; exit 2; }
    chmod +x "$WORK/$b"
done
if command -v sha256sum >/dev/null; then
    (cd "$WORK" && sha256sum -c "$HERE/SHA256SUMS" 2>&1) | tee -a "$SUMMARY"
fi
ldd "$WORK/${TESTS[0]:-${BENCHES[0]}}" > "$OUT/ldd.txt" 2>&1
if grep -q "not found" "$OUT/ldd.txt"; then say "missing shared libraries:"; grep "not found" "$OUT/ldd.txt" | tee -a "$SUMMARY"; fi

# 1. Tests (they fail without a CUDA device): $OUT/tests-<name>.log.
TESTS_RC=0
for b in "${TESTS[@]}"; do
    with_timeout 180 "$WORK/$b" --test-threads=1 "${TEST_FILTER_ARR[@]}" > "$OUT/tests-$b.log" 2>&1
    rc=$?
    tail -n 30 "$OUT/tests-$b.log"
    say "tests $b: exit $rc"
    [[ $rc -eq 0 ]] || TESTS_RC=$rc
done

# 2. compute-sanitizer memcheck of the same tests.
SAN=""
for c in "$TORCH_CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer \
         "$(command -v compute-sanitizer 2>/dev/null)"; do
    if [[ -n "$c" && -x "$c" ]]; then SAN="$c"; break; fi
done
if [[ -z "$SAN" ]] && ls "$HERE"/nvidia_cuda_sanitizer_api-*.whl >/dev/null 2>&1 && command -v python3 >/dev/null; then
    python3 -m zipfile -e "$HERE"/nvidia_cuda_sanitizer_api-*.whl "$WORK/sanitizer" \
        && chmod +x "$WORK/sanitizer/nvidia/cu13/bin/compute-sanitizer" \
        && for f in "$WORK/sanitizer/nvidia/cu13/lib/"*.so; do
               [[ -e "$WORK/sanitizer/nvidia/cu13/bin/$(basename "$f")" ]] || cp "$f" "$WORK/sanitizer/nvidia/cu13/bin/"
           done \
        && SAN="$WORK/sanitizer/nvidia/cu13/bin/compute-sanitizer"
fi
MEM_RC=0
if [[ "$SKIP_MEMCHECK" == 1 ]]; then
    say "memcheck skipped (SKIP_MEMCHECK=1)"
elif [[ -n "$SAN" ]]; then
    say "memcheck with $SAN"
    for b in "${MEMCHECK_ARR[@]}"; do
        with_timeout 300 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 \
            "$WORK/$b" --test-threads=1 > "$OUT/memcheck-$b.log" 2>&1
        rc=$?
        tail -n 15 "$OUT/memcheck-$b.log"
        say "memcheck $b: exit $rc"
        [[ $rc -eq 0 ]] || MEM_RC=$rc
    done
else
    say "compute-sanitizer not found (looked in $TORCH_CU13/bin, /usr/local/cuda*/bin, PATH, the shipped wheel): memcheck skipped"
fi

# 3. Benchmarks: $OUT/bench-<name>.log.
for b in "${BENCHES[@]}"; do
    args_var="ARGS_$b"                      # per-binary arguments, e.g. ARGS_golden="tests/fixtures/v41-tiny --device cuda"
    if [[ -n "${!args_var-}" ]]; then read -r -a args <<< "${!args_var}"; else args=("${BENCH_ARGS_ARR[@]}"); fi
    with_timeout 240 "$WORK/$b" "${args[@]}" > "$OUT/bench-$b.log" 2>&1
    say "bench $b: exit $?"
    cat "$OUT/bench-$b.log"
done

cat "$SUMMARY"
[[ $TESTS_RC -eq 0 && $MEM_RC -eq 0 ]]
