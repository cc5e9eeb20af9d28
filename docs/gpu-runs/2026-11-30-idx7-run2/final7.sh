#!/usr/bin/env bash
# idx7 final run (integer MMAs always on, no switch): cuda_indexer tests, golden --device cuda
# (bf16 and packed caches), the indexer bench interleaved with main's binary (bench_indexer_ref,
# becf105), the full decode bench, Nsight Compute of the balanced scores kernel, memcheck.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "final7.sh: $*" | tee -a "$S"; }
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 | tee -a "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
timeout 60 "$W/cuda_indexer" --test-threads=1 > "$OUT/tests.log" 2>&1; say "tests cuda_indexer: exit $? ($(grep -h 'test result' "$OUT/tests.log" | tail -1)) (t=$(el)s)"
GL="$OUT/golden.log"; : > "$GL"
for c in bf16 packed; do
  echo "=== golden --device cuda --cache $c" >> "$GL"
  timeout 100 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c >> "$GL" 2>&1; say "golden cuda $c: exit $? ($(tail -1 "$GL")) (t=$(el)s)"
done
VL="$OUT/variants.log"; : > "$VL"
BARGS="${BARGS:---no-baseline --batches 64,256 --prefill 4096}"
bref() { echo "=== ref (main becf105 binary)" >> "$VL"; timeout 30 "$W/bench_indexer_ref" $BARGS >> "$VL" 2>&1; say "ref bench: exit $? (t=$(el)s)"; }
bnew() { echo "=== new (idx7 final)" >> "$VL"; timeout 30 "$W/bench_indexer" $BARGS >> "$VL" 2>&1; say "new bench: exit $? (t=$(el)s)"; }
for x in ${BSEQ:-r n r n n r n r}; do case $x in r) bref;; n) bnew;; esac; done
timeout 60 "$W/bench_indexer" --no-baseline --batches 1,64,256 --prefill 4096 > "$OUT/bench-full.log" 2>&1; say "full bench: exit $? (t=$(el)s)"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [[ -n "$NCU" ]]; then
  timeout 40 "$NCU" --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis --section InstructionStats -k regex:balanced \
     --launch-skip 9 --launch-count 1 "$W/bench_indexer" --no-baseline --batches 256 --prefill 4096 --reps 1 --warmup 1 --rep-ms 0.1 > "$OUT/ncu.txt" 2>&1
  say "ncu: exit $? (t=$(el)s)"
fi
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout ${MEM_T:-100} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" --test-threads=1 > "$OUT/memcheck-cuda_indexer.log" 2>&1
say "memcheck cuda_indexer ($SAN): exit $? ($(grep -h 'ERROR SUMMARY' "$OUT/memcheck-cuda_indexer.log" | tail -1)) (t=$(el)s)"
cat "$S"
