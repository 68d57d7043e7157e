#!/usr/bin/env bash
# Device call on two H200s, two independent single-GPU jobs side by side (one per GPU):
#   GPU 0: rollout engine benchmark (decode ms/step vs model.generate), then torch.profiler of one PPO
#          update of ours at rollout batch 64 (pipeline on and off)
#   GPU 1: stock TRL 1.12 PPO at the larger rollout batches (128, 256) for the "largest batch" comparison
# Results are copied to $OUT (at most 8 files).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=$PYTHONPATH:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site112 .whl-trl112/*.whl .whl/datasets* .whl/dill* .whl/multiprocess* 2>/dev/null
R=/tmp/r4; mkdir -p $R
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 330 python3 benchmarks/rollout/run.py --out $R/rollout --batches 8,32,256 --budget-s 270 > $R/rollout.log 2>&1; echo "rollout rc=$?"
  for pipe in on off; do
    timeout 90 python3 benchmarks/ppo_vs_trl/profile_ours.py --out $R/prof --batch 64 --pipeline $pipe > $R/prof_$pipe.log 2>&1; echo "profile $pipe rc=$?"
  done
) > $R/gpu0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  TRL112_PATH=/tmp/site112 timeout 500 python3 benchmarks/ppo_vs_trl/run.py --out $R/trl_big --trl-batches 128,256 --our-batches "" --fused-batches "" --learn-updates 0 --timeout 230 > $R/trl_big.log 2>&1; echo "trl_big rc=$?"
) > $R/gpu1.txt 2>&1 &
wait
cat $R/gpu0.txt $R/gpu1.txt
cp $R/rollout/results.json $OUT/rollout_results.json 2>/dev/null; cp $R/rollout/results.png $OUT/rollout.png 2>/dev/null
cp $R/trl_big/results.json $OUT/trl_big_results.json 2>/dev/null
cat $R/prof/*.txt > $OUT/profiles.txt 2>/dev/null
{ for f in rollout prof_on prof_off trl_big; do echo "== $f"; tail -c 3000 $R/$f.log; done; } > $OUT/logs.txt
tail -c 4000 $OUT/logs.txt
