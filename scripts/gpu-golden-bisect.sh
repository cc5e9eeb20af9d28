#!/usr/bin/env bash
# The golden checker on CUDA with each newer kernel switched back to its previous path in turn
# (DSV41_UNFUSE, crate::cuda::UNFUSE_NAMES), on a GPU machine without Rust: which kernel moves a
# result. Build and pack here, carry gpu-bin/, run from the root of the repository copy there
# (the golden sets are read from tests/fixtures/):
#
#   PACK_TESTS="" PACK_BENCHES="golden" PACK_SANITIZER=0 scripts/pack-gpu-bin.sh
#   bash scripts/gpu-golden-bisect.sh          # BIN (default gpu-bin), OUT (default ./bisect-out)
set -u
BIN="${BIN:-gpu-bin}"
OUT="${OUT:-bisect-out}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if [[ -f "$BIN/golden.xz" ]]; then xz -dc "$BIN/golden.xz" > "$WORK/golden"; else cp "$BIN/golden" "$WORK/golden"; fi
chmod +x "$WORK/golden"
for set in v41-tiny v41-shakespeare; do
    for u in none sparse_small mhc_mixes f32_linear scale_round group_diagonal fp8_fused mhc_post mhc_norm side_stream stacked; do
        DSV41_UNFUSE=$u timeout 120 "$WORK/golden" "tests/fixtures/$set" --device cuda > "$OUT/golden-$set-$u.log" 2>&1
        echo "$set, DSV41_UNFUSE=$u: $(grep -E 'passed, .* failed' "$OUT/golden-$set-$u.log") $(grep -E '^FAIL' "$OUT/golden-$set-$u.log" | cut -c1-70 | head -3 | tr '\n' ';')"
    done
done
