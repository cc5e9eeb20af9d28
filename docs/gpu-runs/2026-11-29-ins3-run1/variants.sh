#!/usr/bin/env bash
# A/B measurements of kernel variants selected by environment variables, with the packed
# bench_insert of the same folder (scripts/pack-gpu-bin.sh), plus an optional Nsight Compute
# look at two kernels. Logs go to $OUT (default: <folder>/out).
#
#   OUT=... bash gpu-variants.sh          # after run.sh, in the same pack folder
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
if command -v xz >/dev/null; then xz -dc "$HERE/bench_insert.xz" > "$W/b"
else python3 -c 'import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$HERE/bench_insert.xz" "$W/b"; fi
chmod +x "$W/b"
run() {  # run NAME ENV... -- ARGS...
    local name=$1; shift
    local envs=()
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    env "${envs[@]}" timeout 40 "$W/b" "$@" > "$OUT/bench-$name.log" 2>&1
    echo "== $name (${envs[*]}): exit $?"
    grep -E "prefill|ratio" "$OUT/bench-$name.log"
}
ONLY="index_key,packed B,compressed_insert Q2 prefill"
run pairs X=1 -- --no-baseline --only "$ONLY"
run f32 DSV41_ROW128_F32=1 -- --no-baseline --only "index_key"
run rows2 DSV41_PACKED_ROWS2=1 -- --no-baseline --only "packed B"
run occ8 DSV41_PACKED_OCC8=1 -- --no-baseline --only "packed B"
run fullgrid DSV41_ROW128_FULLGRID=1 -- --no-baseline --only "index_key"
run pairs-again X=1 -- --no-baseline --only "index_key,packed B"
NCU="$(ls /usr/local/cuda*/bin/ncu "$TORCH_CU13/bin/ncu" 2>/dev/null | head -1)"
if [[ -n "$NCU" && "${SKIP_NCU:-0}" != 1 ]]; then
    for k in "index_key_insert_row128:index_key_insert Q3 prefill T=65536" "packed_insert_kernel:compressed packed B prefill T=65536"; do
        timeout 45 "$NCU" -k "regex:${k%%:*}" --launch-skip 3 -c 1 --section SpeedOfLight --section WarpStateStats \
            --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis \
            "$W/b" --no-baseline --reps 1 --warmup 1 --only "${k#*:}" > "$OUT/ncu-${k%%:*}.txt" 2>&1
        echo "== ncu ${k%%:*}: exit $?"; tail -n 60 "$OUT/ncu-${k%%:*}.txt" | cut -c1-150
    done
else
    echo "ncu not found or skipped"
fi
