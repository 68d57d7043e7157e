#!/usr/bin/env bash
# One device call (one H100, 2026-12-07, third session of the day): the int8 KV-cache write fix under
# torch.compile (7B decode step, bf16 vs int8, batch 128 and 256), the MoE GPU tests, and the compiled rows
# of Pythia-1B and the Qwen3-MoE-shaped family beside Llama-1.1B. Run from the repository root, .whl carried.
set -u
OUT=${1:?output folder}
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
date -u +%FT%TZ > $OUT/date.txt
timeout 280 python3 benchmarks/rollout/kv_cache.py --out $OUT/kv_fix --shape llama-7b --caches bf16,int8 \
  --base-batch 128 --batches 128,256 --decode-mode compile --agree-rows 0 --budget-s 200 2>&1 | tail -8
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_moe_decode.py -k cuda 2>&1 \
  | tee $OUT/moe_tests.log | tail -4
timeout 170 python3 benchmarks/rollout/families.py --out $OUT/fam --families llama-1.1b,pythia-1b,qwen3moe-12l \
  --systems ours_compile --batches 8,64 --moe-form auto,gather --budget-s 130 2>&1 | tail -12
