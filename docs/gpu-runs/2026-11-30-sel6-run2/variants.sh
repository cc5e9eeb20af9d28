#!/usr/bin/env bash
# sel6 run: the selection kernels per experiment switch (DSV41_SEL_VAR: 0 = one-read top-k kernel,
# 4 loads in flight; 1 = main's kernel for every launch (same-run reference); 2 / 3 = one-read
# kernel with 8 / 2 loads in flight; 4 / 5 = 2 / 4 double-buffered): tests, bench_indexer,
# Nsight Compute kernel durations, memcheck.
# Usage: OUT=$OUT [SELVARS="1 0 2 3 4 5 1 0"] [TESTVARS="1 2 3 4 5"] [NCUVARS="0 1 5"] [MEMCHECK=1] bash gpu-extra/sel6/variants.sh
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "variants.sh: $*" | tee -a "$S"; }
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
for b in cuda_indexer bench_indexer; do xz -dc "$HERE/$b.xz" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 | tee -a "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
TL="$OUT/tests.log"; : > "$TL"
VL="$OUT/variants.log"; : > "$VL"
BARGS="--no-baseline --batches 1,64,256 --prefill 4096"
echo "=== tests default" >> "$TL"
timeout 60 "$W/cuda_indexer" --test-threads=1 >> "$TL" 2>&1; say "tests default: exit $? (t=$(el)s)"
for v in ${TESTVARS-1 2 3 4 5}; do
  echo "=== tests DSV41_SEL_VAR=$v (top-k tests)" >> "$TL"
  DSV41_SEL_VAR=$v timeout 30 "$W/cuda_indexer" --test-threads=1 topk 64k ties >> "$TL" 2>&1; say "tests var $v: exit $? (t=$(el)s)"
done
for v in ${SELVARS-1 0 2 3 4 5 1 0}; do
  echo "=== bench DSV41_SEL_VAR=$v" >> "$VL"
  DSV41_SEL_VAR=$v timeout 30 "$W/bench_indexer" $BARGS >> "$VL" 2>&1; say "bench var $v: exit $? (t=$(el)s)"
done
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for v in ${NCUVARS-0 1 5}; do
  # Kernel durations of every selection launch (7 per measurement: top-k, select, unfused per B and keys).
  DSV41_SEL_VAR=$v timeout 30 "$NCU" --clock-control none --cache-control none --csv --kernel-name regex:'indexer_(topk|select)_kernel' \
    --metrics gpu__time_duration.sum,launch__grid_size,dram__bytes_read.sum,lts__t_sector_hit_rate.pct \
    "$W/bench_indexer" --no-baseline --batches 1,64,256 --prefill 64 --reps 1 --warmup 1 --rep-ms 0.1 > "$OUT/ncu-var$v.csv" 2>&1
  say "ncu var $v: exit $? (t=$(el)s)"
done
if [[ -n "${NCU_DETAIL-1}" ]]; then
  # B = 256 mxfp4 launches 21..27 = top-k (sampled), 28..34 = select (fused histogram); 25..29 profiled.
  timeout 25 "$NCU" --clock-control none --cache-control none --kernel-name regex:'indexer_(topk|select)_kernel' --launch-skip 25 --launch-count 5 \
     --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis \
     "$W/bench_indexer" --no-baseline --batches 256 --prefill 64 --reps 1 --warmup 1 --rep-ms 0.1 > "$OUT/ncu-detail.log" 2>&1
  say "ncu detail: exit $? (t=$(el)s)"
fi
if [[ "${MEMCHECK:-0}" == 1 ]]; then
  SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  left=$(( ${MEM_BUDGET:-140} - $(el) ))
  timeout $left "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_indexer" --test-threads=1 > "$OUT/memcheck-cuda_indexer.log" 2>&1
  say "memcheck cuda_indexer ($SAN, ${left}s): exit $? (t=$(el)s)"
fi
# Medians of the ncu durations per (variant, grid) in launch order.
for f in "$OUT"/ncu-var*.csv; do
  python3 - "$f" >> "$S" <<'PY' 2>&1
import csv, sys, statistics
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print(sys.argv[1], "no rows"); sys.exit()
h = rows[0]; ix = {k: i for i, k in enumerate(h)}
data = {}
for r in rows[1:]:
    try: data.setdefault(int(r[ix["ID"]]), {})[r[ix["Metric Name"]]] = (r[ix["Kernel Name"]], r[ix["Metric Value"]])
    except (ValueError, KeyError): pass
seq = []
for i in sorted(data):
    d = data[i]
    name = d["gpu__time_duration.sum"][0][:40]
    seq.append((name, d["launch__grid_size"][1], float(d["gpu__time_duration.sum"][1].replace(",", ""))))
print(sys.argv[1].split("/")[-1], len(seq), "launches")
i = 0
while i < len(seq):
    j = i
    while j < len(seq) and seq[j][:2] == seq[i][:2] and j - i < 7: j += 1
    ds = [s[2] for s in seq[i:j]]
    print(f"  launches {i:3}-{j-1:3} grid {seq[i][1]:>5} {seq[i][0]:40} median {statistics.median(ds):10.1f} min {min(ds):10.1f} (unit of the csv)")
    i = j
PY
done
cat "$S"
