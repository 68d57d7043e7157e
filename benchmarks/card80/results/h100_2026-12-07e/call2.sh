#!/usr/bin/env bash
# Device call 2 of 2026-12-07e (one H100 80 GB): PPO's learning curve with the frozen reference and reward
# models as given (bf16), in 8-bit and in 4-bit, Llama-1.1B shape (benchmarks/frozen_quant; the CPU curve is
# results/cpu_2026-12-06); then the families added since the last GPU check (olmo3, starcoder2, exaone4,
# cohere2 and the seventeen added on 2026-12-07e) with the compiled and
# recorded decode step, and the routed-MoE GPU tests of the new MoE families. Run from the repository root,
# .whl carried: bash THIS_FILE OUT
set -u
source benchmarks/common/call_start.sh "$@"
timeout 420 python3 benchmarks/frozen_quant/run.py --out $OUT/gpu_frozen_quant --shape llama-1.1b --batch 32 \
  --micro 8 --prompt-length 64 --response-length 64 --updates 30 --epochs 2 --reward-scale 1 --budget-s 360 \
  2>&1 | tail -12
timeout 140 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_families_gpu.py \
  -k "olmo or starcoder2 or exaone4 or cohere2 or qwen2_moe or granitemoe or phi or helium or glm or ernie or seed_oss or arcee or apertus or hunyuan or ministral or nemotron" 2>&1 | grep -v "^DEBUG\|^$" > $OUT/families_gpu.log
tail -3 $OUT/families_gpu.log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_moe_decode.py -k "cuda and (olmoe or flex_olmo or qwen2_moe or granitemoe)" \
  2>&1 | grep -v "^DEBUG\|^$" > $OUT/moe_gpu.log
tail -3 $OUT/moe_gpu.log
