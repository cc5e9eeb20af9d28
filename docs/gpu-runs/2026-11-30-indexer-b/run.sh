#!/usr/bin/env bash
# Run on the final merged main: cuda_insert + cuda_indexer tests, bench_indexer interleaved with the
# previous main's binary (bench_indexer_ref, run 1), the layer bench (decode + prefill 4K-32K), memcheck last.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "lead7b: $*" | tee -a "$S"; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
for b in cuda_insert cuda_indexer; do
  timeout 200 "$W/$b" --test-threads=1 > "$L/tests-$b.log" 2>&1; say "tests $b: exit $? ($(grep -h 'test result' "$L/tests-$b.log" | tail -1)) t=$((SECONDS-t0))"
done
i=0
for v in ${IX_ORDER:-ref new new ref ref new}; do
  i=$((i+1)); bin=bench_indexer; [[ $v == ref ]] && bin=bench_indexer_ref
  echo "=== $i $v ($bin)" >> "$L/bench-indexer.log"
  timeout 60 "$W/$bin" --no-baseline --batches 64,256 --prefill 4096 >> "$L/bench-indexer.log" 2>&1; say "bench indexer $i $v: exit $? t=$((SECONDS-t0))"
done
timeout 240 "$W/bench_attention_layer" ${ARGS_AL:---steps 10 --prefill 4096,8192,16384,32768 --prefill-compressed 4096,8192,16384,32768 --plain-prefill 4096 --plain-steps 3} > "$L/bench-attention-layer.log" 2>&1; say "bench attention layer: exit $? t=$((SECONDS-t0))"
SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout ${MEM_T:-90} "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" balanced --test-threads=1 > "$L/memcheck-cuda_indexer.log" 2>&1
say "memcheck cuda_indexer (balanced): exit $? ($(grep -h 'ERROR SUMMARY' "$L/memcheck-cuda_indexer.log" | tail -1)) t=$((SECONDS-t0))"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
