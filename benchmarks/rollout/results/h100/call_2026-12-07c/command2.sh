#!/usr/bin/env bash
# Device call (one GPU, compute capability 9.x): which MoE expert form fails when the decode step is compiled
# on the tests' tiny cases (one form per process: a CUDA error poisons it), then the compiled-MoE GPU test,
# which now decodes 2 rows (the grouped GEMM's default batch for both cases).
set -u
OUT=${1:?output folder}
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
D=benchmarks/rollout/results/h100/call_2026-12-07c
for spec in "qwen3_moe grouped 2" "qwen3_moe dense 5" "qwen3_moe gather 2"; do
  CUDA_LAUNCH_BLOCKING=1 timeout 50 python3 $D/moe_diag.py $spec >> $OUT/moe_diag.jsonl 2>> $OUT/moe_diag.err \
    || echo "{\"spec\": \"$spec\", \"rc\": $?}" >> $OUT/moe_diag.jsonl
done
cut -c1-400 $OUT/moe_diag.jsonl
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_moe_decode.py -k cuda 2>&1 \
  | grep -v "^DEBUG\|^  \|^$" > $OUT/moe_tests.log; tail -3 $OUT/moe_tests.log
