#!/usr/bin/env bash
# Device call part (one GPU): where the 7B decode step spends its time with the KV cache in int8 at batch 256
# (what PPOTrainer's "auto" now runs for 7B LoRA batch 256) against the bf16 cache at batch 128, compiled,
# steps 181-196 (the cache about 310 of 512 slots full: near the rollout's mean). bash THIS_FILE OUT
set -u
OUT=${1:?output folder}
timeout ${PROFILE_S:-230} python3 benchmarks/kernels/profile_decode.py --out $OUT --shapes llama-7b \
  --batches 256,128 --variants int8,default --first-step 180 --steps 16 --budget-s 150 2>&1 | grep -v "^USDT\|^STAGE" | tail -6
