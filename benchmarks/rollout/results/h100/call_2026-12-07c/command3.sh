#!/usr/bin/env bash
# Device call (one H100): which MoE expert form fails when the decode step is compiled (tiny test cases, one
# form per process), then the 7B LoRA batch-256 row with PPOConfig's defaults, where rollout_kv_cache_dtype
# "auto" now plans the int8 cache (memory.kv_choice).
set -u
OUT=${1:?output folder}
source benchmarks/common/gpu_env.sh
D=benchmarks/rollout/results/h100/call_2026-12-07c
for spec in "qwen3_moe grouped 2" "qwen3_moe dense 5" "qwen3_moe gather 2" "mixtral grouped 2"; do
  CUDA_LAUNCH_BLOCKING=1 timeout 45 python3 $D/moe_diag.py $spec >> $OUT/moe_diag.jsonl 2>> $OUT/moe_diag.err \
    || echo "{\"spec\": \"$spec\", \"rc\": $?}" >> $OUT/moe_diag.jsonl
done
cut -c1-400 $OUT/moe_diag.jsonl
python3 benchmarks/card80/run.py --out $OUT/lora7b_auto --rows lora7b_offload --updates 3 --timeout 330 ${CAP_GIB:+--cap-gib $CAP_GIB} 2>&1 | tail -6
