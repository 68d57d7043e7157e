#!/usr/bin/env bash
# Second device call: PPO learning curves (ours), stock GRPO vs enable_rapidfire(GRPO), rollout decode timing.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
timeout 200 python3 benchmarks/ppo_vs_trl/run.py --out $OUT/ppo_learn --only learn_rapidfire --timeout 95 2>&1 | grep '^{' | tee $OUT/ppo_learn.log
timeout 230 python3 benchmarks/grpo/run.py --out $OUT/grpo 2>&1 | tail -25 | tee $OUT/grpo.log
timeout 150 python3 benchmarks/rollout/run.py --out $OUT/rollout --batches 32,256 --systems ours_cuda_graph,hf_dynamic,ours_eager,hf_static --budget-s 90 2>&1 | tail -20 | tee $OUT/rollout.log
