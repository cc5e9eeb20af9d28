#!/usr/bin/env bash
# idx4 run: tests + bench for each DSV41_IX_VAR variant, default full bench, ncu of two variants.
# Usage: OUT=$OUT VARS="0 1 2" NCU_VARS="0 22" [MEMCHECK=1] bash gpu-extra/idx4/variants.sh
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
# Tests of the default and of every variant.
TL="$OUT/tests.log"; : > "$TL"
for v in ${VARS:-0}; do
  echo "=== tests DSV41_IX_VAR=$v" >> "$TL"
  DSV41_IX_VAR=$v timeout 40 "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests var $v: exit $? (t=$(el)s)"
done
# Bench variants (decode B = 64, 256; prefill 4096), no Candle baseline.
VL="$OUT/variants.log"; : > "$VL"
for v in ${BVARS:-${VARS:-0}}; do
  echo "=== bench DSV41_IX_VAR=$v" >> "$VL"
  DSV41_IX_VAR=$v timeout 30 "$W/bench_indexer" --no-baseline --batches 64,256 --prefill 4096 >> "$VL" 2>&1; say "bench var $v: exit $? (t=$(el)s)"
done
for v in ${SVARS:-}; do
  echo "=== tests DSV41_SEL_VAR=$v" >> "$TL"
  DSV41_SEL_VAR=$v timeout 40 "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests sel var $v: exit $? (t=$(el)s)"
  echo "=== bench DSV41_SEL_VAR=$v" >> "$VL"
  DSV41_SEL_VAR=$v timeout 30 "$W/bench_indexer" --no-baseline --batches 64,256 --prefill 4096 >> "$VL" 2>&1; say "bench sel var $v: exit $? (t=$(el)s)"
done
# The default (final) bench with all rows and the Candle baseline.
if [[ "${FULL:-1}" == 1 ]]; then
  DSV41_IX_VAR=${FULL_VAR:-0} timeout 60 "$W/bench_indexer" ${FULL_ARGS:-} > "$OUT/bench-bench_indexer.log" 2>&1; say "full bench (var ${FULL_VAR:-0}): exit $? (t=$(el)s)"
fi
# Reference: run 1's binary (experiment switches) in the same run.
if [[ -f "$HERE/bench_indexer_r1.xz" ]]; then
  xz -dc "$HERE/bench_indexer_r1.xz" > "$W/bench_indexer_r1"; chmod +x "$W/bench_indexer_r1"; sha256sum "$W/bench_indexer_r1" >> "$S"
  for v in ${RVARS:-}; do
    echo "=== run-1 binary, DSV41_IX_VAR=$v" >> "$VL"
    DSV41_IX_VAR=$v timeout 30 "$W/bench_indexer_r1" --no-baseline --batches 64,256 --prefill 4096 >> "$VL" 2>&1; say "run-1 bench var $v: exit $? (t=$(el)s)"
  done
fi
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
NL="$OUT/ncu.log"; : > "$NL"
for v in ${NCU_VARS:-}; do
  echo "=== ncu DSV41_IX_VAR=$v" >> "$NL"
  DSV41_IX_VAR=$v timeout ${NCU_T:-30} "$NCU" --clock-control none --kernel-name-base mangled --kernel-name regex:${NCU_K:-indexer_scores_kernelILi1ELi1E} \
     --launch-skip 3 --launch-count 1 --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
     "$W/bench_indexer" --no-baseline --batches 256 --prefill 4096 --reps 1 --warmup 1 --rep-ms 0.1 >> "$NL" 2>&1; say "ncu var $v: exit $? (t=$(el)s)"
done
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  timeout ${MEM_T:-100} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" --test-threads=1 > "$OUT/memcheck-cuda_indexer.log" 2>&1
  say "memcheck cuda_indexer ($SAN): exit $? (t=$(el)s)"
fi
cat "$S"
