#!/usr/bin/env bash
# idx8 run: the balanced packed decode scores kernel's variants behind DSV41_IX_EPI (0 = main's
# kernel; 128 = V_EA; 384 = V_EA | V_UPK; 1024 = V_DYN; 1408 = V_EA | V_UPK | V_DYN): cuda_indexer
# under each, the indexer bench interleaved, memcheck (filter balanced) of 1408 and 384, Nsight
# Compute of the B = 256 balanced launch for 0 / 384 / 1024 / 1408 while time is left.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "epi8.sh: $*" | tee -a "$S"; }
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 | tee -a "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
TL="$OUT/tests.log"; : > "$TL"
for v in 1408 1024 384 128 0; do
  echo "=== tests DSV41_IX_EPI=$v" >> "$TL"
  DSV41_IX_EPI=$v timeout 30 "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests EPI=$v: exit $? ($(grep -h 'test result' "$TL" | tail -1)) (t=$(el)s)"
done
VL="$OUT/variants.log"; : > "$VL"
BARGS="--no-baseline --batches 64,256 --prefill 4096"
for v in ${BSEQ:-0 1408 384 1024 128 1408 0 1024 384 128 0 1408 1024}; do
  echo "=== DSV41_IX_EPI=$v" >> "$VL"
  DSV41_IX_EPI=$v timeout 15 "$W/bench_indexer" $BARGS >> "$VL" 2>&1; say "bench EPI=$v: exit $? (t=$(el)s)"
done
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for v in 1408 384; do
  DSV41_IX_EPI=$v timeout 25 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" --test-threads=1 balanced > "$OUT/memcheck-epi-$v.log" 2>&1
  say "memcheck cuda_indexer balanced EPI=$v: exit $? ($(grep -h 'ERROR SUMMARY' "$OUT/memcheck-epi-$v.log" | tail -1); $(grep -h 'test result' "$OUT/memcheck-epi-$v.log" | tail -1)) (t=$(el)s)"
done
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [[ -n "$NCU" ]]; then
  for v in 1408 0 1024 384; do
    (( $(el) > ${NCU_STOP:-100} )) && { say "ncu EPI=$v skipped (time)"; continue; }
    DSV41_IX_EPI=$v timeout 12 "$NCU" --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis --section InstructionStats -k regex:balanced \
       --launch-skip 9 --launch-count 1 "$W/bench_indexer" --no-baseline --batches 256 --prefill 4096 --reps 1 --warmup 1 --rep-ms 0.1 > "$OUT/ncu-epi-$v.txt" 2>&1
    say "ncu EPI=$v: exit $? (t=$(el)s)"
  done
fi
cat "$S"
