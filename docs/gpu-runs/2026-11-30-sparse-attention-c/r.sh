#!/usr/bin/env bash
# Run on the final code: the packed-rows attention tests (the all-heads kernel changed: 3-round
# instantiation) with memcheck, and generate --device cuda on the embedded model (decode now runs the dims-split pair
# at B = 1), its text compared with the earlier generate run's.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "s11r14: $*" | tee -a "$S"; }
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
timeout 120 "$W/cuda_sparse_attention_packed" --test-threads=1 > "$L/tests-packed.log" 2>&1
say "tests cuda_sparse_attention_packed: exit $? ($(grep -h 'test result' "$L/tests-packed.log" | tail -1)) t=$((SECONDS-t0))"
grep -E "panicked|FAILED" "$L/tests-packed.log" | head -5 >> "$S"
M="--model models/v41-shakespeare-tiny"
for i in 1 2; do
  timeout 60 "$W/generate" $M --device cuda > "$L/generate-default-$i.out" 2> "$L/generate-default-$i.err"
  say "generate --device cuda rep $i: exit $? $(grep -h 'tokens/s' "$L/generate-default-$i.err" | tail -2 | tr '\n' ' ') t=$((SECONDS-t0))"
done
if cmp -s "$L/generate-default-1.out" "$HERE/ref-generate-cuda-default.out"; then say "generate text == gen9 run 2's"; else say "generate text DIFFERS from gen9 run 2's"; fi
SAN=""; for c in "$CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
timeout 240 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 30 "$W/cuda_sparse_attention_packed" --test-threads=1 > "$L/memcheck-packed.log" 2>&1
say "memcheck packed: exit $? ($(grep -h 'test result' "$L/memcheck-packed.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-packed.log" | tail -1)) t=$((SECONDS-t0))"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
