#!/usr/bin/env bash
# Copy into gpu-bin/ next to run.sh (scripts/pack-gpu-bin.sh does not) and call: OUT=$OUT bash gpu-bin/final.sh
# Session-2 final verification: tests + benches via run.sh, then memcheck of the changed kernels' tests.
# Logs are re-packed into $OUT/logs.tgz after each phase (the device tool returns at most 8 files).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
FINAL_OUT="$OUT"; L=/tmp/final-logs; mkdir -p "$L"
pack() { tar -C "$L" -czf "$FINAL_OUT/logs.tgz" . ; }
OUT="$L" SKIP_MEMCHECK=1 \
  ARGS_golden="tests/fixtures/v41-tiny --device cuda" \
  ARGS_bench_attention_layer="--steps 10 --prefill 4096,16384 --prefill-compressed 4096,16384" \
  ARGS_bench_batched_decode="--batch 1,64,256 --steps 10 --context 131072" \
  bash "$HERE/run.sh" > "$L/run.log" 2>&1
pack
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SAN=/usr/local/cuda-13.0/bin/compute-sanitizer
W="$(mktemp -d)"
for b in cuda_layer cuda_sparse_attention; do
  xz -dc "$HERE/$b.xz" > "$W/$b" && chmod +x "$W/$b"
  timeout 110 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/$b" --test-threads=1 > "$L/memcheck-$b.log" 2>&1
  echo "memcheck $b: exit $?" >> "$L/summary.txt"
  pack
done
cat "$L/summary.txt"; grep -h "test result" "$L"/*.log
