#!/usr/bin/env bash
# Helper idx9, run 1: cuda_indexer with the experiment switch DSV41_IX9 (unset = integer MMAs in every packed
# kernel; 3 = grid decode + prefill without them; 4 = the grid kernel for B >= 64 too; 8 = deliberate break of the
# grid kernels' integer path: the new tests must FAIL), bench_indexer interleaved with main 35f2b55's binary
# (bench_indexer_ref = lead run s7-2's bench_indexer), memcheck of the integer-path tests.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "idx9: $*" | tee -a "$S"; }
L="$OUT/logs"; mkdir -p "$L"
nvidia-smi > "$L/nvidia-smi.txt" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
t0=$SECONDS
for v in ${TEST_VARIANTS:-none 3 4 8}; do
  if [[ $v == none ]]; then unset DSV41_IX9; else export DSV41_IX9=$v; fi
  timeout 60 "$W/cuda_indexer" --test-threads=1 > "$L/tests-cuda_indexer-$v.log" 2>&1; rc=$?
  say "tests cuda_indexer DSV41_IX9=$v: exit $rc ($(grep -h 'test result' "$L/tests-cuda_indexer-$v.log" | tail -1)) t=$((SECONDS-t0))"
  grep -h "FAILED\|failed\|panicked" "$L/tests-cuda_indexer-$v.log" | head -8 >> "$S"
done
unset DSV41_IX9
i=0
for v in ${IX_ORDER:-ref 0 3 4 4 3 0 ref ref 0 3 4}; do
  i=$((i+1)); bin=bench_indexer; [[ $v == ref ]] && bin=bench_indexer_ref
  if [[ $v == ref || $v == 0 ]]; then unset DSV41_IX9; else export DSV41_IX9=$v; fi
  echo "=== $i $v ($bin)" >> "$L/bench-indexer.log"
  timeout 40 "$W/$bin" --no-baseline --batches ${BATCHES:-1,16,32,64,256} --prefill 4096 >> "$L/bench-indexer.log" 2>&1; say "bench indexer $i $v: exit $? t=$((SECONDS-t0))"
  [[ $((SECONDS-t0)) -gt ${BENCH_STOP:-105} ]] && break
done
unset DSV41_IX9
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout ${MEM_T:-30} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" integer_path --test-threads=1 > "$L/memcheck-cuda_indexer.log" 2>&1
say "memcheck cuda_indexer (integer_path): exit $? ($(grep -h 'ERROR SUMMARY' "$L/memcheck-cuda_indexer.log" | tail -1)) t=$((SECONDS-t0))"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
