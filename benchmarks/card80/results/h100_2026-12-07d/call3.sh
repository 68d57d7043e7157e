#!/usr/bin/env bash
# Device call 3 of 2026-12-07d (one H100): the compiled-MoE GPU tests (the form asked outside the step), then
# 7B full fine-tuning batch 160 with use_liger_kernel=True (the defaults row: results/h100_2026-12-06).
# Run from the repository root, .whl carried: bash THIS_FILE OUT
set -u
OUT=${1:?output folder}
mkdir -p $OUT
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
date -u +%FT%TZ > $OUT/date.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_moe_decode.py -k cuda 2>&1 \
  | grep -v "^DEBUG\|^$" > $OUT/moe_tests.log; tail -2 $OUT/moe_tests.log
timeout 230 python3 benchmarks/card80/run.py --out $OUT/full7b_speed --rows full7b_liger \
  --updates 3 --timeout 220 2>&1 | grep "^|\|\[" | tail -10
