#!/usr/bin/env bash
# Last device call of the session on two H200s (about 9.5 minutes; run with timeout_s 595):
#   A (both GPUs, ~1.5 min): PPOTrainer smoke under DeepSpeed ZeRO-2, ZeRO-3 and FSDP2, the three at once
#      (tiny model, distinct rendezvous ports); for a failed run the first Python traceback is kept
#   B, side by side, one GPU each (~7.5 min):
#      GPU 0: our PPO throughput rerun (compiled decode step) + profile of one update, then the optimizer bench
#      GPU 1: SFT/DPO vs stock at sequence 2048, then PPO precision (bf16 vs adaptive vs fp32) ratio/KL
# Everything is copied to $OUT (8 files at most).
set -u
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
R=/tmp/r5; mkdir -p $R/engines
T0=$(date +%s)
# ---- A: sharded engines
port=29610
for engine in zero2 zero3 fsdp2; do
  case $engine in
    zero2) cfg=deepspeed_zero2; extra="" ;;
    zero3) cfg=deepspeed_zero3; extra="--gather --rollout-backend hf" ;;
    fsdp2) cfg=fsdp2; extra="--gather --rollout-backend hf" ;;
  esac
  port=$((port + 7))
  ( timeout -k 5 100 accelerate launch --main_process_port $port --config_file accelerate_configs/$cfg.yaml \
      tests/distributed/scripts/ppo_ranks.py $R/engines/$engine --device cuda --bf16 $extra > $R/engines/$engine.log 2>&1
    echo "{\"engine\": \"$engine\", \"rc\": $?}" >> $R/engines/rc.jsonl ) &
done
wait
{ cat $R/engines/rc.jsonl
  for engine in zero2 zero3 fsdp2; do
    echo "===== $engine"; grep -m1 -B2 -A45 "Traceback (most recent call last)" $R/engines/$engine.log | head -60
    grep -E "^[A-Za-z_.]*(Error|Exception)[: ]" $R/engines/$engine.log | sort | uniq -c | head -8
    grep -E "rapidfire|engine|fall back|falls back" $R/engines/$engine.log | head -8
    tail -n 3 $R/engines/$engine.log
  done; } > $OUT/engines.txt 2>&1
echo "A done in $(($(date +%s) - T0)) s"; cat $R/engines/rc.jsonl
# ---- B
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site112 .whl-trl112/*.whl .whl/datasets* .whl/dill* .whl/multiprocess* 2>/dev/null
(
  export CUDA_VISIBLE_DEVICES=0
  timeout -k 5 270 python3 benchmarks/ppo_vs_trl/run.py --out $R/ppo --trl-batches "" --our-batches 8,32,256 --fused-batches 64,256 --learn-updates 0 --timeout 85 > $R/ppo.log 2>&1; echo "ppo rc=$?"
  timeout -k 5 60 python3 benchmarks/ppo_vs_trl/profile_ours.py --out $R/prof --batch 64 --cuda-only > $R/prof.log 2>&1; echo "profile rc=$?"
  timeout -k 5 100 python3 benchmarks/optimizer/run.py --out $R/optimizer > $R/optimizer.log 2>&1; echo "optimizer rc=$?"
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 250 python3 benchmarks/trl_trainers/run.py --out $R/trl_trainers --systems stock,rapidfire,stock_no_ckpt --max-batch --budget-s 220 > $R/trl_trainers.log 2>&1; echo "trl_trainers rc=$?"
  timeout -k 5 170 python3 benchmarks/precision/ppo_ratio.py --out $R/prec --rollout-decode-mode cuda_graph --updates 20 > $R/prec.log 2>&1; echo "ppo_ratio rc=$?"
) > $R/lane1.txt 2>&1 &
wait
echo "B done in $(($(date +%s) - T0)) s"; cat $R/lane0.txt $R/lane1.txt
cat $R/prof/*.txt > $OUT/profile.txt 2>/dev/null
tar czf $OUT/results.tgz -C $R ppo optimizer trl_trainers prec 2>/dev/null; ls -la $OUT
{ for f in $R/*.log; do echo "== $f"; tail -c 2500 $f; done; } > $OUT/logs.txt
