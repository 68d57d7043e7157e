#!/usr/bin/env bash
# Fourth session (2026-11-30), device call 3 on two H200s, < 560 s, one lane per GPU:
#   GPU 0, CPU cores 0-15: memory benchmark, allocator groups: the callback with its default settings in the
#     interleaved time-cost rounds, largest micro-batch after the fragmenting schedule with vs without it
#     (issue 5; pushes its GPU to OOM on purpose)
#   GPU 1, CPU cores 16-31: GRPO stock vs rapidfire_lowmem vs rapidfire_lowmem3 (issue 7), then the FP8
#     benchmark (torchao and ours, 1.1B and 7B linears, 40-step loss; issue 6) with what is left
# Carry: .whl .whl-ds .whl-ao. Results: $OUT/s4call3.tgz.
set -u
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
R=/tmp/s4call3; mkdir -p $R
python3 -c "import torch, transformers, trl, torchao, bitsandbytes; print(torch.__version__, transformers.__version__, trl.__version__, torchao.__version__, bitsandbytes.__version__)" > $R/versions.txt 2>&1
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
(
  export CUDA_VISIBLE_DEVICES=0
  pin 0-15 timeout -k 5 470 python3 benchmarks/memory/run.py --out $R/memory_defaults \
    --groups allocator/native,allocator/expandable > $R/memory.log 2>&1
  echo "memory rc=$? at $(elapsed)s"
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  pin 16-31 timeout -k 5 270 python3 benchmarks/grpo/run.py --out $R/grpo3 \
    --variants stock,rapidfire_lowmem,rapidfire_lowmem3 > $R/grpo3.log 2>&1
  echo "grpo rc=$? at $(elapsed)s"
  left=$((520 - $(elapsed)))
  if [ $left -ge 90 ]; then
    pin 16-31 timeout -k 5 $left python3 benchmarks/precision/run.py --out $R/precision --budget-s $((left - 40)) > $R/precision.log 2>&1
    echo "precision rc=$? at $(elapsed)s"
  fi
) > $R/lane1.txt 2>&1 &
wait
cat $R/versions.txt $R/lane0.txt $R/lane1.txt
tail -25 $R/memory.log | cut -c1-220
grep -A12 "summary\|target" $R/grpo3.log | tail -30 | cut -c1-300
grep -E "^fp8 |seconds per part|final loss|speed|error" $R/precision.log | tail -20 | cut -c1-300
tar czf $OUT/s4call3.tgz -C $R . 2>/dev/null; ls -la $OUT
echo "total $(elapsed)s"
