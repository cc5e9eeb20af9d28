#!/usr/bin/env bash
# idx7 run: cuda_indexer tests with the integer MMAs on (default) and off (DSV41_IX_I8=0), the
# indexer bench interleaved: main's binary (bench_indexer_ref, becf105) and this branch with
# DSV41_IX_I8=0 / 1, Nsight Compute of the balanced scores kernel both ways, memcheck (default).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "variants7.sh: $*" | tee -a "$S"; }
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 | tee -a "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
TL="$OUT/tests.log"; : > "$TL"
VL="$OUT/variants.log"; : > "$VL"
BARGS="${BARGS:---no-baseline --batches 64,256 --prefill 4096}"
for v in 1 0; do
  echo "=== tests DSV41_IX_I8=$v" >> "$TL"
  DSV41_IX_I8=$v timeout 60 "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests I8=$v: exit $? ($(grep -h 'test result' "$TL" | tail -1)) (t=$(el)s)"
done
bref() { echo "=== ref (main becf105 binary)" >> "$VL"; timeout 30 "$W/bench_indexer_ref" $BARGS >> "$VL" 2>&1; say "ref bench: exit $? (t=$(el)s)"; }
bnew() { echo "=== new DSV41_IX_I8=$1" >> "$VL"; DSV41_IX_I8=$1 timeout 30 "$W/bench_indexer" $BARGS >> "$VL" 2>&1; say "new bench I8=$1: exit $? (t=$(el)s)"; }
for x in ${BSEQ:-r n0 n1 r n0 n1 n1 n0 r}; do
  case $x in r) bref;; n*) bnew ${x#n};; esac
done
DSV41_IX_I8=1 timeout 60 "$W/bench_indexer" --no-baseline --batches 1,64,256 --prefill 4096 > "$OUT/bench-full.log" 2>&1; say "full bench I8=1: exit $? (t=$(el)s)"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [[ -n "$NCU" ]]; then
  for v in 1 0; do
    DSV41_IX_I8=$v timeout 40 "$NCU" --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis --section InstructionStats -k regex:balanced \
       --launch-skip 9 --launch-count 1 "$W/bench_indexer" --no-baseline --batches 256 --prefill 4096 --reps 1 --warmup 1 --rep-ms 0.1 > "$OUT/ncu-i8-$v.txt" 2>&1
    say "ncu I8=$v: exit $? (t=$(el)s)"
  done
fi
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout ${MEM_T:-100} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" --test-threads=1 > "$OUT/memcheck-cuda_indexer.log" 2>&1
say "memcheck cuda_indexer default ($SAN): exit $? ($(grep -h 'ERROR SUMMARY' "$OUT/memcheck-cuda_indexer.log" | tail -1)) (t=$(el)s)"
cat "$S"
