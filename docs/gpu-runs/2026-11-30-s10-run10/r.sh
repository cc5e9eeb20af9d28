#!/usr/bin/env bash
# Session 10 run 10 (diagnostic): the dims-split pair's in-stream penalty — the decode bench three times:
# default, DSV41_SPARSE_ATTENTION_DIAG=32 (dims-split launched without programmatic dependent launch),
# DSV41_SPARSE_ATTENTION_DIAG=64 (dims-split clusters with the spread scheduling policy).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "s10r10: $*" | tee -a "$S"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
t0=$SECONDS
for d in 0 32 64 0 32; do
  DSV41_SPARSE_ATTENTION_DIAG=$d timeout 100 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 9 --warmup 2 > "$OUT/bench-diag$d.log" 2>&1
  say "bench DIAG=$d: exit $? t=$((SECONDS-t0))"
  grep -E "^decode B=64 (dims|ping)|^decode B=64 +[0-9]|share" "$OUT/bench-diag$d.log" | cut -c1-150 >> "$S"
done
cat "$S"
