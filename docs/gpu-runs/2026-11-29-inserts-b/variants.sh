#!/usr/bin/env bash
# A/B measurements of the run-time switch of issue 4, run 10 (DSV41_PACKED_B) with the packed bench_insert of the same folder; all logs appended to
# $OUT/variants.log (one file: the run tool returns a limited number of files).
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
if command -v xz >/dev/null; then xz -dc "$HERE/bench_insert.xz" > "$W/b"
else python3 -c 'import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$HERE/bench_insert.xz" "$W/b"; fi
chmod +x "$W/b"
run() {  # run NAME ENV... -- ARGS...
    local name=$1; shift
    local envs=()
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    echo "== $name (${envs[*]})" >> "$LOG"
    env "${envs[@]}" timeout 30 "$W/b" "$@" >> "$LOG" 2>&1
    echo "== $name: exit $?" | tee -a "$LOG"
}
B="compressed packed B prefill T=65536,compressed packed B prefill T=16384"
run b-run9 DSV41_PACKED_B=1 -- --no-baseline --only "$B"
run b-pair-rows1-occ8 DSV41_PACKED_B=3 -- --no-baseline --only "$B"
run b-pair-rows2-occ4 DSV41_PACKED_B=2 -- --no-baseline --only "$B"
run b-pair-rows1-occ6 DSV41_PACKED_B=4 -- --no-baseline --only "$B"
run b-pair-rows2-occ6-default DSV41_PACKED_B=0 -- --no-baseline --only "$B"
grep -E "^==|prefill|ratio" "$LOG" | cut -c1-120
