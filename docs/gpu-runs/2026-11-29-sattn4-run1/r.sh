#!/usr/bin/env bash
# Runner of helper sattn4: unpack once, check sha256, tests per kernel variant (VARIANTS: values of
# DSV41_SPARSE_ATTENTION_DIAG, "0" = default), benches per variant (BVARIANTS "diag:extra args"),
# optional memcheck (MEMCHECK=1, default variant) last.   OUT=... bash r.sh
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$OUT/summary.txt"; : > "$S"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
SAN=""; for c in "$TORCH_CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
W="$(mktemp -d)"
for b in cuda_sparse_attention bench_sparse_attention; do xz -dc "$HERE/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 >> "$S"
for v in ${VARIANTS:-0}; do
  DSV41_SPARSE_ATTENTION_DIAG=$v timeout "${TEST_TIMEOUT:-30}" "$W/cuda_sparse_attention" --test-threads=1 > "$OUT/tests-$v.log" 2>&1
  echo "tests diag=$v: exit $? ($(grep 'test result' "$OUT/tests-$v.log"))" | tee -a "$S"
done
IFS=';' read -r -a BV <<< "${BVARIANTS:-0:}"
for bv in "${BV[@]}"; do
  v="${bv%%:*}"; a="${bv#*:}"
  read -r -a BA <<< "${BENCH_ARGS:-} $a"
  t0=$(date +%s)
  DSV41_SPARSE_ATTENTION_DIAG=$v timeout "${BENCH_TIMEOUT:-40}" "$W/bench_sparse_attention" "${BA[@]}" > "$OUT/bench-$v.log" 2>&1
  echo "bench diag=$v args=[${BA[*]}]: exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$S"
  grep -v trace "$OUT/bench-$v.log"
done
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  timeout "${MC_TIMEOUT:-45}" "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_sparse_attention" --test-threads=1 > "$OUT/memcheck.log" 2>&1
  echo "memcheck ($SAN): exit $? ($(grep 'ERROR SUMMARY' "$OUT/memcheck.log"))" | tee -a "$S"
fi
rm -rf "$W"
