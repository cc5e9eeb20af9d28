#!/bin/bash
# Lead's GPU run: unpack gpu-bin/*.xz, run the CUDA tests, the golden checker on both sets with
# both cache storages, generate on CUDA, a memcheck of the tie test; logs in $OUT/logs.tgz.
set -u
cd "$(dirname "$0")/../.."
B=/tmp/lb; L=/tmp/logs; mkdir -p $B $L
for f in gpu-bin/*.xz; do n=$(basename $f .xz); xz -dc $f > $B/$n; chmod +x $B/$n; done
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
S=$L/summary.txt
nvidia-smi > $L/nvidia-smi.txt 2>&1
(cd $B && sha256sum *) > $L/sha256.txt
for t in ${TESTS:-cuda_index_ties cuda_any_config cuda_greedy cuda_indexer cuda_layer}; do
  timeout 300 $B/$t --test-threads=1 --nocapture > $L/t-$t.log 2>&1; echo "test $t rc=$? $(grep -E '^test result' $L/t-$t.log)" | tee -a $S
  grep -E "FAILED|panicked|Error" $L/t-$t.log | head -5
done
for s in v41-tiny v41-shakespeare; do for c in bf16 packed; do
  timeout 200 $B/golden tests/fixtures/$s --device cuda --cache $c > $L/g-$s-$c.log 2>&1
  echo "golden $s $c rc=$? | $(tail -1 $L/g-$s-$c.log) | $(grep -E '^[0-9]+ explained' $L/g-$s-$c.log)" | tee -a $S
  grep -E '^(FAIL|UNEXPLAINED|DECISIONS)' $L/g-$s-$c.log | cut -c1-220 | head -6
done; done
[ -x $B/generate ] && for d in cuda cpu; do
  timeout 200 $B/generate --model models/v41-shakespeare-tiny --device $d --max-new-tokens 64 --temperature 0 > $L/gen-$d.log 2>&1; echo "generate $d rc=$?" | tee -a $S
done
[ -x $B/generate ] && cmp -s <(head -c 2000 $L/gen-cuda.log | grep -v "tokens/s") <(head -c 2000 $L/gen-cpu.log | grep -v "tokens/s") && echo "generate: cuda text == cpu text" | tee -a $S || echo "generate: texts differ" | tee -a $S
SAN=/usr/local/cuda-13.0/bin/compute-sanitizer
if [ -x $SAN ] && [ "${MEMCHECK:-1}" = 1 ]; then
  timeout 300 $SAN --tool memcheck --error-exitcode 9 $B/cuda_index_ties --test-threads=1 > $L/memcheck-ties.log 2>&1; echo "memcheck cuda_index_ties rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-ties.log)" | tee -a $S
fi
tar czf $OUT/logs.tgz -C $L .
cp $S $OUT/summary.txt
