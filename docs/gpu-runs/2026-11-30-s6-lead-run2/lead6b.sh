#!/usr/bin/env bash
# Session 6 lead run 2: the L2 evict-first key copies of the balanced indexer kernel (DSV41_IX_L2=1)
# against main's (unset), interleaved; tests under the variant; the graph-replayed layer step.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead6b: $*" | tee -a "$S"; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"; t0=$SECONDS
DSV41_IX_L2=1 timeout 120 "$W/cuda_indexer" --test-threads=1 > "$L/tests-cuda_indexer-l2.log" 2>&1
say "tests cuda_indexer L2=1: exit $? ($(grep -h 'test result' "$L/tests-cuda_indexer-l2.log" | tail -1)) t=$((SECONDS-t0))"
for i in 1 2 3; do for v in 0 1; do
  DSV41_IX_L2=$v timeout 60 "$W/bench_indexer" --no-baseline --batches 64,256 --prefill 4096 > "$L/bench-indexer-l2$v-$i.log" 2>&1
  say "bench indexer L2=$v #$i: exit $? $(grep -E '^256 +mxfp4' "$L/bench-indexer-l2$v-$i.log") t=$((SECONDS-t0))"
done; done
for v in 0 1; do
  DSV41_IX_L2=$v timeout 120 "$W/bench_batched_decode" --batch 1,64,256 --keys packed-kv --steps 5 --warmup 2 --graph > "$L/bench-batched-graph-l2$v.log" 2>&1
  say "bench batched graph L2=$v: exit $? t=$((SECONDS-t0))"
done
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
