#!/usr/bin/env bash
# Session 9 lead run 1 (merged main: sattn9 ping-pong + gen9 decoder ops + seesaw9 all-heads loop):
# attention / layer / decoder-op tests, golden --device cuda (bf16, packed), memcheck of the attention
# tests, racecheck of the S = 1 seesaw cases and the ping-pong tests, the decode bench (B = 1 / 64 / 256).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead9a: $*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
for b in cuda_sparse_attention cuda_layer cuda_decoder_ops; do
  timeout 120 "$W/$b" --test-threads=1 > "$L/tests-$b.log" 2>&1; say "tests $b: exit $? ($(grep -h 'test result' "$L/tests-$b.log" | tail -1)) t=$((SECONDS-t0))"
  grep -E "panicked|FAILED" "$L/tests-$b.log" | head -5 >> "$S"
done
for c in bf16 packed; do
  timeout 90 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c > "$L/golden-cuda-$c.log" 2>&1
  say "golden cuda $c: exit $? ($(tail -1 "$L/golden-cuda-$c.log")) t=$((SECONDS-t0))"
done
SAN=""; for c in "$CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
timeout 90 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_sparse_attention" --test-threads=1 > "$L/memcheck-cuda_sparse_attention.log" 2>&1
say "memcheck cuda_sparse_attention: exit $? ($(grep -h 'test result' "$L/memcheck-cuda_sparse_attention.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-cuda_sparse_attention.log" | tail -1)) t=$((SECONDS-t0))"
for f in sharp_logits_move_the_running_max_h64 prefill_batch_one_cta_per_token head_split_pingpong; do
  timeout 50 "$SAN" --tool racecheck --racecheck-report hazard --error-exitcode 99 --print-limit 10 "$W/cuda_sparse_attention" --test-threads=1 $f > "$L/racecheck-$f.log" 2>&1
  say "racecheck $f: exit $? ($(grep -h 'test result' "$L/racecheck-$f.log" | tail -1)) ($(grep -h 'RACECHECK SUMMARY\|ERROR SUMMARY' "$L/racecheck-$f.log" | head -2 | tr '\n' ' ')) t=$((SECONDS-t0))"
done
timeout 80 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 7 > "$L/bench.log" 2>&1
say "bench: exit $? t=$((SECONDS-t0))"
grep -E "^decode B=|in-stream|share|Auto|auto" "$L/bench.log" | head -40 >> "$S"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
