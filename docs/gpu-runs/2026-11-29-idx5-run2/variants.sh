#!/usr/bin/env bash
# idx5 run: tests and benches for each experiment switch (DSV41_IX_VAR: scores kernel; DSV41_SEL_VAR:
# selection kernel), the default full bench, the idx4 binary (main 4d5f484's kernels) as a same-run
# reference, optional ncu and memcheck.
# Usage: OUT=$OUT IXVARS="0 1 2 3" SELVARS="1 2" [MEMCHECK=1] [NCU_VARS="0"] bash gpu-extra/idx5/variants.sh
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "variants.sh: $*" | tee -a "$S"; }
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
for b in cuda_indexer bench_indexer bench_indexer_ref; do xz -dc "$HERE/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 | tee -a "$S"
sha256sum "$W/bench_indexer_ref" >> "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
TL="$OUT/tests.log"; : > "$TL"
VL="$OUT/variants.log"; : > "$VL"
BARGS="--no-baseline --batches 64,256 --prefill 4096"
# Default tests first, then the full default bench.
echo "=== tests default" >> "$TL"
timeout 60 "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests default: exit $? (t=$(el)s)"
timeout 60 "$W/bench_indexer" ${FULL_ARGS:-} > "$OUT/bench-bench_indexer.log" 2>&1; say "full bench: exit $? (t=$(el)s)"
echo "=== reference: idx4 binary (main 4d5f484)" >> "$VL"
timeout 30 "$W/bench_indexer_ref" $BARGS >> "$VL" 2>&1; say "ref bench: exit $? (t=$(el)s)"
for v in ${IXVARS:-}; do
  echo "=== tests DSV41_IX_VAR=$v" >> "$TL"
  DSV41_IX_VAR=$v timeout 40 "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests ix var $v: exit $? (t=$(el)s)"
  echo "=== bench DSV41_IX_VAR=$v" >> "$VL"
  DSV41_IX_VAR=$v timeout 30 "$W/bench_indexer" $BARGS >> "$VL" 2>&1; say "bench ix var $v: exit $? (t=$(el)s)"
done
for v in ${SELVARS:-}; do
  echo "=== tests DSV41_SEL_VAR=$v" >> "$TL"
  DSV41_SEL_VAR=$v timeout 40 "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests sel var $v: exit $? (t=$(el)s)"
  echo "=== bench DSV41_SEL_VAR=$v" >> "$VL"
  DSV41_SEL_VAR=$v timeout 30 "$W/bench_indexer" $BARGS >> "$VL" 2>&1; say "bench sel var $v: exit $? (t=$(el)s)"
done
echo "=== reference again: idx4 binary" >> "$VL"
timeout 30 "$W/bench_indexer_ref" $BARGS >> "$VL" 2>&1; say "ref bench 2: exit $? (t=$(el)s)"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
NL="$OUT/ncu.log"; : > "$NL"
for v in ${NCU_VARS:-}; do
  echo "=== ncu DSV41_IX_VAR=$v" >> "$NL"
  DSV41_IX_VAR=$v DSV41_SEL_VAR=${NCU_SEL:-0} timeout ${NCU_T:-30} "$NCU" --clock-control none --kernel-name-base mangled --kernel-name regex:${NCU_K:-indexer_s} \
     --launch-skip ${NCU_SKIP:-6} --launch-count ${NCU_COUNT:-3} --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis --section SpeedOfLight \
     "$W/bench_indexer" --no-baseline --batches 256 --prefill 4096 --reps 1 --warmup 1 --rep-ms 0.1 >> "$NL" 2>&1; say "ncu var $v: exit $? (t=$(el)s)"
  # The launches profiled (--batches 256, 7 calls per measurement): 43 bf16 launches, then for mxfp4 8 scores,
  # 7 unfused top-k (51-57), 7 x (scores with histogram, fused select) (58-71), 7 x (scores, select) (72-85).
done
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for v in ${MEMVARS:-0}; do
    DSV41_IX_VAR=$v timeout ${MEM_T:-100} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" --test-threads=1 > "$OUT/memcheck-cuda_indexer-var$v.log" 2>&1
    say "memcheck cuda_indexer var $v ($SAN): exit $? (t=$(el)s)"
  done
fi
cat "$S"
