#!/usr/bin/env bash
# FP8 linear GPU run: tests + memcheck + bench (packed run.sh), then the torch anchors.
# Usage (device): bash gpu-extra/fp8/go.sh   (OUT set by the device tool)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Anchors first (independent of our binaries), then tests, memcheck, bench.
if [[ "${SKIP_ANCHORS:-0}" != 1 ]]; then
    { date -u; nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv; timeout 200 /opt/torch/.venv/bin/python "$HERE/scaled_mm.py" ${ANCHOR_ARGS:-}; } > "$OUT/anchors.log" 2>&1
    echo "anchors: exit $?"
fi
TEST_FILTER="${TEST_FILTER:---nocapture}" bash "$HERE/run.sh"
echo "run.sh: exit $?"
