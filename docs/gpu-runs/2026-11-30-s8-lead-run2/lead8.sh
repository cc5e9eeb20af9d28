#!/usr/bin/env bash
# Session 8 lead run 2 (main 35f2b55 + the bench switch DSV41_BENCH_EVENT_TRACKING): the attention tests on main
# (not re-run in session 7), then bench_sparse_attention and bench_indexer interleaved with cudarc's event tracking on
# (default) and off (DSV41_BENCH_EVENT_TRACKING=0), memcheck of cuda_sparse_attention last.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead8: $*" | tee -a "$S"; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
for b in cuda_sparse_attention cuda_sparse_attention_packed; do
  timeout 60 "$W/$b" --test-threads=1 > "$L/tests-$b.log" 2>&1; say "tests $b: exit $? ($(grep -h 'test result' "$L/tests-$b.log" | tail -1)) t=$((SECONDS-t0))"
done
i=0
for et in ${ET_ORDER:-1 0 0 1 1 0}; do
  i=$((i+1))
  echo "=== $i event tracking $et" >> "$L/bench-sa.log"
  DSV41_BENCH_EVENT_TRACKING=$et timeout 60 "$W/bench_sparse_attention" ${ARGS_SA:---reps 7 --warmup 3 --no-prefill --no-packed --no-baseline} >> "$L/bench-sa.log" 2>&1
  say "bench sparse attention $i ET=$et: exit $? t=$((SECONDS-t0))"
done
i=0
for et in ${IX_ORDER:-1 0 0 1}; do
  i=$((i+1))
  echo "=== $i event tracking $et" >> "$L/bench-indexer.log"
  DSV41_BENCH_EVENT_TRACKING=$et timeout 60 "$W/bench_indexer" --no-baseline --batches 1,64,256 --prefill 4096 >> "$L/bench-indexer.log" 2>&1
  say "bench indexer $i ET=$et: exit $? t=$((SECONDS-t0))"
done
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if (( SECONDS - t0 < ${MEM_BEFORE:-200} )); then
  timeout ${MEM_T:-80} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_sparse_attention" --test-threads=1 > "$L/memcheck-cuda_sparse_attention.log" 2>&1
  say "memcheck cuda_sparse_attention: exit $? ($(grep -h 'ERROR SUMMARY' "$L/memcheck-cuda_sparse_attention.log" | tail -1)) t=$((SECONDS-t0))"
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
