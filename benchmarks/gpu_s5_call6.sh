#!/usr/bin/env bash
# Fifth session (2026-12-01), device call 6 on one H200, < 220 s: the new rollout_generation_batch_size on the
# GPU. Ours with the fused value head at rollout batch 4096 (16x the largest batch stock TRL was run at),
# generated 512 prompts at a time, one update (it includes the CUDA-graph recording), CUDA-graph decode.
# Carry: .whl. Results: $OUT/s5call6.tgz.
set -u
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
source benchmarks/gpu_env.sh
R=/tmp/s5call6; mkdir -p $R
timeout -k 5 205 python3 benchmarks/ppo_vs_trl/run.py --out $R/b4096 --part throughput --updates 1 --timeout 195 \
  --trl-batches "" --our-batches "" --fused-batches 4096 --ours-decode-mode cuda_graph --ours-gen-chunk 512 > $R/b4096.log 2>&1
echo "b4096 rc=$? at $(elapsed)s"
tail -3 $R/b4096.log
tar czf $OUT/s5call6.tgz -C $R . 2>/dev/null; ls -la $OUT
echo "total $(elapsed)s"
