#!/usr/bin/env bash
# PPO 1.1B b8: main (this tree) vs e0ac75f (.prev), alternating; then the 8-bit KV cache decode bench
set -u
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
A="--part throughput --updates 4 --timeout 110 --trl-batches \"\" --our-batches 8 --fused-batches \"\""
for i in 1 2; do
  timeout 130 python3 benchmarks/ppo_vs_trl/run.py --out $OUT/main$i --part throughput --updates 4 --timeout 110 --trl-batches "" --our-batches 8 --fused-batches "" > $OUT/main$i.log 2>&1; echo "main$i rc=$?"; tail -1 $OUT/main$i.log
  ( cd .prev && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 130 python3 benchmarks/ppo_vs_trl/run.py --out $OUT/prev$i --part throughput --updates 4 --timeout 110 --trl-batches "" --our-batches 8 --fused-batches "" > $OUT/prev$i.log 2>&1; echo "prev$i rc=$?"; tail -1 $OUT/prev$i.log )
done
timeout 250 python3 benchmarks/rollout/kv_cache.py --out $OUT/kv_cache --shape llama-7b --budget-s 200 > $OUT/kv.log 2>&1; echo "kv rc=$?"
tail -25 $OUT/kv.log
cd $OUT && tar czf all.tgz main1 main2 prev1 prev2 kv_cache 2>/dev/null && rm -rf main1 main2 prev1 prev2 kv_cache
