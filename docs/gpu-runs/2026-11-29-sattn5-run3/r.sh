#!/usr/bin/env bash
# Runner of helper sattn5: unpack once, check sha256, the two sparse attention test binaries per
# variant (VARIANTS: values of DSV41_SPARSE_ATTENTION_HS, "0" = default), benches per variant
# (BVARIANTS "hs:extra args" separated by ';'), optional memcheck (MEMCHECK=1) last.
#   OUT=... bash r.sh
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
for v in ${VARIANTS:-0}; do
  TBV="$TB"; [[ "$v" == 0 ]] || TBV=cuda_sparse_attention   # the other variants: the bf16 tests only
  for b in $TBV; do
    DSV41_SPARSE_ATTENTION_HS=$v timeout "${TEST_TIMEOUT:-40}" "$W/$b" --test-threads=1 > "$OUT/tests-$b-$v.log" 2>&1
    echo "tests $b hs=$v: exit $? ($(grep 'test result' "$OUT/tests-$b-$v.log"))" | tee -a "$S"
  done
done
IFS=';' read -r -a BV <<< "${BVARIANTS:-0:}"
for bv in "${BV[@]}"; do
  v="${bv%%:*}"; a="${bv#*:}"
  read -r -a BA <<< "${BENCH_ARGS:-} $a"
  t0=$(date +%s)
  DSV41_SPARSE_ATTENTION_HS=$v timeout "${BENCH_TIMEOUT:-40}" "$W/bench_sparse_attention" "${BA[@]}" > "$OUT/bench-$v.log" 2>&1
  echo "bench hs=$v args=[${BA[*]}]: exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$S"
  grep -v trace "$OUT/bench-$v.log"
done
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  for b in ${MEMCHECK_TESTS:-cuda_sparse_attention}; do
    for v in ${MC_VARIANTS:-0}; do
      DSV41_SPARSE_ATTENTION_HS=$v timeout "${MC_TIMEOUT:-45}" "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/$b" --test-threads=1 > "$OUT/memcheck-$b-$v.log" 2>&1
      echo "memcheck $b hs=$v ($SAN): exit $? ($(grep 'ERROR SUMMARY' "$OUT/memcheck-$b-$v.log"))" | tee -a "$S"
    done
  done
fi
rm -rf "$W"
# Few files come back: every log in one archive, the summary apart.
T="$(mktemp)"; (cd "$OUT" && tar czf "$T" --exclude=summary.txt . && find . -maxdepth 1 -type f ! -name summary.txt -delete) && mv "$T" "$OUT/logs.tgz"
