#!/usr/bin/env bash
# Session 9 lead run 2 (final code: the launcher helper dsv41_launch.cuh, SASS unchanged): the attention tests,
# golden --device cuda (bf16, packed), generate --device cuda (texts against gen9's run-2 outputs), a short decode bench.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead9b: $*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
timeout 90 "$W/cuda_sparse_attention" --test-threads=1 > "$L/tests-cuda_sparse_attention.log" 2>&1
say "tests cuda_sparse_attention: exit $? ($(grep -h 'test result' "$L/tests-cuda_sparse_attention.log" | tail -1)) t=$((SECONDS-t0))"
for c in bf16 packed; do
  timeout 90 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c > "$L/golden-cuda-$c.log" 2>&1
  say "golden cuda $c: exit $? ($(tail -1 "$L/golden-cuda-$c.log")) t=$((SECONDS-t0))"
done
M="--model models/v41-shakespeare-tiny"
for i in 1 2 3; do
  timeout 60 "$W/generate" $M --device cuda > "$L/generate-default-$i.out" 2> "$L/generate-default-$i.err"
  say "generate --device cuda rep $i: exit $? $(grep -h 'tokens/s' "$L/generate-default-$i.err" | tail -2 | tr '\n' ' ') t=$((SECONDS-t0))"
done
if cmp -s "$L/generate-default-1.out" "$HERE/ref-generate-cuda-default.out"; then say "generate text == gen9 run 2's"; else say "generate text DIFFERS from gen9 run 2's"; fi
timeout 60 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 5 > "$L/bench.log" 2>&1
say "bench: exit $? t=$((SECONDS-t0))"
grep -E "^decode B=(1|64|256)( |$)|ping-pong|in-stream|share" "$L/bench.log" | head -20 >> "$S"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
