#!/usr/bin/env bash
# Session 9 lead run 4 (review mends: shared CUDA storage helpers, float io header): the decoder-op
# tests + memcheck, golden --device cuda (bf16, packed), generate --device cuda text.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead9d: $*" | tee -a "$S"; }
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
t0=$SECONDS
timeout 60 "$W/cuda_decoder_ops" --test-threads=1 > "$OUT/tests.log" 2>&1
say "tests cuda_decoder_ops: exit $? ($(grep -h 'test result' "$OUT/tests.log" | tail -1)) t=$((SECONDS-t0))"
SAN=""; for c in "$CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
timeout 60 "$SAN" --tool memcheck --error-exitcode 99 "$W/cuda_decoder_ops" --test-threads=1 > "$OUT/memcheck.log" 2>&1
say "memcheck cuda_decoder_ops: exit $? ($(grep -h 'test result' "$OUT/memcheck.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$OUT/memcheck.log")) t=$((SECONDS-t0))"
for c in bf16 packed; do
  timeout 60 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c > "$OUT/golden-$c.log" 2>&1
  say "golden cuda $c: exit $? ($(tail -1 "$OUT/golden-$c.log")) t=$((SECONDS-t0))"
done
timeout 60 "$W/generate" --model models/v41-shakespeare-tiny --device cuda > "$OUT/gen.out" 2> "$OUT/gen.err"
say "generate --device cuda: exit $? $(grep -h 'tokens/s' "$OUT/gen.err" | tail -1)"
if cmp -s "$OUT/gen.out" "$HERE/ref.out"; then say "generate text == gen9 run 2's"; else say "generate text DIFFERS from gen9 run 2's"; fi
rm -f "$OUT"/golden-*.log
cat "$S"
