#!/usr/bin/env bash
# Device call (one GPU): 7B LoRA PPO batch 256 under `aggressive` with PPOConfig's defaults (rollout_kv_cache_dtype
# "auto", which now chooses int8 for this shape; PROFILE=1: one update profiled), then PART 2 the cache in the model's
# dtype (the previous default's plan), same call when both fit in one. On a card bigger than 80 GB the card is
# capped to an H100 80 GB's 79.19 GiB (memory only; the bigger card's speed stays, recorded in each row).
# Run from the repository root, .whl carried: bash THIS_FILE OUT [auto|model|both]
set -u
OUT=${1:?output folder}; PART=${2:-both}
mkdir -p $OUT
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
date -u +%FT%TZ > $OUT/date.txt
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
CAP=""; [ "$MIB" -gt 100000 ] && CAP="--cap-gib 79.19"
if [ "$PART" != model ]; then
  PROF=""; [ "${PROFILE:-0}" = 1 ] && PROF="--updates 4 --profile-update 3"  # PROFILE=1: one update profiled
  timeout 290 python3 benchmarks/card80/run.py --out $OUT/lora7b_auto --rows lora7b_offload --updates 3 $PROF \
    --timeout 285 $CAP 2>&1 | tail -6
fi
if [ "$PART" != auto ]; then
  timeout 250 python3 benchmarks/card80/run.py --out $OUT/lora7b_model --rows lora7b_modelkv --updates 3 \
    --timeout 245 $CAP 2>&1 | tail -6
fi
