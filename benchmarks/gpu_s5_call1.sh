#!/usr/bin/env bash
# Fifth session (2026-11-30), device call 1 on two H200s, < 560 s.
# NOTE: run.py (until fixed afterwards) kept each worker's result row in $TMPDIR/ppo_vs_trl_row_<name>.json,
# so parallel runs of one configuration name at different learning rates overwrote each other's rows: of the
# fused rows only lr 3e-4 seeds 0, 4, lr 6e-4 seeds 1, 2, 3, 5 and lr 1e-3 seeds 4..7 survived (each row
# records the lr it ran with). gpu_s5_call2.sh gives every run its own TMPDIR.
#   Phase 1 (both GPUs, 6 lanes each, CPU cores split between lanes): the PPO learning comparison (issue 4)
#     on learn-small, 30 updates: stock TRL 1.12, ours separate and ours fused at lr 3e-4, seeds 0..7;
#     ours fused at lr 6e-4 (seeds 0..7) and 1e-3 (seeds 4..7; 0..3 are in results/learning_h200_lr1e-3).
#     One run.py per (system, lr, seed); merged afterwards with `run.py merge` (learning results do not
#     depend on timing, so lanes may share a GPU).
#   Phase 2: GPU 0: the GRPO benchmark, stock vs rapidfire_lowmem4 (the library switch of issue 7);
#     GPU 1 (the only visible GPU): the GRPO low-memory GPU tests and the optimizer GPU tests.
# Carry: .whl .whl-ds .whl-trl112 .whl-ao. Results: $OUT/s5call1.tgz.
set -u
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site112 .whl-trl112/*.whl .whl/datasets* .whl/dill* .whl/multiprocess* 2>&1 | tail -1
R=/tmp/s5call1; mkdir -p $R
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpus.csv 2>&1
# jobs: "prefix lr seed"
JOBS=()
for s in 0 1 2 3 4 5 6 7; do
  JOBS+=("learn_trl 3e-4 $s" "learn_rapidfire_separate 3e-4 $s" "learn_rapidfire_fused 3e-4 $s" "learn_rapidfire_fused 6e-4 $s")
done
for s in 4 5 6 7; do JOBS+=("learn_rapidfire_fused 1e-3 $s"); done
LANES=12
lane() {  # lane index
  local i=$1 gpu=$(( $1 % 2 )) k=$(( $1 / 2 ))
  local c0=$(( gpu * 16 + k * 16 / 6 )) c1=$(( gpu * 16 + (k + 1) * 16 / 6 - 1 ))
  local j
  for ((j = i; j < ${#JOBS[@]}; j += LANES)); do
    set -- ${JOBS[$j]}
    local name=$1 lr=$2 seed=$3 left=$((300 - $(elapsed)))
    if [ $left -lt 30 ]; then echo "skip $name lr=$lr s=$seed (time)"; continue; fi
    CUDA_VISIBLE_DEVICES=$gpu TRL112_PATH=/tmp/site112 OMP_NUM_THREADS=2 pin $c0-$c1 timeout -k 5 $left \
      python3 benchmarks/ppo_vs_trl/run.py --out $R/lr$lr/${name}_s$seed --part learning --only $name \
      --learn-lr $lr --learn-seeds $seed --timeout 200 > $R/lr$lr.${name}_s$seed.log 2>&1
    echo "$name lr=$lr s=$seed rc=$? at $(elapsed)s (gpu $gpu cores $c0-$c1)"
  done
}
for ((l = 0; l < LANES; l++)); do lane $l > $R/lane$l.txt 2>&1 & done
wait
cat $R/lane*.txt
echo "phase 1 done at $(elapsed)s"
(
  export CUDA_VISIBLE_DEVICES=0
  pin 0-15 timeout -k 5 $((540 - $(elapsed))) python3 benchmarks/grpo/run.py --out $R/grpo \
    --variants stock,rapidfire_lowmem4 > $R/grpo.log 2>&1
  echo "grpo rc=$? at $(elapsed)s"
) > $R/p2lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  pin 16-31 timeout -k 5 $((540 - $(elapsed))) python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/integrations/test_grpo_lowmem.py tests/integrations/test_lowmem_option.py tests/optim/test_gpu.py \
    > $R/gpu_tests.log 2>&1
  echo "gpu tests rc=$? at $(elapsed)s"
) > $R/p2lane1.txt 2>&1 &
wait
cat $R/p2lane0.txt $R/p2lane1.txt
tail -5 $R/gpu_tests.log; tail -8 $R/grpo.log
for f in $R/lr*/*/results.json; do python3 - "$f" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])).get("rows", []):
    print(sys.argv[1].split("/")[-3], r.get("name"), r.get("status"), "last5", r.get("reward_last5"))
PY
done
tar czf $OUT/s5call1.tgz -C $R . 2>/dev/null; ls -la $OUT
echo "total $(elapsed)s"
