#!/usr/bin/env bash
# Runner of helper seesaw9 (from sattn9's): unpack, check sha256, the test binaries (TEST_FILTER optional),
# the bench once per entry of BENCH_RUNS ('|'-separated "[VAR=VAL ... ::] args" entries) for the new binary
# (bench_sparse_attention) and, when packed, main's binary (bench_main: the old all-heads loop), memcheck of
# cuda_sparse_attention (MEMCHECK=1) and racecheck (RACECHECK=1, RC_FILTER) last.
# Logs: summary.txt, tests.log, bench.log, sanitizer.log.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$OUT/summary.txt"; : > "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
SAN=""; for c in "$TORCH_CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
W="$(mktemp -d)"
BINS=""; for b in cuda_sparse_attention cuda_sparse_attention_packed bench_sparse_attention bench_main; do [[ -f "$HERE/$b.xz" ]] && BINS="$BINS $b"; done
for b in $BINS; do xz -dc "$HERE/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
for t in cuda_sparse_attention cuda_sparse_attention_packed; do
  [[ -x "$W/$t" ]] || continue
  t0=$(date +%s)
  timeout "${TEST_TIMEOUT:-60}" "$W/$t" --test-threads=1 ${TEST_FILTER:-} > "$W/t.log" 2>&1
  rc=$?
  { echo "=== $t"; cat "$W/t.log"; } >> "$OUT/tests.log"
  echo "tests $t: exit $rc ($(( $(date +%s) - t0 )) s) ($(grep 'test result' "$W/t.log"))" | tee -a "$S"
  grep -E "^test |panicked|Error" "$W/t.log" | grep -v " ok$" | head -40 >> "$S"
done
IFS='|' read -r -a RUNS <<< "${BENCH_RUNS:-${BENCH_ARGS:-}}"
for a in "${RUNS[@]}"; do
  envs=""; if [[ "$a" == *"::"* ]]; then envs="${a%%::*}"; a="${a#*::}"; fi
  only=""; if [[ "$envs" == *"ONLY=1"* ]]; then only=bench_sparse_attention; envs="${envs//ONLY=1/}"; fi
  for b in bench_sparse_attention bench_main; do
    [[ -x "$W/$b" ]] || continue
    [[ -z "$only" || "$b" == "$only" ]] || continue
    extra=""; [[ "$b" == bench_main ]] && extra="${MAIN_EXTRA:-}"
    t0=$(date +%s)
    echo "=== $b env=[$envs] args=[$a $extra]" >> "$OUT/bench.log"
    env $envs timeout "${BENCH_TIMEOUT:-60}" "$W/$b" $a $extra > "$W/b.log" 2>&1
    rc=$?
    cat "$W/b.log" >> "$OUT/bench.log"
    echo "$b env=[$envs] args=[$a]: exit $rc ($(( $(date +%s) - t0 )) s)" | tee -a "$S"
    grep -E "^decode B=|^prefill|trace|in-stream|share|alone|flush" "$W/b.log" >> "$S"
  done
done
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  for t in ${MC_BINS:-cuda_sparse_attention}; do
    t0=$(date +%s)
    timeout "${MC_TIMEOUT:-60}" "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/$t" --test-threads=1 ${MC_FILTER:-} > "$W/m.log" 2>&1
    rc=$?
    { echo "=== memcheck $t"; cat "$W/m.log"; } >> "$OUT/sanitizer.log"
    echo "memcheck $t ($SAN): exit $rc ($(( $(date +%s) - t0 )) s) ($(grep 'ERROR SUMMARY' "$W/m.log")) ($(grep 'test result' "$W/m.log"))" | tee -a "$S"
  done
fi
if [[ "${RACECHECK:-0}" == 1 ]]; then
  t0=$(date +%s)
  timeout "${RC_TIMEOUT:-60}" "$SAN" --tool racecheck --racecheck-report hazard --error-exitcode 99 --print-limit 20 "$W/cuda_sparse_attention" --test-threads=1 ${RC_FILTER:-} > "$W/r.log" 2>&1
  rc=$?
  { echo "=== racecheck"; cat "$W/r.log"; } >> "$OUT/sanitizer.log"
  echo "racecheck cuda_sparse_attention [${RC_FILTER:-}]: exit $rc ($(( $(date +%s) - t0 )) s) ($(grep 'RACECHECK SUMMARY\|ERROR SUMMARY' "$W/r.log" | head -2)) ($(grep 'test result' "$W/r.log"))" | tee -a "$S"
fi
rm -rf "$W"
