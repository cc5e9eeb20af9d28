#!/usr/bin/env bash
# A/B measurements of the row-128 switch of issue 4, run 13 (DSV41_ROW128_VARIANT, helper ins7) with the packed
# cuda_insert and bench_insert of the same folder. Logs: $OUT/var-tests-V.log, $OUT/var-bench-R-V.log (one file per
# call, small), $OUT/variants-summary.txt; ncu: $OUT/ncu.log (+ ncu-source-V.csv: per-SASS-instruction stall samples).
#
#   OUT=... bash variants.sh          # in the pack folder
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
SUM="$OUT/variants-summary.txt"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
unxz_to() {
    if command -v xz >/dev/null; then xz -dc "$1" > "$2"
    else python3 -c 'import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$1" "$2"; fi
}
unxz_to "$HERE/bench_insert.xz" "$W/b"; unxz_to "$HERE/cuda_insert.xz" "$W/t"
chmod +x "$W/b" "$W/t"
(cd "$W" && sha256sum b t) >> "$SUM"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for v in ${TEST_VARIANTS:-}; do
    DSV41_ROW128_VARIANT=$v timeout 40 "$W/t" --test-threads=1 > "$OUT/var-tests-$v.log" 2>&1
    echo "== tests variant $v: exit $? $(grep 'test result' "$OUT/var-tests-$v.log")" | tee -a "$SUM"
done
# time guard: skip a step when fewer than its timeout's seconds are left before DEADLINE (script seconds)
DEADLINE="${DEADLINE:-105}"
have() { (( DEADLINE - SECONDS >= $1 )); }
ONLY="index_key packed E prefill T=65536,index_key packed E ratio 1,index_key_insert Q3 prefill T=65536,index_key_insert Q3 ratio 1,index_key packed E prefill T=16384"
for rep in $(seq ${REP_FROM:-1} ${REPS:-2}); do
    for v in ${VARIANTS:-0 1 2 3}; do
        have 12 || { echo "== bench rep $rep variant $v: skipped (time)" | tee -a "$SUM"; continue; }
        DSV41_ROW128_VARIANT=$v timeout 12 "$W/b" --no-baseline --only "$ONLY" > "$OUT/var-bench-$rep-$v.log" 2>&1
        echo "== bench rep $rep variant $v: exit $?" | tee -a "$SUM"
        grep -E "prefill|ratio" "$OUT/var-bench-$rep-$v.log" | cut -c1-120 | sed "s/^/v$v r$rep /" | tee -a "$SUM"
    done
done
SAN=""
for c in /usr/local/cuda*/bin/compute-sanitizer "$(command -v compute-sanitizer 2>/dev/null)"; do
    if [[ -n "$c" && -x "$c" ]]; then SAN="$c"; break; fi
done
for v in ${MEMCHECK_VARIANTS:-}; do
    DSV41_ROW128_VARIANT=$v timeout 60 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 20 "$W/t" --test-threads=1 \
        > "$OUT/var-memcheck-$v.log" 2>&1
    echo "== memcheck variant $v ($SAN): exit $? $(grep -E 'ERROR SUMMARY|test result' "$OUT/var-memcheck-$v.log" | tr '\n' ' ')" | tee -a "$SUM"
done
# Nsight Compute: stall reasons of one format-E launch at G = 32768 per variant in NCU_VARIANTS
NCU=""
for c in /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu "$(command -v ncu 2>/dev/null)"; do
    if [[ -n "$c" && -x "$c" ]]; then NCU="$c"; break; fi
done
for v in ${NCU_VARIANTS:-}; do
    have 40 || { echo "== ncu variant $v: skipped (time)" | tee -a "$SUM"; continue; }
    echo "== ncu ($NCU) DSV41_ROW128_VARIANT=$v" >> "$OUT/ncu.log"
    DSV41_ROW128_VARIANT=$v timeout "${NCU_TIMEOUT:-30}" "$NCU" -k regex:packed_e_row128 -c 1 -o "$W/rep$v" \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section SourceCounters --section LaunchStats \
        "$W/b" --no-baseline --only "index_key packed E prefill T=65536" >> "$OUT/ncu.log" 2>&1
    echo "== ncu variant $v exit $?" | tee -a "$SUM"
    timeout 20 "$NCU" -i "$W/rep$v.ncu-rep" --print-details all >> "$OUT/ncu.log" 2>&1
    timeout 20 "$NCU" -i "$W/rep$v.ncu-rep" --page raw 2>/dev/null | grep -E "stall|warps_issue|inst_executed |cycles_active" > "$OUT/ncu-raw-$v.txt"
    timeout 20 "$NCU" -i "$W/rep$v.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-source-$v.csv" 2>&1
    echo "== ncu variant $v source page: exit $? $(wc -c < "$OUT/ncu-source-$v.csv") bytes" | tee -a "$SUM"
done
