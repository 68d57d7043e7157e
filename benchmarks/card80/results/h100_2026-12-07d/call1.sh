#!/usr/bin/env bash
# Device call 1 of 2026-12-07d (one GPU; on a card over 80 GB the card80 rows are capped to 79.19 GiB):
# the flash-decoding kernel's launches over an int8 cache, then 7B LoRA PPO batch 256 with PPOConfig's defaults
# (rollout_kv_cache_dtype "auto": int8 here) and with use_liger_kernel=True, same call.
# Run from the repository root, .whl carried: bash THIS_FILE OUT
set -u
OUT=${1:?output folder}
mkdir -p $OUT
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
date -u +%FT%TZ > $OUT/date.txt
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
CAP=""; [ "$MIB" -gt 100000 ] && CAP="--cap-gib 79.19"
SWEEP_S=110 bash benchmarks/kernels/results/int8_launch_sweep.sh $OUT/sweep
timeout 420 python3 benchmarks/card80/run.py --out $OUT/lora7b_speed --rows lora7b_offload,lora7b_liger \
  --updates 3 --timeout 205 $CAP 2>&1 | grep "^|\|\[" | tail -12
