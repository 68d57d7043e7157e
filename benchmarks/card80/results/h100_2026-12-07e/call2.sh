#!/usr/bin/env bash
# Device call 2 of 2026-12-07e (one H100 80 GB): PPO's learning curve with the frozen reference and reward
# models as given (bf16), in 8-bit and in 4-bit, Llama-1.1B shape (benchmarks/frozen_quant; the CPU curve is
# results/cpu_2026-12-06). Run from the repository root, .whl carried: bash THIS_FILE OUT
set -u
OUT=${1:?output folder}
mkdir -p $OUT
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
date -u +%FT%TZ > $OUT/date.txt
timeout 560 python3 benchmarks/frozen_quant/run.py --out $OUT/gpu_frozen_quant --shape llama-1.1b --batch 32 \
  --micro 8 --prompt-length 64 --response-length 64 --updates 30 --epochs 2 --reward-scale 1 --budget-s 480 \
  2>&1 | tail -12
