#!/usr/bin/env bash
# gen9 GPU run: generate --device cuda before (main d05ed42, generate_base) and after (generate),
# texts compared, per-step profile, ablations (RUN=1), the decoder-op kernel tests, golden
# --device cuda (bf16 and packed caches), memcheck of the kernel tests (RUN=2).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
RUN="${RUN:-1}"
export LD_LIBRARY_PATH="/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
S="$OUT/summary.txt"; : > "$S"
say() { echo "gen9r$RUN: $*" | tee -a "$S"; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for f in "$HERE"/*.xz; do b=$(basename "$f" .xz); xz -dc "$f" > "$W/$b"; chmod +x "$W/$b"; done
(cd "$W" && sha256sum -c "$HERE/SHA256SUMS") >> "$S" 2>&1
L="$OUT/logs"; mkdir -p "$L"
t0=$SECONDS
M="--model models/v41-shakespeare-tiny"
rate() { grep -h "tokens/s" "$1" | tail -1 | sed 's/^.*new tokens in/in/'; }
text() { cat "$1"; }  # stdout of generate = prompt + continuation

timeout 120 "$W/cuda_decoder_ops" --test-threads=1 > "$L/tests-cuda_decoder_ops.log" 2>&1
say "tests cuda_decoder_ops: exit $? ($(grep -h 'test result' "$L/tests-cuda_decoder_ops.log" | tail -1)) t=$((SECONDS-t0))"

# generate: default sampling (seed 0, T 0.8, top-p 0.95, 120 tokens) and greedy 64, interleaved.
BINS="generate"; [[ -x "$W/generate_base" ]] && BINS="generate_base generate"
for rep in 1 2 3 4 5; do
  for b in $BINS; do
    timeout 60 "$W/$b" $M --device cuda > "$L/$b-default-$rep.out" 2> "$L/$b-default-$rep.err"
    say "$b --device cuda (default sampling) rep $rep: exit $? $(rate "$L/$b-default-$rep.err") t=$((SECONDS-t0))"
  done
done
for b in $BINS; do
  timeout 60 "$W/$b" $M --device cuda --temperature 0 --max-new-tokens 64 > "$L/$b-greedy.out" 2> "$L/$b-greedy.err"
  say "$b --device cuda greedy 64: exit $? $(rate "$L/$b-greedy.err")"
  timeout 60 "$W/$b" $M --device cpu > "$L/$b-cpu-default.out" 2> "$L/$b-cpu-default.err"
  say "$b --device cpu (default sampling): exit $? $(rate "$L/$b-cpu-default.err")"
  timeout 60 "$W/$b" $M --device cpu --temperature 0 --max-new-tokens 64 > "$L/$b-cpu-greedy.out" 2> "$L/$b-cpu-greedy.err"
done
timeout 60 "$W/generate" $M --device cuda --cache packed > "$L/generate-packed.out" 2> "$L/generate-packed.err"
say "generate --device cuda --cache packed: exit $? $(rate "$L/generate-packed.err")"
cmpt() { if cmp -s "$1" "$2"; then say "SAME TEXT: $(basename "$1") == $(basename "$2")"; else say "DIFFERENT TEXT: $(basename "$1") != $(basename "$2")"; fi; }
cmpt "$L/generate-default-1.out" "$L/generate-cpu-default.out"
cmpt "$L/generate-greedy.out" "$L/generate-cpu-greedy.out"
cmpt "$L/generate-packed.out" "$L/generate-default-1.out"
if [[ -x "$W/generate_base" ]]; then
  cmpt "$L/generate-default-1.out" "$L/generate_base-default-1.out"
  cmpt "$L/generate-greedy.out" "$L/generate_base-greedy.out"
  cmpt "$L/generate_base-default-1.out" "$L/generate_base-cpu-default.out"
  cmpt "$L/generate-cpu-default.out" "$L/generate_base-cpu-default.out"
fi

# Per-step profile (replays the decode steps of the generated tokens), event tracking A/B.
prof() {  # prof NAME ENV...
  local name=$1; shift
  env "$@" timeout 60 "$W/generate" $M --device cuda --profile > "$L/profile-$name.out" 2> "$L/profile-$name.err"
  say "profile $name ($*): $(rate "$L/profile-$name.err"); $(grep -h '^profile' "$L/profile-$name.err")"
}
prof new
[[ "$RUN" == 1 ]] && prof keep-event-tracking DSV41_KEEP_EVENT_TRACKING=1
if [[ "$RUN" == 1 ]]; then
  for off in rms scale collapse post swiglu all; do (( SECONDS - t0 < 125 )) && prof "off-$off" DSV41_OFF=$off; done
else
  prof off-all DSV41_OFF=all
  # Fallback measurements if a new kernel's bit-exactness test failed (switch it off).
  FAILED=$(grep -h "^test .* FAILED" "$L/tests-cuda_decoder_ops.log" | sed 's/^test \([a-z_]*\) .*/\1/' | tr '\n' ' ')
  OFFS=""
  [[ "$FAILED" == *engram* ]] && OFFS="$OFFS,engram"
  [[ "$FAILED" == *accumulate* ]] && OFFS="$OFFS,accumulate"
  [[ "$FAILED" == *rms* || "$FAILED" == *scale* ]] && OFFS="$OFFS,rms,scale"
  [[ "$FAILED" == *collapse* ]] && OFFS="$OFFS,collapse,post"
  [[ "$FAILED" == *swiglu* || "$FAILED" == *expert* ]] && OFFS="$OFFS,swiglu"
  if [[ -n "$OFFS" ]]; then
    say "FAILED tests: $FAILED -> fallback DSV41_OFF=$OFFS"
    for rep in 1 2 3; do
      DSV41_OFF=$OFFS timeout 60 "$W/generate" $M --device cuda > "$L/fallback-default-$rep.out" 2> "$L/fallback-default-$rep.err"
      say "fallback generate (DSV41_OFF=$OFFS) rep $rep: $(rate "$L/fallback-default-$rep.err")"
    done
    cmpt "$L/fallback-default-1.out" "$L/generate_base-default-1.out"
    for c in bf16 packed; do
      DSV41_OFF=$OFFS timeout 60 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c > "$L/golden-fallback-$c.log" 2>&1
      say "golden fallback cuda $c: exit $? ($(tail -1 "$L/golden-fallback-$c.log"))"
    done
  fi
fi
env timeout 60 "$W/generate" $M --device cuda --profile --temperature 0 --max-new-tokens 64 > "$L/profile-greedy.out" 2> "$L/profile-greedy.err"
say "profile greedy 64: $(rate "$L/profile-greedy.err"); $(grep -h '^profile' "$L/profile-greedy.err")"

for c in bf16 packed; do
  timeout 60 "$W/golden" tests/fixtures/v41-tiny --device cuda --cache $c > "$L/golden-cuda-$c.log" 2>&1
  say "golden cuda $c: exit $? ($(tail -1 "$L/golden-cuda-$c.log")) t=$((SECONDS-t0))"
done
if [[ "$RUN" == 2 ]]; then
  SAN=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  left=$(( 172 - (SECONDS - t0) )); (( left < 15 )) && left=15
  timeout $left "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 "$W/cuda_decoder_ops" --test-threads=1 > "$L/memcheck-cuda_decoder_ops.log" 2>&1
  say "memcheck cuda_decoder_ops: exit $? ($(grep -h 'test result' "$L/memcheck-cuda_decoder_ops.log" | tail -1)) ($(grep -h 'ERROR SUMMARY' "$L/memcheck-cuda_decoder_ops.log" | tail -1)) t=$((SECONDS-t0))"
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
cat "$S"
