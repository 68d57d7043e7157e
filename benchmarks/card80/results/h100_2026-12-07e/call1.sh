#!/usr/bin/env bash
# Device call 1 of 2026-12-07e (one H100 80 GB): 7B full fine-tuning batch 160 with PPOConfig's defaults
# (row full7b_offload) against the frozen reference and reward models in 8-bit (row full7b_frozen8), one
# worker process per row, back to back on one card; then, in what is left of the call's 10 minutes, the
# families added since the last GPU check with the compiled and recorded decode step (tests/rollout).
# Run from the repository root, .whl carried: bash THIS_FILE OUT (CAP_GIB=79.19 on a bigger card)
set -u
source benchmarks/common/call_start.sh "$@"
timeout 440 python3 benchmarks/card80/run.py --out $OUT/full7b_frozen --rows full7b_offload,full7b_frozen8 \
  --updates 3 --timeout 215 ${CAP_GIB:+--cap-gib $CAP_GIB} 2>&1 | grep "^|\|\[" | tail -14
left=$((580 - SECONDS))
if [ $left -gt 30 ]; then
  timeout $left python3 -m pytest -q -p no:cacheprovider tests/rollout/test_families_gpu.py -k \
    "olmo3 or starcoder2 or exaone4 or cohere2 or olmoe or qwen2_moe or granitemoe or phi or helium or glm or ernie" \
    2>&1 | grep -v "^DEBUG\|^$" > $OUT/families_gpu.log
  tail -3 $OUT/families_gpu.log
fi
