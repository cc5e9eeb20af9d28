#!/usr/bin/env bash
# Session 8 lead run 5 (final main, the binaries run 4 left out): layer tests, packed-row attention tests, insert
# tests, golden --device cuda (bf16 and packed caches), memcheck of the packed attention tests.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead8r: $*" | tee -a "$S"; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
for b in cuda_layer cuda_sparse_attention_packed cuda_insert; do
  timeout 120 "$W/$b" --test-threads=1 > "$L/tests-$b.log" 2>&1; say "tests $b: exit $? ($(grep -h 'test result' "$L/tests-$b.log" | tail -1)) t=$((SECONDS-t0))"
done
for c in bf16 packed; do
  timeout 120 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c > "$L/golden-cuda-$c.log" 2>&1
  say "golden cuda $c: exit $? ($(tail -1 "$L/golden-cuda-$c.log")) t=$((SECONDS-t0))"
done
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout 90 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_sparse_attention_packed" --test-threads=1 > "$L/memcheck-cuda_sparse_attention_packed.log" 2>&1
say "memcheck cuda_sparse_attention_packed: exit $? ($(grep -h 'test result' "$L/memcheck-cuda_sparse_attention_packed.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-cuda_sparse_attention_packed.log" | tail -1)) t=$((SECONDS-t0))"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
