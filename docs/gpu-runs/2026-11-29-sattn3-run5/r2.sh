#!/usr/bin/env bash
# Runner of helper sattn3, round 4: for each build folder (B = candidate, A = fallback): unpack,
# check sha256, tests, optional memcheck (MEMCHECK_DIRS), bench.  OUT=... DIRS="B A" bash r2.sh
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$OUT/summary.txt"; : > "$S"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
SAN=""; for c in "$TORCH_CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
read -r -a BA <<< "${BENCH_ARGS:-}"
for d in ${DIRS:-B A}; do
  W="$(mktemp -d)"
  for b in cuda_sparse_attention bench_sparse_attention; do xz -dc "$HERE/$d/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
  (cd "$W" && sha256sum -c "$HERE/$d/SHA256SUMS") 2>&1 | sed "s/^/$d: /" >> "$S"
  timeout "${TEST_TIMEOUT:-30}" "$W/cuda_sparse_attention" --test-threads=1 > "$OUT/tests-$d.log" 2>&1
  echo "$d tests: exit $? ($(grep 'test result' "$OUT/tests-$d.log"))" | tee -a "$S"
  if [[ " ${MEMCHECK_DIRS:-} " == *" $d "* ]]; then
    timeout "${MC_TIMEOUT:-45}" "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_sparse_attention" --test-threads=1 > "$OUT/memcheck-$d.log" 2>&1
    echo "$d memcheck ($SAN): exit $? ($(grep 'ERROR SUMMARY' "$OUT/memcheck-$d.log"))" | tee -a "$S"
  fi
  timeout "${BENCH_TIMEOUT:-45}" "$W/bench_sparse_attention" "${BA[@]}" > "$OUT/bench-$d.log" 2>&1
  echo "$d bench: exit $?" | tee -a "$S"
  grep -v trace "$OUT/bench-$d.log"
  rm -rf "$W"
done
