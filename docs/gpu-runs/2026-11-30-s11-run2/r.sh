#!/usr/bin/env bash
# Session 11 run 2: the dims-split pair with the factors before the O hand-over, direct bf16 stores from the fragments (quad transpose), mbarrier init before griddepcontrol.wait; memcheck of the dims-split tests.
# CTA 0's SM clock, the prologue stamps, a back-to-back traced call, the no-epilogue diag (bit 64).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "s11r2: $*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,clocks.applications.graphics --format=csv >> "$S" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
timeout 120 "$W/cuda_sparse_attention" --test-threads=1 > "$L/tests.log" 2>&1; say "tests: exit $? ($(grep -h 'test result' "$L/tests.log" | tail -1)) t=$((SECONDS-t0))"
timeout 90 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 7 --warmup 2 --trace --diag > "$L/bench-trace.log" 2>&1
say "bench trace: exit $? t=$((SECONDS-t0))"
grep -E "^decode B=64|diag decode B=64|^in-stream|share" "$L/bench-trace.log" | cut -c1-160 >> "$S"
grep -E "dims-split" "$L/bench-trace.log" | grep -E "B=64|CTAs" | cut -c1-3000 >> "$S"
timeout 60 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 9 --warmup 2 > "$L/bench.log" 2>&1
say "bench: exit $? t=$((SECONDS-t0))"
grep -E "^decode B=(1|64|256)( |$)|^decode B=64 (ping|dims)|share|L2 flush" "$L/bench.log" | cut -c1-160 >> "$S"
SAN=""; for c in "$CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
timeout 60 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 30 "$W/cuda_sparse_attention" --test-threads=1 dim_split > "$L/memcheck-dimsplit.log" 2>&1
say "memcheck dim_split: exit $? ($(grep -h 'test result' "$L/memcheck-dimsplit.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-dimsplit.log" | tail -1)) t=$((SECONDS-t0))"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
