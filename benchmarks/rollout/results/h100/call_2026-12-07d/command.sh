#!/usr/bin/env bash
# Device call (one GPU, compute capability 9.x): does the compiled decode step of the tiny MoE cases record
# now that the grouped GEMM reaches the compiler as the opaque rapidfire_hf::grouped_mm (gemm "op") and not
# as torch's _grouped_mm for inductor to lower ("raw", the previous code)? Then the compiled-MoE GPU tests.
# Run from the repository root, .whl carried: bash THIS_FILE OUT
set -u
OUT=${1:?output folder}
mkdir -p $OUT
source benchmarks/common/gpu_env.sh
D=benchmarks/rollout/results/h100/call_2026-12-07d
for spec in "qwen3_moe grouped 2 op" "qwen3_moe grouped 2 raw" "mixtral grouped 2 op" "qwen3_moe dense 5 op"; do
  CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 $D/moe_diag.py $spec >> $OUT/moe_diag.jsonl 2>> $OUT/moe_diag.err \
    || echo "{\"spec\": \"$spec\", \"rc\": $?}" >> $OUT/moe_diag.jsonl
done
cut -c1-300 $OUT/moe_diag.jsonl
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_moe_decode.py -k cuda 2>&1 \
  | grep -v "^DEBUG\|^$" > $OUT/moe_tests.log; tail -3 $OUT/moe_tests.log
