#!/usr/bin/env bash
# Second device call of the 2026-11-30 (third) session, two H200s, one lane per GPU, about 9 minutes:
#   GPU 0: the optimizer's GPU tests (pipeline_overlap included), the optimizer benchmark (3 interleaved
#          rounds: step time, peak and held-at-step memory, checkpointing variants, snapshot/rollback
#          cost), then the precision benchmark (fp16 overflow vs adaptive, FP8 vs bf16)
#   GPU 1: every other GPU test of the suite (real OOM split, compaction, rollout, ...), then the memory
#          benchmark (interleaved callback time cost, sequences 512/2048/4096)
# Carry: .whl .whl-ds .whl-trl112. Results come back as one tarball.
set -u
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
R=/tmp/call2; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpus.csv 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  timeout -k 5 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/optim/test_gpu.py --junitxml $R/optim_gpu.xml > $R/optim_gpu.log 2>&1; echo "optim gpu tests rc=$?"
  timeout -k 5 320 python3 benchmarks/optimizer/run.py --out $R/optimizer --rounds 3 --bucket-mb 32 128 > $R/optimizer.log 2>&1; echo "optimizer rc=$?"
  timeout -k 5 130 python3 benchmarks/precision/run.py --out $R/precision > $R/precision.log 2>&1; echo "precision rc=$?"
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/optim/test_gpu.py --ignore=tests/distributed --junitxml $R/gpu_tests.xml > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"
  timeout -k 5 370 python3 benchmarks/memory/run.py --out $R/memory > $R/memory.log 2>&1; echo "memory rc=$?"
) > $R/lane1.txt 2>&1 &
wait
cat $R/lane0.txt $R/lane1.txt
tail -3 $R/optim_gpu.log $R/gpu_tests.log
tar czf $OUT/call2.tgz -C $R . 2>/dev/null; ls -la $OUT
