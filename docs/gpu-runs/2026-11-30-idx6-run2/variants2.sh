#!/usr/bin/env bash
# idx6 run 2: tests (+ memcheck) of the final binary, bench per switch of the new binary
# (DSV41_IX_VAR: 63 default = NOH2|EPI|SC|REG|SPEC|PRED; 31 no PRED; 23 no REG; 15 no SPEC; 7 = NOH2|EPI|SC)
# and of run 1's binary (bench_indexer_ref: 0 = main's kernel, 21 = NOH2|EPI|SC of run 1), the
# default full bench, one Nsight Compute details page. At most 7 output files (the device returns 8).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "variants2.sh: $*" | tee -a "$S"; }
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
for b in cuda_indexer bench_indexer bench_indexer_ref; do xz -dc "$HERE/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 | tee -a "$S"
sha256sum "$W/bench_indexer_ref" | tee -a "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
TL="$OUT/tests.log"; : > "$TL"
VL="$OUT/variants.log"; : > "$VL"
BARGS="--no-baseline --batches 64,256 --prefill 4096"
echo "=== tests default" >> "$TL"
timeout 60 "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests default: exit $? (t=$(el)s)"
for v in ${TVARS:-}; do
  echo "=== tests DSV41_IX_VAR=$v" >> "$TL"
  DSV41_IX_VAR=$v timeout 40 "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests var $v: exit $? (t=$(el)s)"
done
bref() { echo "=== ref (run 1 binary) DSV41_IX_VAR=$1" >> "$VL"; DSV41_IX_VAR=$1 timeout 30 "$W/bench_indexer_ref" $BARGS >> "$VL" 2>&1; say "ref bench var $1: exit $? (t=$(el)s)"; }
bnew() { echo "=== new DSV41_IX_VAR=$1" >> "$VL"; DSV41_IX_VAR=$1 timeout 30 "$W/bench_indexer" $BARGS >> "$VL" 2>&1; say "new bench var $1: exit $? (t=$(el)s)"; }
for x in ${BSEQ:-r0 n63 n31 n23 n15 n7 r21 r0 n63}; do
  case $x in r*) bref ${x#r};; n*) bnew ${x#n};; esac
done
timeout 60 "$W/bench_indexer" > "$OUT/bench-bench_indexer.log" 2>&1; say "full bench (default): exit $? (t=$(el)s)"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [[ -n "${NCU_V:-}" && -n "$NCU" ]]; then
  DSV41_IX_VAR=$NCU_V timeout ${NCU_T:-30} "$NCU" --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis -k regex:balanced \
     --launch-skip 9 --launch-count 1 "$W/bench_indexer" --no-baseline --batches 256 --prefill 4096 --reps 1 --warmup 1 --rep-ms 0.1 > "$OUT/ncu-details.txt" 2>&1
  say "ncu var $NCU_V: exit $? (t=$(el)s)"
fi
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  timeout ${MEM_T:-100} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" --test-threads=1 > "$OUT/memcheck-cuda_indexer.log" 2>&1
  say "memcheck cuda_indexer default ($SAN): exit $? (t=$(el)s)"
fi
cat "$S"
