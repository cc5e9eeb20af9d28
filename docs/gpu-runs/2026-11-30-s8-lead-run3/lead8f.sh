#!/usr/bin/env bash
# Session 8 lead run 3 (final main): attention tests (default and DSV41_SPARSE_ATTENTION_PAD=1), the ring-vs-two-stage
# bitwise test, the layer tests, golden --device cuda (bf16 and packed caches), bench_sparse_attention interleaved
# default / PAD=1 (standalone + in-stream behind the top-k), memcheck of the attention and layer tests last.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead8f: $*" | tee -a "$S"; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
for b in ${TESTS:-cuda_sparse_attention cuda_sparse_attention_ring cuda_layer}; do
  [[ -x "$W/$b" ]] || continue
  timeout 120 "$W/$b" --test-threads=1 > "$L/tests-$b.log" 2>&1; say "tests $b: exit $? ($(grep -h 'test result' "$L/tests-$b.log" | tail -1)) t=$((SECONDS-t0))"
done
for b in ${PAD_TESTS:-cuda_sparse_attention cuda_layer}; do
  [[ -x "$W/$b" ]] || continue
  DSV41_SPARSE_ATTENTION_PAD=1 timeout 120 "$W/$b" --test-threads=1 > "$L/tests-pad-$b.log" 2>&1; say "tests PAD=1 $b: exit $? ($(grep -h 'test result' "$L/tests-pad-$b.log" | tail -1)) t=$((SECONDS-t0))"
done
if [[ -x "$W/golden" ]]; then for c in bf16 packed; do
  timeout 120 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c > "$L/golden-cuda-$c.log" 2>&1
  say "golden cuda $c: exit $? ($(tail -1 "$L/golden-cuda-$c.log")) t=$((SECONDS-t0))"
done; fi
i=0
for pad in ${PAD_ORDER:-0 1 1 0 0 1}; do
  i=$((i+1))
  echo "=== $i PAD=$pad" >> "$L/bench-sa.log"
  DSV41_SPARSE_ATTENTION_PAD=$pad timeout 60 "$W/bench_sparse_attention" ${ARGS_SA:---reps 7 --warmup 3 --no-prefill --no-packed --no-baseline} >> "$L/bench-sa.log" 2>&1
  say "bench sparse attention $i PAD=$pad: exit $? t=$((SECONDS-t0))"
done
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for b in ${MEMCHECK:-cuda_sparse_attention_ring cuda_layer}; do
  (( SECONDS - t0 < ${MEM_BEFORE:-250} )) || { say "memcheck $b: skipped (time)"; continue; }
  timeout ${MEM_T:-90} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/$b" --test-threads=1 > "$L/memcheck-$b.log" 2>&1
  say "memcheck $b: exit $? ($(grep -h 'ERROR SUMMARY' "$L/memcheck-$b.log" | tail -1)) t=$((SECONDS-t0))"
done
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
