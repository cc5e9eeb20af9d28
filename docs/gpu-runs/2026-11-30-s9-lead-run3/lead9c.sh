#!/usr/bin/env bash
# Session 9 lead run 3: the ping-pong producer's L2 prefetch of tile k + 2 (default) against none
# (DSV41_SPARSE_ATTENTION_DIAG=16), the attention tests, memcheck of the ping-pong tests.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead9c: $*" | tee -a "$S"; }
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
timeout 90 "$W/cuda_sparse_attention" --test-threads=1 > "$L/tests.log" 2>&1
say "tests cuda_sparse_attention: exit $? ($(grep -h 'test result' "$L/tests.log" | tail -1)) t=$((SECONDS-t0))"
SAN=""; for c in "$CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
timeout 60 "$SAN" --tool memcheck --error-exitcode 99 "$W/cuda_sparse_attention" --test-threads=1 head_split_pingpong > "$L/memcheck.log" 2>&1
say "memcheck pingpong: exit $? ($(grep -h 'test result' "$L/memcheck.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck.log")) t=$((SECONDS-t0))"
for v in "" 16 "" 16; do
  DSV41_SPARSE_ATTENTION_DIAG=$v timeout 60 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 7 > "$L/bench-$v.log" 2>&1
  say "bench DIAG=[$v]: exit $? t=$((SECONDS-t0))"
  grep -E "^decode B=(1|64|256)( |$)|ping-pong|share" "$L/bench-$v.log" | head -12 | sed "s/^/[$v] /" >> "$S"
done
timeout 60 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 3 --trace > "$L/bench-trace.log" 2>&1
grep -E "^decode B=(1|64|256) ping-pong:" "$L/bench-trace.log" | cut -c1-900 >> "$S"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
