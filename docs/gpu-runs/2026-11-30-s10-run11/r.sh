#!/usr/bin/env bash
# Session 10 run 11 (final main: the dims-split pair launched without PDL, Auto at B = 64):
# --device cuda (bf16 and packed caches), memcheck of the dims-split tests, the decode bench with
# traces, the batched decode step (graph replay) per attention kernel.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "s10r11: $*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
for b in cuda_sparse_attention cuda_layer; do
  timeout 150 "$W/$b" --test-threads=1 > "$L/tests-$b.log" 2>&1; say "tests $b: exit $? ($(grep -h 'test result' "$L/tests-$b.log" | tail -1)) t=$((SECONDS-t0))"
  grep -E "panicked|FAILED" "$L/tests-$b.log" | head -5 >> "$S"
done
for c in bf16 packed; do
  timeout 90 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c > "$L/golden-cuda-$c.log" 2>&1
  say "golden cuda $c: exit $? ($(tail -1 "$L/golden-cuda-$c.log")) t=$((SECONDS-t0))"
done
timeout 100 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 9 --warmup 2 --trace > "$L/bench.log" 2>&1
say "bench: exit $? t=$((SECONDS-t0))"
grep -E "^decode B=|share|L2 flush|top-k alone" "$L/bench.log" | cut -c1-200 | head -60 >> "$S"
timeout 100 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 9 --warmup 2 > "$L/bench2.log" 2>&1
say "bench (2nd, no trace): exit $? t=$((SECONDS-t0))"
grep -E "^decode B=64|share|L2 flush|top-k alone" "$L/bench2.log" | cut -c1-200 | head -30 >> "$S"
for k in auto ping-pong auto ping-pong; do
  timeout 60 "$W/bench_batched_decode" --batch 64 --keys packed --steps 10 --warmup 3 --graph --attention-kernel $k > "$L/batched-$k.log" 2>&1
  say "batched [$k]: exit $? $(grep -iE "graph|step" "$L/batched-$k.log" | tail -2 | tr '\n' ' ') t=$((SECONDS-t0))"
done
SAN=""; for c in "$CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
timeout 120 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 30 "$W/cuda_sparse_attention" --test-threads=1 dim_split > "$L/memcheck-dimsplit.log" 2>&1
say "memcheck dim_split: exit $? ($(grep -h 'test result' "$L/memcheck-dimsplit.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-dimsplit.log" | tail -1)) t=$((SECONDS-t0))"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
