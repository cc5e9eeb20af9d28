#!/usr/bin/env bash
# The real-size decoder layer benchmark (issue 22, deliverable 4) on a GPU machine without Rust:
# writes the Flash-width checkpoint (synthetic_checkpoint --flash-shapes: the released config's
# layers 0-3, all 384 experts, ~32.7 GB in 5 GB shards, ~3 min on the H100 machine) to $CKPT
# unless it is already there, then runs examples/bench_flash_layer.rs on it. Logs go to $OUT.
#
# Build and pack the two binaries here, carry gpu-bin/ to the GPU machine, run from the root of
# the repository copy there (synthetic_checkpoint reads tests/fixtures/ and models/):
#
#   PACK_TESTS="" PACK_BENCHES="synthetic_checkpoint bench_flash_layer" PACK_SANITIZER=0 scripts/pack-gpu-bin.sh
#   STAGE=smoke bash scripts/gpu-flash-layer.sh   # write the checkpoint, a quick run (B = 1, 8K context)
#   STAGE=full  bash scripts/gpu-flash-layer.sh   # B = 1, 64, 256 at 128K, 4K prefill (writes first if needed)
#
# Environment: BIN (folder of the binaries, *.xz or unpacked; default gpu-bin), CKPT (default
# /tmp/v41-flash), OUT (default ./flash-layer-out), BUDGET_S (seconds the whole call may take,
# default 570: each command gets what is left), WRITE_ARGS (synthetic_checkpoint's arguments,
# default "--flash-shapes --layers 4"; e.g. add "--experts 32" for a 6 GB checkpoint),
# BENCH_ARGS (replace the stage's bench arguments), EXTRA_ARGS (appended to them, e.g.
# "--layers 2,3" or "--keys packed-kv").
set -u
REPO="$(pwd)"
BIN="${BIN:-$REPO/gpu-bin}"
CKPT="${CKPT:-/tmp/v41-flash}"
OUT="${OUT:-$REPO/flash-layer-out}"
STAGE="${STAGE:-full}"
BUDGET_S="${BUDGET_S:-570}"
START=$(date +%s)
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
say() { echo "gpu-flash-layer: $*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

[[ -f tests/fixtures/deepseek-v41-flash/config.json ]] || { say "run from the repository root (tests/fixtures missing)"; exit 2; }
TORCH_CU13=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13
export LD_LIBRARY_PATH="$TORCH_CU13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
for b in synthetic_checkpoint bench_flash_layer; do
    if [[ -f "$BIN/$b.xz" ]]; then
        if command -v xz >/dev/null; then xz -dc "$BIN/$b.xz" > "$WORK/$b"
        else python3 -c 'import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$BIN/$b.xz" "$WORK/$b"; fi
    elif [[ -x "$BIN/$b" ]]; then cp "$BIN/$b" "$WORK/$b"
    else say "no $b in $BIN"; exit 2; fi
    chmod +x "$WORK/$b"
done
{ nvidia-smi; df -h /tmp; free -g; } > "$OUT/machine.txt" 2>&1

# 1. The checkpoint (a stamp marks a complete write).
if [[ -f "$CKPT/.complete" ]]; then
    say "checkpoint $CKPT already written"
else
    t=$(($(left) - 60))
    write_args="${WRITE_ARGS:---flash-shapes --layers 4}"
    say "synthetic_checkpoint $CKPT $write_args (timeout ${t}s)"
    rm -rf "$CKPT"
    # shellcheck disable=SC2086
    timeout "$t" "$WORK/synthetic_checkpoint" "$CKPT" $write_args > "$OUT/write.log" 2>&1
    rc=$?
    tail -n 12 "$OUT/write.log"
    say "synthetic_checkpoint: exit $rc after $(($(date +%s) - START)) s"
    [[ $rc -eq 0 ]] || exit $rc
    touch "$CKPT/.complete"
fi

# 2. The bench.
case "$STAGE" in
    smoke) args="--batch 1 --context 8192 --prefill 0 --reps 3" ;;
    full) args="--batch 1,64,256 --context 131072 --prefill 4096" ;;
    *) say "STAGE must be smoke or full, got $STAGE"; exit 2 ;;
esac
args="${BENCH_ARGS:-$args} ${EXTRA_ARGS:-}"
t=$(($(left) - 10))
if (( t < 60 )); then say "no time left for the bench (${t}s): run again, the checkpoint stays in $CKPT while the machine is held"; exit 3; fi
say "bench_flash_layer --model $CKPT $args (timeout ${t}s)"
# shellcheck disable=SC2086
timeout "$t" "$WORK/bench_flash_layer" --model "$CKPT" $args > "$OUT/bench-$STAGE.log" 2>&1
rc=$?
cat "$OUT/bench-$STAGE.log"
say "bench_flash_layer ($STAGE): exit $rc after $(($(date +%s) - START)) s"
exit $rc
