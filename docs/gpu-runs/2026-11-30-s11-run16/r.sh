#!/usr/bin/env bash
# Session 11 run 16: the dims-split epilogue's store phase as a loop over its 4 chunk groups (register window shifted
# down per pass; 940 fewer instructions of run-once code). Tests + memcheck of the dims-split tests, the decode bench
# three times (bf16 rows).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "s11r16: $*" | tee -a "$S"; }
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
timeout 120 "$W/cuda_sparse_attention" --test-threads=1 > "$L/tests.log" 2>&1; say "tests: exit $? ($(grep -h 'test result' "$L/tests.log" | tail -1)) t=$((SECONDS-t0))"
for i in 1 2 3; do
  timeout 60 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 9 --warmup 2 > "$L/bench$i.log" 2>&1
  say "bench $i: exit $? t=$((SECONDS-t0))"
  grep -E "^decode B=(1|64|256)( |$)|^decode B=(1|64) dims|share|L2 flush" "$L/bench$i.log" | cut -c1-120 >> "$S"
done
SAN=""; for c in "$CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
timeout 90 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 30 "$W/cuda_sparse_attention" --test-threads=1 dim_split > "$L/memcheck-dimsplit.log" 2>&1
say "memcheck dim_split: exit $? ($(grep -h 'test result' "$L/memcheck-dimsplit.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-dimsplit.log" | tail -1)) t=$((SECONDS-t0))"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
