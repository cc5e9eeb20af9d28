#!/usr/bin/env bash
# idx6 run: tests and benches per experiment switch (DSV41_IX_VAR: balanced packed decode scores
# kernel, V bits 1 NOH2, 2 F32P, 4 EPI, 8 PAIR, 16 SC; 0 = main's kernel), Nsight Compute (full set,
# SASS source page) on the B = 256 packed launch with the fused histogram, optional memcheck.
# Usage: OUT=$OUT TVARS="0 23" BVARS="0 2 23" NCU_VARS="0 23" [MEMCHECK=1 MEMVARS="0"] bash gpu-extra/idx6/variants.sh
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "variants.sh: $*" | tee -a "$S"; }
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
for b in cuda_indexer bench_indexer; do xz -dc "$HERE/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 | tee -a "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
TL="$OUT/tests.log"; : > "$TL"
VL="$OUT/variants.log"; : > "$VL"
BARGS="--no-baseline --batches 64,256 --prefill 4096"
for v in ${TVARS:-0}; do
  echo "=== tests DSV41_IX_VAR=$v" >> "$TL"
  DSV41_IX_VAR=$v timeout ${TEST_T:-40} "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests var $v: exit $? (t=$(el)s)"
done
for v in ${BVARS:-0}; do
  echo "=== bench DSV41_IX_VAR=$v" >> "$VL"
  DSV41_IX_VAR=$v timeout 30 "$W/bench_indexer" $BARGS >> "$VL" 2>&1; say "bench var $v: exit $? (t=$(el)s)"
done
if [[ -n "${FULL:-}" ]]; then
  timeout 60 "$W/bench_indexer" > "$OUT/bench-bench_indexer.log" 2>&1; say "full bench: exit $? (t=$(el)s)"
fi
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for v in ${NCU_VARS:-}; do
  # Balanced launches with --batches 256 --reps 1 --warmup 1: 8 scores-only, then 7 with the fused histogram.
  DSV41_IX_VAR=$v timeout ${NCU_T:-40} "$NCU" --clock-control none --set full --import-source no -k regex:balanced \
     --launch-skip ${NCU_SKIP:-9} --launch-count 1 -o "$OUT/ncu-v$v" -f \
     "$W/bench_indexer" --no-baseline --batches 256 --prefill 4096 --reps 1 --warmup 1 --rep-ms 0.1 > "$OUT/ncu-run-v$v.log" 2>&1
  say "ncu var $v: exit $? (t=$(el)s)"
  "$NCU" -i "$OUT/ncu-v$v.ncu-rep" --page details > "$OUT/ncu-details-v$v.txt" 2>&1; say "ncu details $v: exit $?"
  "$NCU" -i "$OUT/ncu-v$v.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu-sass-v$v.csv" 2>&1; say "ncu sass $v: exit $?"
  "$NCU" -i "$OUT/ncu-v$v.ncu-rep" --page raw --csv > "$OUT/ncu-raw-v$v.csv" 2>&1; say "ncu raw $v: exit $?"
  xz -T2 -6 "$OUT/ncu-v$v.ncu-rep" 2>/dev/null
done
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for v in ${MEMVARS:-0}; do
    DSV41_IX_VAR=$v timeout ${MEM_T:-100} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" --test-threads=1 > "$OUT/memcheck-cuda_indexer-var$v.log" 2>&1
    say "memcheck cuda_indexer var $v ($SAN): exit $? (t=$(el)s)"
  done
fi
"$NCU" --version 2>/dev/null | tail -1 >> "$S"
cat "$S"
