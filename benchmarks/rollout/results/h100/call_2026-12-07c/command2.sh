#!/usr/bin/env bash
# The session's third device call (one H100): which MoE expert form fails when the decode step is compiled
# (tiny test cases, one form per process), then the frozen-quant learning curve at 1.1B (issue 46 item 2).
set -u
OUT=${1:?output folder}
source benchmarks/common/gpu_env.sh
D=benchmarks/rollout/results/h100/call_2026-12-07c
for spec in "qwen3_moe grouped 2" "qwen3_moe dense 5" "qwen3_moe gather 2" "mixtral grouped 2"; do
  CUDA_LAUNCH_BLOCKING=1 timeout 45 python3 $D/moe_diag.py $spec >> $OUT/moe_diag.jsonl 2>> $OUT/moe_diag.err \
    || echo "{\"spec\": \"$spec\", \"rc\": $?}" >> $OUT/moe_diag.jsonl
done
cut -c1-600 $OUT/moe_diag.jsonl
timeout 375 python3 benchmarks/frozen_quant/run.py --out $OUT/gpu_frozen_quant --shape llama-1.1b --batch 32 \
  --micro 8 --prompt-length 64 --response-length 64 --updates 30 --epochs 2 --reward-scale 1 --budget-s 345 2>&1 | tail -15
