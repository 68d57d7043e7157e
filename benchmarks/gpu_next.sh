#!/usr/bin/env bash
# What the next device session should run first (two H200s, about 9.5 minutes; timeout_s 595), written
# at the end of the 2026-11-30 session from what was left unmeasured:
#   A (both GPUs, ~3 min): PPOTrainer smoke under ZeRO-2, ZeRO-3 (re-entrant gather fix) and FSDP2, then
#      the optimizer bench on GPU 0 (peak memory after the lifetime fix)
#   B, one GPU each (~7.5 min):
#      GPU 0: GRPO stock vs rapidfire_lowmem (the <= 1/2 memory target), then the compiled decode
#             step at rollout batch 256 (not reached last time)
#      GPU 1: our PPO on the 7B shape (full and LoRA, separate and fused), then fused PPO at batch 256
#             with the compiled decode step
# Carry: .whl .whl-ds .whl-trl112. Results come back as one tarball plus the engine summary.
# A second call should run:
# benchmarks/memory/run.py (interleaved time cost), benchmarks/precision/run.py (FP8 after its fixes),
# benchmarks/precision/ppo_ratio.py --modes fp32, and the stock-TRL side of --part size7b.
set -u
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
R=/tmp/next; mkdir -p $R
timeout -k 5 200 bash benchmarks/distributed/gpu_engines_quick.sh > $R/engines.log 2>&1 || true
cp $OUT/engines.json $OUT/engines_errors.txt $R/ 2>/dev/null
(
  export CUDA_VISIBLE_DEVICES=0
  timeout -k 5 280 python3 benchmarks/grpo/run.py --out $R/grpo --variants stock,rapidfire_lowmem > $R/grpo.log 2>&1; echo "grpo rc=$?"
  timeout -k 5 100 python3 benchmarks/rollout/run.py --out $R/rollout256 --batches 256 --systems ours_compile,ours_cuda_graph --budget-s 80 > $R/rollout.log 2>&1; echo "rollout rc=$?"
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 300 python3 benchmarks/ppo_vs_trl/run.py --out $R/s7 --part size7b --only s7_ --size-timeout 150 > $R/s7.log 2>&1; echo "size7b rc=$?"
  timeout -k 5 90 python3 benchmarks/ppo_vs_trl/run.py --out $R/fused256 --trl-batches "" --our-batches "" --fused-batches 256 --learn-updates 0 --timeout 85 > $R/fused256.log 2>&1; echo "fused256 rc=$?"
) > $R/lane1.txt 2>&1 &
wait
cat $R/lane0.txt $R/lane1.txt
tar czf $OUT/next.tgz -C $R . 2>/dev/null; ls -la $OUT
