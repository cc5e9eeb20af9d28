#!/usr/bin/env bash
# Runner of helper sattn8 (from sattn7's): unpack once, check sha256, the two sparse attention test
# binaries under each environment variant of VARIANTS ("-" = none, else space-free VAR=VAL,VAR=VAL;
# TEST_FILTER optional; the packed tests run under the first only), the bench (BENCH_ARGS) under each
# variant of BVARIANTS (same syntax), main's bench binary if packed (BENCH_MAIN_ARGS), optional
# memcheck (MEMCHECK=1, MEMCHECK_TESTS, MC_ENV) last. Logs: summary.txt, tests.log, bench.log,
# memcheck.log (appended per variant; the device returns at most 8 files).
#   OUT=... bash r.sh
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$OUT/summary.txt"; : > "$S"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
SAN=""; for c in "$TORCH_CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
W="$(mktemp -d)"
TB="cuda_sparse_attention cuda_sparse_attention_packed"
for b in $TB bench_sparse_attention $([[ -f "$HERE/bench_sparse_attention_main.xz" ]] && echo bench_sparse_attention_main); do xz -dc "$HERE/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 >> "$S"
vn=0
for v in ${VARIANTS:--}; do
  envs=(); [[ "$v" != "-" ]] && IFS=, read -r -a envs <<< "$v"
  tbs="$TB"; [[ $vn -gt 0 ]] && tbs="cuda_sparse_attention"
  for b in $tbs; do
    t0=$(date +%s)
    echo "=== tests $b [$v]" >> "$OUT/tests.log"
    env "${envs[@]}" timeout "${TEST_TIMEOUT:-40}" "$W/$b" --test-threads=1 ${TEST_FILTER:-} > "$W/t.log" 2>&1
    rc=$?
    cat "$W/t.log" >> "$OUT/tests.log"
    echo "tests $b [$v]: exit $rc ($(( $(date +%s) - t0 )) s) ($(grep 'test result' "$W/t.log"))" | tee -a "$S"
    grep -E "^test |panicked|Error" "$W/t.log" | grep -v " ok$" | head -40 >> "$S"
  done
  vn=$((vn + 1))
done
for v in ${BVARIANTS:--}; do
  envs=(); [[ "$v" != "-" ]] && IFS=, read -r -a envs <<< "$v"
  t0=$(date +%s)
  echo "=== bench [$v] args=[${BENCH_ARGS:-}]" >> "$OUT/bench.log"
  env "${envs[@]}" timeout "${BENCH_TIMEOUT:-40}" "$W/bench_sparse_attention" ${BENCH_ARGS:-} > "$W/b.log" 2>&1
  rc=$?
  cat "$W/b.log" >> "$OUT/bench.log"
  echo "bench [$v] args=[${BENCH_ARGS:-}]: exit $rc ($(( $(date +%s) - t0 )) s)" | tee -a "$S"
  grep -E "decode B=|trace|in-stream|share|alone" "$W/b.log" >> "$S"
done
if [[ -x "$W/bench_sparse_attention_main" ]]; then  # main's bench (main's kernels) in the same run
  t0=$(date +%s)
  echo "=== bench main args=[${BENCH_MAIN_ARGS:-}]" >> "$OUT/bench.log"
  timeout "${BENCH_TIMEOUT:-40}" "$W/bench_sparse_attention_main" ${BENCH_MAIN_ARGS:-} > "$W/b.log" 2>&1
  rc=$?
  cat "$W/b.log" >> "$OUT/bench.log"
  echo "bench main args=[${BENCH_MAIN_ARGS:-}]: exit $rc ($(( $(date +%s) - t0 )) s)" | tee -a "$S"
  grep -E "decode B=" "$W/b.log" >> "$S"
fi
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  envs=(); [[ -n "${MC_ENV:-}" ]] && IFS=, read -r -a envs <<< "${MC_ENV:-}"
  for b in ${MEMCHECK_TESTS:-cuda_sparse_attention}; do
    t0=$(date +%s)
    env "${envs[@]}" timeout "${MC_TIMEOUT:-45}" "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/$b" --test-threads=1 ${MC_FILTER:-} > "$W/m.log" 2>&1
    rc=$?
    cat "$W/m.log" >> "$OUT/memcheck.log"
    echo "memcheck $b [${MC_ENV:-}] ($SAN): exit $rc ($(( $(date +%s) - t0 )) s) ($(grep 'ERROR SUMMARY' "$W/m.log"))" | tee -a "$S"
    grep -E "^test |test result" "$W/m.log" | head -30 >> "$S"
  done
fi
rm -rf "$W"
