#!/usr/bin/env bash
# Device call: which MoE expert form fails when the decode step is compiled (tiny test cases, one form per
# process), the compiled-MoE GPU test at 2 rows, then the frozen-quant learning curve at 1.1B (issue 46 item 2).
set -u
OUT=${1:?output folder}
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
D=benchmarks/rollout/results/h100/call_2026-12-07c
for spec in "qwen3_moe grouped 2" "qwen3_moe dense 5" "qwen3_moe gather 2"; do
  CUDA_LAUNCH_BLOCKING=1 timeout 40 python3 $D/moe_diag.py $spec >> $OUT/moe_diag.jsonl 2>> $OUT/moe_diag.err \
    || echo "{\"spec\": \"$spec\", \"rc\": $?}" >> $OUT/moe_diag.jsonl
done
cut -c1-400 $OUT/moe_diag.jsonl
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_moe_decode.py -k grouped_on_cuda 2>&1 \
  | grep -v "^DEBUG\|^  \|^$" > $OUT/moe_tests.log; tail -3 $OUT/moe_tests.log
timeout 200 python3 benchmarks/frozen_quant/run.py --out $OUT/gpu_frozen_quant --shape llama-1.1b --batch 32 \
  --micro 8 --prompt-length 64 --response-length 64 --updates 20 --epochs 2 --reward-scale 1 --budget-s 180 2>&1 | tail -15
