#!/usr/bin/env bash
# Candidate final run: Auto runs the dims-split pair for bf16 rows wherever the all-heads kernel
# would split (B = 1 too), the all-heads kernel instantiated for 3 index rounds as well. Tests (attention, layer),
# golden --device cuda (bf16, packed), memcheck of the dims-split and all-heads (seesaw) tests, the decode bench
# twice (with prefill once), the batched decode step, nvidia-smi clock / power sampling during one bench.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "s11r12: $*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
for b in cuda_sparse_attention cuda_layer; do
  timeout 120 "$W/$b" --test-threads=1 > "$L/tests-$b.log" 2>&1; say "tests $b: exit $? ($(grep -h 'test result' "$L/tests-$b.log" | tail -1)) t=$((SECONDS-t0))"
  grep -E "panicked|FAILED" "$L/tests-$b.log" | head -5 >> "$S"
done
for c in bf16 packed; do
  timeout 60 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c > "$L/golden-cuda-$c.log" 2>&1
  say "golden cuda $c: exit $? ($(tail -1 "$L/golden-cuda-$c.log")) t=$((SECONDS-t0))"
done
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 100 > "$L/smi.csv" 2>&1 &
SMI=$!
timeout 150 "$W/bench_sparse_attention" --reps 9 --warmup 2 > "$L/bench1.log" 2>&1
say "bench (with prefill): exit $? t=$((SECONDS-t0))"
kill $SMI 2>/dev/null
grep -E "^decode B=(1|64|256)( |$)|^decode B=(1|64|256) (all|ping|dims)|^prefill|share|L2 flush" "$L/bench1.log" | cut -c1-160 >> "$S"
timeout 60 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 9 --warmup 2 > "$L/bench2.log" 2>&1
say "bench 2: exit $? t=$((SECONDS-t0))"
grep -E "^decode B=(1|64|256)( |$)|^decode B=(1|64) (all|ping|dims)|share|L2 flush" "$L/bench2.log" | cut -c1-160 >> "$S"
for k in auto ping-pong; do
  timeout 40 "$W/bench_batched_decode" --batch 64 --keys packed --steps 10 --warmup 3 --graph --attention-kernel $k > "$L/batched-$k.log" 2>&1
  say "batched [$k]: exit $? $(grep -E '^\| 64' "$L/batched-$k.log" | head -2 | tr '\n' ' ') t=$((SECONDS-t0))"
done
SAN=""; for c in "$CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
timeout 90 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 30 "$W/cuda_sparse_attention" --test-threads=1 dim_split > "$L/memcheck-dimsplit.log" 2>&1
say "memcheck dim_split: exit $? ($(grep -h 'test result' "$L/memcheck-dimsplit.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-dimsplit.log" | tail -1)) t=$((SECONDS-t0))"
timeout 120 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 30 "$W/cuda_sparse_attention" --test-threads=1 seesaw > "$L/memcheck-seesaw.log" 2>&1
say "memcheck seesaw (all-heads): exit $? ($(grep -h 'test result' "$L/memcheck-seesaw.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-seesaw.log" | tail -1)) t=$((SECONDS-t0))"
awk -F, 'NR>1{print $2, $4}' "$L/smi.csv" | sort | uniq -c | sort -rn | head -8 >> "$S"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
