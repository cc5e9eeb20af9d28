#!/usr/bin/env bash
# Session 11 run 5: Nsight Compute profile of one dims-split pair launch at B = 64 (run-4 binaries): warp state
# statistics and per-SASS-instruction stall sampling (source counters), clocks not locked.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") > "$OUT/summary.txt" 2>&1
NCU=/usr/local/cuda-13.0/bin/ncu
timeout 300 $NCU --kernel-name regex:dimsplit --launch-skip 1200 --launch-count 1 --clock-control none \
  --section SourceCounters --section WarpStateStats --section LaunchStats --section SpeedOfLight --section SchedulerStats \
  -o "$OUT/ds" "$W/bench_sparse_attention" --no-prefill --no-packed --reps 3 --warmup 1 > "$OUT/ncu-run.log" 2>&1
echo "ncu exit $?" >> "$OUT/summary.txt"
tail -5 "$OUT/ncu-run.log" >> "$OUT/summary.txt"
$NCU -i "$OUT/ds.ncu-rep" --page details --csv > "$OUT/details.csv" 2>&1; echo "details $?" >> "$OUT/summary.txt"
$NCU -i "$OUT/ds.ncu-rep" --page source --csv --print-source sass > "$OUT/source.csv" 2>&1; echo "source $?" >> "$OUT/summary.txt"
ls -la "$OUT" >> "$OUT/summary.txt"
gzip -f "$OUT/source.csv" "$OUT/details.csv"
rm -f "$OUT/ds.ncu-rep.gz"; gzip -f "$OUT/ds.ncu-rep"
cat "$OUT/summary.txt"
