#!/usr/bin/env bash
# Run: the batched decode step (graph replay, packed index keys, bf16 KV rows) at B = 128 and 256 with
# Auto (the all-heads kernel there) against the dims-split pair forced (run-12 binary = final code): does the pair's
# in-stream advantage at B = 256 (74.8 vs 79.2 us, Round 13) carry over to the whole step?
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
for b in 256 128; do
  for k in auto dim-split auto dim-split; do
    timeout 60 "$W/bench_batched_decode" --batch $b --keys packed --steps 10 --warmup 3 --graph --attention-kernel $k > "$L/batched-$b-$k.log" 2>&1
    echo "B=$b [$k]: exit $? $(grep -E "^\| $b " "$L/batched-$b-$k.log" | head -1)" >> "$S"
  done
done
grep -B2 "^| 256" "$L/batched-256-auto.log" | head -3 >> "$S"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
