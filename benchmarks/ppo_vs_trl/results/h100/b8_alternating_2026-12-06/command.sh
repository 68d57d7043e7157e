#!/usr/bin/env bash
# One device call: PPO 1.1B batch 8, ours at main (this tree) vs ours at e0ac75f (.prev), alternating
# main, prev, main, prev (issue 44: the redesign no slower), then issue 45's gemma2/mixtral GPU diagnosis.
set -u
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
T0=$SECONDS
row() {  # row NAME DIR(. or .prev)
  local name=$1 dir=$2
  if (( SECONDS - T0 > 250 )); then echo "$name skipped (time)"; return; fi
  ( cd $dir && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 130 python3 benchmarks/ppo_vs_trl/run.py --out $OUT/$name \
      --part throughput --timeout 110 --fused-batches "" --updates 3 --trl-batches "" --our-batches 8 \
      > $OUT/$name.log 2>&1; echo "$name rc=$?" )
}
row main1 .; row prev1 .prev; row main2 .; row prev2 .prev
python3 benchmarks/ppo_vs_trl/results/h100/b8_alternating_2026-12-06/summarize.py $OUT main1 prev1 main2 prev2
left=$(( 340 - (SECONDS - T0) )); (( left > 100 )) && left=100
TOTAL_S=$left bash benchmarks/rollout/gpu_diag_families.sh $OUT/diag > $OUT/diag.log 2>&1
tail -25 $OUT/diag.log
