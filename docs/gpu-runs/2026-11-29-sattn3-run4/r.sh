#!/usr/bin/env bash
# Runner of helper sattn3: unpack once, tests under each kernel variant, bench with a variant sweep.
#   OUT=... VARIANTS="2 1 0" BENCH_ARGS="..." MEMCHECK=0|1 bash gpu-extra/sattn3/r.sh
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for b in cuda_sparse_attention bench_sparse_attention; do xz -dc "$HERE/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
for vk in ${VARIANTS:-}; do
  v=${vk%%:*}; k=0; [[ "$vk" == *:* ]] && k=${vk#*:}
  DSV41_SPARSE_ATTENTION_KNOBS=$k DSV41_SPARSE_ATTENTION_VARIANT=$v timeout "${TEST_TIMEOUT:-40}" "$W/cuda_sparse_attention" --test-threads=1 > "$OUT/tests-v$v-k$k.log" 2>&1
  echo "tests variant $v knobs $k: exit $? ($(grep 'test result' "$OUT/tests-v$v-k$k.log"))" | tee -a "$S"
done
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  SAN=""; for c in "$TORCH_CU13/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer; do [[ -x "$c" ]] && { SAN="$c"; break; }; done
  timeout "${MC_TIMEOUT:-60}" "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_sparse_attention" --test-threads=1 > "$OUT/memcheck.log" 2>&1
  echo "memcheck ($SAN): exit $? ($(grep 'ERROR SUMMARY' "$OUT/memcheck.log"))" | tee -a "$S"
fi
read -r -a BA <<< "${BENCH_ARGS:-}"
timeout "${BENCH_TIMEOUT:-75}" "$W/bench_sparse_attention" "${BA[@]}" > "$OUT/bench.log" 2>&1
echo "bench: exit $?" | tee -a "$S"
cat "$OUT/bench.log"
