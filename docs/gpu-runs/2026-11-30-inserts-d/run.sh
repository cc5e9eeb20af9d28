#!/usr/bin/env bash
# Run (final main): attention tests (with the ring-vs-two-stage bitwise test) and indexer tests
# (top-k without its switch), memcheck of both filtered to the changed paths, bench_insert's format-E rows (final
# kernels, interleaved repetitions), bench_sparse_attention (standalone + in-stream, Auto vs HeadSplitRing) and the
# batched decode step at B = 64 with --attention-kernel auto / ring (event breakdown + graph replay).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead8q: $*" | tee -a "$S"; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
for b in cuda_sparse_attention cuda_indexer; do
  timeout 120 "$W/$b" --test-threads=1 > "$L/tests-$b.log" 2>&1; say "tests $b: exit $? ($(grep -h 'test result' "$L/tests-$b.log" | tail -1)) t=$((SECONDS-t0))"
done
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout 60 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_sparse_attention" ring --test-threads=1 > "$L/memcheck-attention-ring.log" 2>&1
say "memcheck cuda_sparse_attention ring: exit $? ($(grep -h 'test result' "$L/memcheck-attention-ring.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-attention-ring.log" | tail -1)) t=$((SECONDS-t0))"
timeout 60 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" topk --test-threads=1 > "$L/memcheck-indexer-topk.log" 2>&1
say "memcheck cuda_indexer topk: exit $? ($(grep -h 'test result' "$L/memcheck-indexer-topk.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-indexer-topk.log" | tail -1)) t=$((SECONDS-t0))"
ONLY="index_key packed E prefill T=65536,index_key packed E ratio 1,index_key_insert Q3 prefill T=65536,index_key_insert Q3 ratio 1"
for r in $(seq 1 ${INS_REPS:-9}); do
  echo "=== rep $r" >> "$L/bench-insert.log"
  timeout 10 "$W/bench_insert" --no-baseline --only "$ONLY" > "$W/b.out" 2>&1; rc=$?
  cat "$W/b.out" >> "$L/bench-insert.log"; grep -E "prefill|ratio" "$W/b.out" | cut -c1-110 | sed "s/^/r$r /" >> "$S"
done
say "bench insert done t=$((SECONDS-t0))"
for i in 1 2; do
  echo "=== $i" >> "$L/bench-sa.log"
  timeout 60 "$W/bench_sparse_attention" --reps 7 --warmup 3 --no-prefill --no-packed --no-baseline >> "$L/bench-sa.log" 2>&1
  say "bench sparse attention $i: exit $? t=$((SECONDS-t0))"
done
for k in ${BD_ORDER:-auto ring ring auto}; do
  echo "=== --attention-kernel $k" >> "$L/bench-batched.log"
  timeout 90 "$W/bench_batched_decode" --batch 64 --keys packed --steps 10 --warmup 3 --graph --attention-kernel $k >> "$L/bench-batched.log" 2>&1
  say "bench batched $k: exit $? t=$((SECONDS-t0))"
done
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
