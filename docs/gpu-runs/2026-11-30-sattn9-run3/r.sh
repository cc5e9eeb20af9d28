#!/usr/bin/env bash
# Runner of helper sattn9 (from sattn8's): unpack once, check sha256, the test binary (TEST_FILTER
# optional), the bench once per entry of BENCH_RUNS (a '|'-separated list of "[VAR=VAL ... ::] args"
# entries; default BENCH_ARGS), bench_batched_decode if packed (BATCHED_ARGS, once per entry of BATCHED_KERNELS), memcheck
# of the test binary (MEMCHECK=1) and racecheck (RACECHECK=1, RC_FILTER) last.
# Logs: summary.txt, tests.log, bench.log, batched.log, sanitizer.log.
#   OUT=... bash r.sh
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$OUT/summary.txt"; : > "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
SAN=""; for c in "$TORCH_CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
W="$(mktemp -d)"
BINS="cuda_sparse_attention bench_sparse_attention $([[ -f "$HERE/bench_batched_decode.xz" ]] && echo bench_batched_decode)"
for b in $BINS; do xz -dc "$HERE/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 >> "$S"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-60}" "$W/cuda_sparse_attention" --test-threads=1 ${TEST_FILTER:-} > "$W/t.log" 2>&1
rc=$?
cat "$W/t.log" >> "$OUT/tests.log"
echo "tests cuda_sparse_attention: exit $rc ($(( $(date +%s) - t0 )) s) ($(grep 'test result' "$W/t.log"))" | tee -a "$S"
grep -E "^test |panicked|Error" "$W/t.log" | grep -v " ok$" | head -40 >> "$S"
IFS='|' read -r -a RUNS <<< "${BENCH_RUNS:-${BENCH_ARGS:-}}"
for a in "${RUNS[@]}"; do
  t0=$(date +%s)
  envs=""; if [[ "$a" == *"::"* ]]; then envs="${a%%::*}"; a="${a#*::}"; fi
  echo "=== bench env=[$envs] args=[$a]" >> "$OUT/bench.log"
  env $envs timeout "${BENCH_TIMEOUT:-60}" "$W/bench_sparse_attention" $a > "$W/b.log" 2>&1
  rc=$?
  cat "$W/b.log" >> "$OUT/bench.log"
  echo "bench env=[$envs] args=[$a]: exit $rc ($(( $(date +%s) - t0 )) s)" | tee -a "$S"
  grep -E "^decode B=|trace|in-stream|share|alone|flush" "$W/b.log" >> "$S"
done
if [[ -x "$W/bench_batched_decode" ]]; then
  for k in ${BATCHED_KERNELS:-auto}; do
    t0=$(date +%s)
    echo "=== batched --attention-kernel $k args=[${BATCHED_ARGS:-}]" >> "$OUT/batched.log"
    timeout "${BATCHED_TIMEOUT:-60}" "$W/bench_batched_decode" ${BATCHED_ARGS:-} --attention-kernel "$k" > "$W/d.log" 2>&1
    rc=$?
    cat "$W/d.log" >> "$OUT/batched.log"
    echo "batched [$k]: exit $rc ($(( $(date +%s) - t0 )) s)" | tee -a "$S"
    grep -iE "graph|attention" "$W/d.log" | head -12 >> "$S"
  done
fi
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  t0=$(date +%s)
  timeout "${MC_TIMEOUT:-60}" "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_sparse_attention" --test-threads=1 ${MC_FILTER:-} > "$W/m.log" 2>&1
  rc=$?
  { echo "=== memcheck"; cat "$W/m.log"; } >> "$OUT/sanitizer.log"
  echo "memcheck cuda_sparse_attention ($SAN): exit $rc ($(( $(date +%s) - t0 )) s) ($(grep 'ERROR SUMMARY' "$W/m.log")) ($(grep 'test result' "$W/m.log"))" | tee -a "$S"
fi
if [[ "${RACECHECK:-0}" == 1 ]]; then
  t0=$(date +%s)
  timeout "${RC_TIMEOUT:-60}" "$SAN" --tool racecheck --racecheck-report hazard --error-exitcode 99 --print-limit 20 "$W/cuda_sparse_attention" --test-threads=1 ${RC_FILTER:-} > "$W/r.log" 2>&1
  rc=$?
  { echo "=== racecheck"; cat "$W/r.log"; } >> "$OUT/sanitizer.log"
  echo "racecheck cuda_sparse_attention [${RC_FILTER:-}]: exit $rc ($(( $(date +%s) - t0 )) s) ($(grep 'RACECHECK SUMMARY\|ERROR SUMMARY' "$W/r.log" | head -2)) ($(grep 'test result' "$W/r.log"))" | tee -a "$S"
fi
rm -rf "$W"
