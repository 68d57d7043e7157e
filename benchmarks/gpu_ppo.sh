#!/usr/bin/env bash
# One device call: install carried wheels, GPU correctness tests of the rollout engine and the PPO
# trainer, then stock TRL 1.12 PPO vs rapidfire PPO. Results land in $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site112 .whl-trl112/*.whl .whl/datasets* .whl/dill* .whl/multiprocess*
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)" | tee -a $OUT/gpu.txt
timeout 150 python3 -m pytest -q -m gpu tests/rollout tests/kernels -x -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
backend=auto; grep -q " failed\|error" $OUT/gpu_tests.txt && backend=hf
echo "rollout backend for the benchmark: $backend" | tee -a $OUT/gpu_tests.txt
TRL112_PATH=/tmp/site112 python3 benchmarks/ppo_vs_trl/run.py --out $OUT/ppo_vs_trl --rollout-backend $backend "$@" 2>&1 | tee $OUT/ppo_vs_trl.log | grep -v Warning
