#!/usr/bin/env bash
# Run: the run-12 bench binary (final code) three more times (decode, bf16 rows), for the spread of the
# B = 64 figures across repetitions of the whole bench; nvidia-smi clock / power sampling.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 100 > "$L/smi.csv" 2>&1 &
SMI=$!
for i in 1 2 3; do
  timeout 60 "$W/bench_sparse_attention" --no-prefill --no-packed --reps 9 --warmup 2 > "$L/bench$i.log" 2>&1
  echo "s11r13: bench $i: exit $?" >> "$S"
  grep -E "^decode B=(1|64|256)( |$)|^decode B=(1|64|256) (all|dims)|share|L2 flush" "$L/bench$i.log" | cut -c1-160 >> "$S"
done
kill $SMI 2>/dev/null
awk -F, 'NR>1{print $2, $4}' "$L/smi.csv" | sort | uniq -c | sort -rn | head -8 >> "$S"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
