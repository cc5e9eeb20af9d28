#!/usr/bin/env bash
# Run on merged main: tests, memcheck of the indexer + layer tests, golden (bf16 and packed
# caches), decode benches, and last the graph-replayed batched step (may poison the context).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead7: $*" | tee -a "$S"; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
for b in ${TESTS:-cuda_insert cuda_sparse_attention cuda_sparse_attention_packed cuda_indexer cuda_layer}; do
  timeout 200 "$W/$b" --test-threads=1 > "$L/tests-$b.log" 2>&1; say "tests $b: exit $? ($(grep -h 'test result' "$L/tests-$b.log" | tail -1)) t=$((SECONDS-t0))"
done
for c in bf16 packed; do
  timeout 120 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c > "$L/golden-cuda-$c.log" 2>&1
  say "golden cuda $c: exit $? ($(tail -1 "$L/golden-cuda-$c.log")) t=$((SECONDS-t0))"
done
[[ -x "$W/bench_sparse_attention" ]] && { timeout 120 "$W/bench_sparse_attention" ${ARGS_SA:---reps 7 --warmup 3} > "$L/bench-sparse_attention.log" 2>&1; say "bench sparse_attention: exit $? t=$((SECONDS-t0))"; }
[[ -x "$W/bench_insert" ]] && { timeout 120 "$W/bench_insert" ${ARGS_INS:---no-baseline --only prefill,ratio} > "$L/bench-insert.log" 2>&1; say "bench insert: exit $? t=$((SECONDS-t0))"; }
for i in ${IX_REPEAT:-1 2}; do [[ -x "$W/bench_indexer" ]] && { timeout 120 "$W/bench_indexer" ${ARGS_IX:---no-baseline --batches 1,64,256 --prefill 4096} > "$L/bench-indexer-$i.log" 2>&1; say "bench indexer $i: exit $? t=$((SECONDS-t0))"; }; done
[[ -x "$W/bench_batched_decode" ]] && { timeout 150 "$W/bench_batched_decode" ${ARGS_BD:---batch 1,64,256 --keys bf16,packed-kv --steps 5 --warmup 2} > "$L/bench-batched.log" 2>&1; say "bench batched: exit $? t=$((SECONDS-t0))"; }
[[ -x "$W/bench_batched_decode" && -n "${ARGS_GRAPH:-}" ]] && { timeout 120 "$W/bench_batched_decode" $ARGS_GRAPH > "$L/bench-batched-graph.log" 2>&1; say "bench batched graph: exit $? t=$((SECONDS-t0))"; }
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for b in ${MEMCHECK:-cuda_indexer}; do
  timeout ${MEM_T:-240} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/$b" ${MEM_FILTER:-} --test-threads=1 > "$L/memcheck-$b.log" 2>&1
  say "memcheck $b: exit $? ($(grep -h 'ERROR SUMMARY' "$L/memcheck-$b.log" | tail -1)) t=$((SECONDS-t0))"
done
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
