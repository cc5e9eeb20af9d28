#!/usr/bin/env bash
# A/B measurements of the row-128 switch of issue 4, run 11 (DSV41_ROW128_VARIANT) with the packed
# cuda_insert and bench_insert of the same folder; all logs appended to $OUT/variants.log (one file).
#
#   OUT=... bash variants.sh          # in the pack folder, after run.sh
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
LOG="$OUT/variants.log"
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
VARIANTS="${VARIANTS:-0 1 4 6 7 8 9}"
TEST_VARIANTS="${TEST_VARIANTS:-$VARIANTS}"
if [[ "${SKIP_VARIANT_TESTS:-0}" != 1 ]]; then
    for v in $TEST_VARIANTS; do
        echo "== tests DSV41_ROW128_VARIANT=$v" >> "$LOG"
        DSV41_ROW128_VARIANT=$v timeout 60 "$W/t" --test-threads=1 >> "$LOG" 2>&1
        echo "== tests variant $v: exit $?" | tee -a "$LOG"
    done
fi
ONLY="index_key packed E prefill T=65536,index_key packed E ratio 1,index_key_insert Q3 prefill T=65536,index_key_insert Q3 ratio 1,index_key packed E prefill T=16384"
for rep in 1 2; do
    for v in $VARIANTS; do
        echo "== bench rep $rep DSV41_ROW128_VARIANT=$v" >> "$LOG"
        DSV41_ROW128_VARIANT=$v timeout 40 "$W/b" --no-baseline --only "$ONLY" >> "$LOG" 2>&1
        echo "== bench rep $rep variant $v: exit $?" | tee -a "$LOG"
    done
done
grep -E "^==|prefill|ratio|test result" "$LOG" | cut -c1-120
# memcheck of the row-128 tests under the variants in MEMCHECK_VARIANTS (run.sh memchecks the default)
SAN=""
for c in /usr/local/cuda*/bin/compute-sanitizer "$(command -v compute-sanitizer 2>/dev/null)"; do
    if [[ -n "$c" && -x "$c" ]]; then SAN="$c"; break; fi
done
for v in ${MEMCHECK_VARIANTS:-}; do
    echo "== memcheck DSV41_ROW128_VARIANT=$v ($SAN)" >> "$LOG"
    DSV41_ROW128_VARIANT=$v timeout 60 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 20 "$W/t" --test-threads=1 \
        index_key row128 format_e >> "$LOG" 2>&1
    echo "== memcheck variant $v: exit $?" | tee -a "$LOG"
done
