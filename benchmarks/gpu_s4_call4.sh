#!/usr/bin/env bash
# Fourth session (2026-11-30), device call 4 on two H200s, < 560 s, one lane per GPU:
#   lane 0 (CPU cores 0-15): every GPU test of the suite (`pytest -m gpu tests`, both GPUs visible: the DDP
#     tests need two), then the PPO log-prob ratio run bf16 vs adaptive vs fp32 on GPU 0 (issue 6)
#   lane 1 (GPU 1, CPU cores 16-31): GRPO stock vs rapidfire_lowmem3 vs rapidfire_lowmem4 (issue 7), then the
#     memory benchmark's native-allocator group after the pressure default (issue 5), no micro-batch search
# Carry: .whl .whl-ds .whl-ao. Results: $OUT/s4call4.tgz.
set -u
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
R=/tmp/s4call4; mkdir -p $R
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
(
  pin 0-15 timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests --junitxml $R/gpu_tests.xml > $R/gpu_tests.log 2>&1
  echo "gpu tests rc=$? at $(elapsed)s"; tail -1 $R/gpu_tests.log
  left=$((530 - $(elapsed)))
  CUDA_VISIBLE_DEVICES=0 pin 0-15 timeout -k 5 $left python3 benchmarks/precision/ppo_ratio.py --out $R/ppo_ratio \
    --rollout-decode-mode cuda_graph --updates 20 > $R/ppo_ratio.log 2>&1
  echo "ppo_ratio rc=$? at $(elapsed)s"
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  pin 16-31 timeout -k 5 270 python3 benchmarks/grpo/run.py --out $R/grpo4 \
    --variants stock,rapidfire_lowmem3,rapidfire_lowmem4 > $R/grpo4.log 2>&1
  echo "grpo rc=$? at $(elapsed)s"
  left=$((530 - $(elapsed)))
  pin 16-31 timeout -k 5 $left python3 benchmarks/memory/run.py --out $R/memory_native --groups allocator/native \
    --batch-variants none > $R/memory_native.log 2>&1
  echo "memory rc=$? at $(elapsed)s"
) > $R/lane1.txt 2>&1 &
wait
cat $R/lane0.txt $R/lane1.txt
grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | tail -15 | cut -c1-300
grep -A12 "time cost of the callback" $R/memory_native.log | cut -c1-260
grep -E "vs stock|peak allocated|median time per phase" $R/grpo4.log | tail -12 | cut -c1-300
tail -6 $R/ppo_ratio.log | cut -c1-300
tar czf $OUT/s4call4.tgz -C $R . 2>/dev/null; ls -la $OUT
echo "total $(elapsed)s"
