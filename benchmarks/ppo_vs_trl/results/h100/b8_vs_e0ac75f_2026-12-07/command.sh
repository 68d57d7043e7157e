#!/usr/bin/env bash
# The smallest useful call (~150 s): PPO 1.1B batch 8, ours at main, then at e0ac75f (.prev), 3 updates a row.
set -u
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
for pair in "main1 ." "prev1 .prev"; do
  set -- $pair
  ( cd $2 && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 85 python3 benchmarks/ppo_vs_trl/run.py --out $OUT/$1 \
      --part throughput --timeout 80 --fused-batches "" --updates 3 --trl-batches "" --our-batches 8 \
      > $OUT/$1.log 2>&1; echo "$1 rc=$?" )
  python3 benchmarks/ppo_vs_trl/results/h100/b8_alternating_2026-12-06/summarize.py $OUT $1
done
