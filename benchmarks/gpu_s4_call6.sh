#!/usr/bin/env bash
# Fourth session (2026-11-30), device call 6 on two H200s, < 240 s (a more conservative learning rate: at lr 3e-3 call 5 collapsed or crashed in both trainers):
#   GPU 0 (CPU cores 0-15): the PPO learning comparison (issue 4), seeds 0 and 1, lr 1e-3
#   GPU 1 (CPU cores 16-31): the PPO learning comparison, seeds 2 and 3, lr 1e-3
#   stock TRL 1.12 vs ours (separate value model, fused value head), learn-small shape, 30 updates each;
#   merged afterwards with `run.py merge`.
# Carry: .whl .whl-ds .whl-trl112. Results: $OUT/s4call6.tgz.
set -u
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site112 .whl-trl112/*.whl .whl/datasets* .whl/dill* .whl/multiprocess* 2>&1 | tail -1
R=/tmp/s4call6; mkdir -p $R
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
(
  export CUDA_VISIBLE_DEVICES=0
  TRL112_PATH=/tmp/site112 pin 0-15 timeout -k 5 $((215 - $(elapsed))) python3 benchmarks/ppo_vs_trl/run.py --out $R/learn_a \
    --part learning --learn-seeds 0,1 --learn-lr 1e-3 --timeout 100 > $R/learn_a.log 2>&1
  echo "learn a rc=$? at $(elapsed)s"
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  TRL112_PATH=/tmp/site112 pin 16-31 timeout -k 5 205 python3 benchmarks/ppo_vs_trl/run.py --out $R/learn_b \
    --part learning --learn-seeds 2,3 --learn-lr 1e-3 --timeout 100 > $R/learn_b.log 2>&1
  echo "learn b rc=$? at $(elapsed)s"
) > $R/lane1.txt 2>&1 &
wait
cat $R/lane0.txt $R/lane1.txt
grep -h '"name": "learn' $R/learn_a.log $R/learn_b.log | cut -c1-260
tar czf $OUT/s4call6.tgz -C $R . 2>/dev/null; ls -la $OUT
echo "total $(elapsed)s"
