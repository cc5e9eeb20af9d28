#!/usr/bin/env bash
# Runner of helper sattn6: unpack once, check sha256, the two sparse attention test binaries
# (TEST_FILTER optional), the bench (BENCH_ARGS), optional memcheck (MEMCHECK=1, MEMCHECK_TESTS,
# MC_FILTER) last.   OUT=... bash r.sh
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$OUT/summary.txt"; : > "$S"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
SAN=""; for c in "$TORCH_CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
W="$(mktemp -d)"
TB="cuda_sparse_attention cuda_sparse_attention_packed"
for b in $TB bench_sparse_attention; do xz -dc "$HERE/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 >> "$S"
for b in $TB; do
  t0=$(date +%s)
  timeout "${TEST_TIMEOUT:-40}" "$W/$b" --test-threads=1 ${TEST_FILTER:-} > "$OUT/tests-$b.log" 2>&1
  echo "tests $b: exit $? ($(( $(date +%s) - t0 )) s) ($(grep 'test result' "$OUT/tests-$b.log"))" | tee -a "$S"
  grep -E "^test |panicked|Error" "$OUT/tests-$b.log" | head -40 >> "$S"
done
t0=$(date +%s)
timeout "${BENCH_TIMEOUT:-40}" "$W/bench_sparse_attention" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench args=[${BENCH_ARGS:-}]: exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$S"
cat "$OUT/bench.log" >> "$S"
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  for b in ${MEMCHECK_TESTS:-cuda_sparse_attention}; do
    t0=$(date +%s)
    timeout "${MC_TIMEOUT:-45}" "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/$b" --test-threads=1 ${MC_FILTER:-} > "$OUT/memcheck-$b.log" 2>&1
    echo "memcheck $b ($SAN): exit $? ($(( $(date +%s) - t0 )) s) ($(grep 'ERROR SUMMARY' "$OUT/memcheck-$b.log"))" | tee -a "$S"
    grep -E "^test |test result" "$OUT/memcheck-$b.log" | head -30 >> "$S"
  done
fi
rm -rf "$W"
