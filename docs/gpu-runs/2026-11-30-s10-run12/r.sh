#!/usr/bin/env bash
# Session 10 runs 12-13 (diagnostic; run 13 with the in-stream section at B = 64, 1, 256 and VARIANTS="0 early" "32 late" ...): keep the dims-split pair's programmatic dependent launch behind a top-k that
# triggers its dependents late (DSV41_TOPK_TRIGGER=late: before its emit step) instead of at its start.
# Benches (B = 64 rows and the in-stream section): default; PDL (DIAG=32) + late trigger; default + late trigger;
# PDL + early trigger; default again.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "s10r12: $*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
t0=$SECONDS
i=0
for v in ${VARIANTS:-"0 early" "32 late" "0 late" "32 early" "0 early" "32 late"}; do
  set -- $v; i=$((i+1))
  if [[ $2 == late ]]; then export DSV41_TOPK_TRIGGER=late; else unset DSV41_TOPK_TRIGGER; fi
  DSV41_SPARSE_ATTENTION_DIAG=$1 timeout 100 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 9 --warmup 2 > "$OUT/bench$i-diag$1-$2.log" 2>&1
  say "bench $i DIAG=$1 topk=$2: exit $? t=$((SECONDS-t0))"
  grep -E "^decode B=64 (dims|ping)|^decode B=64 +[0-9]|^in-stream|share|top-k alone" "$OUT/bench$i-diag$1-$2.log" | cut -c1-150 >> "$S"
done
cat "$S"
