#!/usr/bin/env bash
# Session 11 run 15: the packed-rows tests with the bf16 side forced to the all-heads kernel where the packed side runs Auto (run 14 failed 3 of 7: Auto now runs the dims-split pair for all-bf16 decode), with memcheck.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "s11r15: $*" | tee -a "$S"; }
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
timeout 120 "$W/cuda_sparse_attention_packed" --test-threads=1 > "$L/tests-packed.log" 2>&1
say "tests cuda_sparse_attention_packed: exit $? ($(grep -h 'test result' "$L/tests-packed.log" | tail -1)) t=$((SECONDS-t0))"
grep -E "panicked|FAILED" "$L/tests-packed.log" | head -5 >> "$S"
SAN=""; for c in "$CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
timeout 240 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 30 "$W/cuda_sparse_attention_packed" --test-threads=1 > "$L/memcheck-packed.log" 2>&1
say "memcheck packed: exit $? ($(grep -h 'test result' "$L/memcheck-packed.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-packed.log" | tail -1)) t=$((SECONDS-t0))"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
