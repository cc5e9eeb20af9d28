#!/usr/bin/env bash
# Session 10 runs 6-7 (per-warp P / alpha bulk copies, the final merge split between the warpgroups;
# DIAG2: a second bench with that DSV41_SPARSE_ATTENTION_DIAG, BENCH2=1 a second untraced bench): the dims-split pair kernel (kernels/sparse_attention_dimsplit.cu) — its edge-case
# test first (a hang costs only its timeout), then the whole attention test binary, memcheck of the
# new test, the decode bench with phase traces.
# Usage on the GPU machine: OUT=$OUT bash <dir>/r.sh (the packed binaries next to this script).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "s10r6: $*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
T="$W/cuda_sparse_attention"
timeout ${T1:-60} "$T" --test-threads=1 dim_split > "$L/tests-dimsplit.log" 2>&1
say "test dim_split: exit $? ($(grep -h 'test result' "$L/tests-dimsplit.log" | tail -1)) t=$((SECONDS-t0))"
grep -E "panicked|FAILED|Error|error" "$L/tests-dimsplit.log" | head -8 >> "$S"
if [[ "${FULL:-1}" == 1 ]]; then
  timeout 150 "$T" --test-threads=1 > "$L/tests-all.log" 2>&1
  say "tests all: exit $? ($(grep -h 'test result' "$L/tests-all.log" | tail -1)) t=$((SECONDS-t0))"
  grep -E "panicked|FAILED" "$L/tests-all.log" | head -8 >> "$S"
fi
timeout ${BT:-100} "$W/bench_sparse_attention" ${BENCH_ARGS:---no-prefill --no-packed --reps 7 --warmup 2 --trace} > "$L/bench.log" 2>&1
say "bench: exit $? t=$((SECONDS-t0))"
grep -E "^decode B=|share|L2 flush|top-k alone" "$L/bench.log" | head -60 >> "$S"
grep -E "dims-split pair trace" "$L/bench.log" | head -6 | cut -c1-2500 >> "$S"
if [[ "${BENCH2:-0}" == 1 ]]; then
  timeout ${BT:-100} "$W/bench_sparse_attention" --no-prefill --no-packed --reps 9 --warmup 2 > "$L/bench2.log" 2>&1
  say "bench (2nd, no trace): exit $? t=$((SECONDS-t0))"
  grep -E "^decode B=64|share|L2 flush" "$L/bench2.log" | head -30 >> "$S"
fi
if [[ -n "${DIAG2:-}" ]]; then
  DSV41_SPARSE_ATTENTION_DIAG=$DIAG2 timeout ${BT:-100} "$W/bench_sparse_attention" ${BENCH_ARGS:---no-prefill --no-packed --reps 7 --warmup 2 --trace} > "$L/bench-diag$DIAG2.log" 2>&1
  say "bench DIAG=$DIAG2: exit $? t=$((SECONDS-t0))"
  grep -E "^decode B=64 (dims|rows)|dims-split\]|pair \[dims" "$L/bench-diag$DIAG2.log" | grep -v trace | head -20 >> "$S"
  grep -E "dims-split pair trace" "$L/bench-diag$DIAG2.log" | sed -n 2p | cut -c1-2500 >> "$S"
fi
if [[ "${MEMCHECK:-1}" == 1 ]]; then
  SAN=""; for c in "$CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
  timeout ${MT:-150} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 30 "$T" --test-threads=1 dim_split > "$L/memcheck-dimsplit.log" 2>&1
  say "memcheck dim_split: exit $? ($(grep -h 'test result' "$L/memcheck-dimsplit.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-dimsplit.log" | tail -1)) t=$((SECONDS-t0))"
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
