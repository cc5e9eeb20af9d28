#!/usr/bin/env bash
# Run 2 (final, commit 1f0a266): cuda_indexer; cuda_indexer_brk = the same tests against a deliberately
# broken kernel (the balanced kernel's key-range fallback disabled: `kok = true || ...`, not committed) - the
# integer-path test must FAIL; bench_indexer interleaved with main 35f2b55's binary (bench_indexer_ref = run
# s7-2's bench_indexer); memcheck of cuda_indexer (integer-path, balanced, packed-key and prefill tests).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "idx9: $*" | tee -a "$S"; }
L="$OUT/logs"; mkdir -p "$L"
nvidia-smi > "$L/nvidia-smi.txt" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
t0=$SECONDS
for b in cuda_indexer cuda_indexer_brk; do
  timeout 60 "$W/$b" --test-threads=1 > "$L/tests-$b.log" 2>&1; rc=$?
  say "tests $b: exit $rc ($(grep -h 'test result' "$L/tests-$b.log" | tail -1)) t=$((SECONDS-t0))"
  grep -h "\.\.\. FAILED" "$L/tests-$b.log" | head -8 >> "$S"
done
i=0
for v in ${IX_ORDER:-ref new new ref ref new new ref}; do
  i=$((i+1)); bin=bench_indexer; [[ $v == ref ]] && bin=bench_indexer_ref
  echo "=== $i $v ($bin)" >> "$L/bench-indexer.log"
  timeout 40 "$W/$bin" --no-baseline --batches ${BATCHES:-1,16,32,64,256} --prefill 4096 >> "$L/bench-indexer.log" 2>&1; say "bench indexer $i $v: exit $? t=$((SECONDS-t0))"
  [[ $((SECONDS-t0)) -gt ${BENCH_STOP:-80} ]] && break
done
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout ${MEM_T:-50} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" integer_path balanced packed_keys --test-threads=1 > "$L/memcheck-cuda_indexer.log" 2>&1
say "memcheck cuda_indexer (integer_path balanced packed_keys): exit $? ($(grep -h 'ERROR SUMMARY' "$L/memcheck-cuda_indexer.log" | tail -1); $(grep -h 'test result' "$L/memcheck-cuda_indexer.log" | tail -1)) t=$((SECONDS-t0))"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
