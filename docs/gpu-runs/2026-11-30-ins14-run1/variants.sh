#!/usr/bin/env bash
# Helper ins14 (issue 4, run 20; ins13 run-19 script): tests, A/B bench rows, then memcheck, under the row-128 switch
# DSV41_ROW128_VARIANT with the packed cuda_insert and bench_insert of the same folder. Few files come back from
# the machine (8 at most), so every step appends to one log per kind: $OUT/var-tests.log, var-memcheck.log,
# var-bench.log, and the summary $OUT/variants-summary.txt.
#
#   OUT=... TEST_VARIANTS="1 2 3 4 5" MEMCHECK_VARIANTS="2 3" VARIANTS="0 1 2 3 4 5" REPS=4 bash variants.sh
# (ins13: the variants' order rotates by one per repetition.)
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
unxz_to "$HERE/bench_insert.xz" "$W/bench_insert"; unxz_to "$HERE/cuda_insert.xz" "$W/cuda_insert"
chmod +x "$W/bench_insert" "$W/cuda_insert"
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") 2>&1 | tee -a "$SUM"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
DEADLINE="${DEADLINE:-110}"
have() { (( DEADLINE - SECONDS >= $1 )); }
for v in ${TEST_VARIANTS:-}; do
    echo "======== tests DSV41_ROW128_VARIANT=$v" >> "$OUT/var-tests.log"
    DSV41_ROW128_VARIANT=$v timeout 40 "$W/cuda_insert" --test-threads=1 >> "$OUT/var-tests.log" 2>&1
    rc=$?
    echo "== tests variant $v: exit $rc $(grep 'test result' "$OUT/var-tests.log" | tail -1)" | tee -a "$SUM"
done
ONLY="index_key packed E prefill T=65536,index_key packed E ratio 1,index_key_insert Q3 prefill T=65536,index_key_insert Q3 ratio 1,index_key packed E prefill T=16384"
read -r -a VL <<< "${VARIANTS:-0}"
for rep in $(seq 1 ${REPS:-3}); do
    # the order rotates by one variant per repetition (no variant always first / last)
    for k in $(seq 0 $((${#VL[@]} - 1))); do
        v=${VL[$(( (k + rep - 1) % ${#VL[@]} ))]}
        have 10 || { echo "== bench rep $rep variant $v: skipped (time)" | tee -a "$SUM"; continue; }
        echo "======== bench rep $rep DSV41_ROW128_VARIANT=$v" >> "$OUT/var-bench.log"
        DSV41_ROW128_VARIANT=$v timeout 10 "$W/bench_insert" --no-baseline --only "$ONLY" > "$W/bench.out" 2>&1
        rc=$?
        cat "$W/bench.out" >> "$OUT/var-bench.log"
        echo "== bench rep $rep variant $v: exit $rc" | tee -a "$SUM"
        grep -E "prefill|ratio" "$W/bench.out" | cut -c1-120 | sed "s/^/v$v r$rep /" | tee -a "$SUM"
    done
done
SAN=""
for c in /usr/local/cuda*/bin/compute-sanitizer "$(command -v compute-sanitizer 2>/dev/null)"; do
    if [[ -n "$c" && -x "$c" ]]; then SAN="$c"; break; fi
done
for v in ${MEMCHECK_VARIANTS:-}; do
    have 30 || { echo "== memcheck variant $v: skipped (time)" | tee -a "$SUM"; continue; }
    echo "======== memcheck DSV41_ROW128_VARIANT=$v ($SAN)" >> "$OUT/var-memcheck.log"
    DSV41_ROW128_VARIANT=$v timeout 40 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 20 "$W/cuda_insert" \
        --test-threads=1 >> "$OUT/var-memcheck.log" 2>&1
    rc=$?
    echo "== memcheck variant $v: exit $rc $(grep -E 'test result' "$OUT/var-memcheck.log" | tail -1) $(grep -E 'ERROR SUMMARY' "$OUT/var-memcheck.log" | tail -1)" | tee -a "$SUM"
done
echo "total ${SECONDS} s" | tee -a "$SUM"
