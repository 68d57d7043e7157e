#!/usr/bin/env bash
# One device call for benchmarks/kernels (run from the repository root on the GPU machine, .whl/ carried):
#   bash benchmarks/kernels/h200.sh OUT
# the GPU tests of the Triton kernels, the kernel benchmark, then the decode step end to end
# (benchmarks/rollout: compiled / recorded step with and without the Triton kernels, batch 8 and 64).
set -u
OUT=${1:?output folder}
source benchmarks/common/gpu_env.sh
python3 -m pytest -q -p no:cacheprovider tests/kernels -m gpu 2>&1 | tail -4
python3 benchmarks/kernels/run.py --out "$OUT/kernels" 2>&1 | grep -v "^{" | tail -3
python3 benchmarks/rollout/run.py --out "$OUT/rollout" --batches ${ROLLOUT_BATCHES:-8,64} --budget-s ${ROLLOUT_BUDGET_S:-150} --no-correctness \
  --systems ${ROLLOUT_SYSTEMS:-ours_compile,ours_compile+triton,ours_compile+tattn,ours_cuda_graph,ours_cuda_graph+triton} 2>&1 | tail -14
