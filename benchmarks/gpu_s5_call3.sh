#!/usr/bin/env bash
# Fifth session (2026-11-30), device call 3 on two H200s, < 570 s.
#   GPU 0 (cores 0-15): the PPO speed-up GPU tests (Liger, per-layer compile), then the 1.1B throughput of
#     ours at rollout batch 256 with the speed-ups (issue 4): base vs liger+compile (separate and fused), then
#     micro-batch 32 and the single knobs while time is left. CUDA-graph decode (no decode compile: start-up).
#   GPU 1 (cores 16-31): FP8 end to end (issue 6): compiled 1.1B training (fp32 master weights) and compiled
#     7B training (bf16 weights), bf16 vs torchao float8.
# Carry: .whl .whl-ds .whl-ao. Results: $OUT/s5call3.tgz.
set -u
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
R=/tmp/s5call3; mkdir -p $R
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
(
  export CUDA_VISIBLE_DEVICES=0
  pin 0-15 timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider tests/ppo/test_speedups_gpu.py tests/ppo/test_speedups.py > $R/speedups_tests.log 2>&1
  echo "speed-up tests rc=$? at $(elapsed)s"
  pin 0-15 timeout -k 5 $((555 - $(elapsed))) python3 benchmarks/ppo_vs_trl/run.py --out $R/sp_a --part throughput \
    --trl-batches "" --updates 2 --ours-decode-mode cuda_graph --timeout 150 \
    --our-batches 256 --fused-batches 256 --ours-variants base,liger+compile --fused-variants base,liger+compile > $R/sp_a.log 2>&1
  echo "speed a rc=$? at $(elapsed)s"
  left=$((555 - $(elapsed)))
  if [ $left -gt 60 ]; then
    pin 0-15 timeout -k 5 $left python3 benchmarks/ppo_vs_trl/run.py --out $R/sp_b --part throughput \
      --trl-batches "" --updates 2 --ours-decode-mode cuda_graph --timeout 150 \
      --our-batches 256 --fused-batches 256 --ours-variants m32,liger,compile --fused-variants m32 > $R/sp_b.log 2>&1
    echo "speed b rc=$? at $(elapsed)s"
  fi
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  pin 16-31 timeout -k 5 250 python3 benchmarks/precision/run.py --out $R/fp8_loss_1b --parts fp8_loss \
    --fp8-loss-variants bf16,bf16_compiled,torchao_tensorwise_compiled,torchao_rowwise_compiled \
    --fp8-loss-steps 40 --budget-s 120 > $R/fp8_loss_1b.log 2>&1
  echo "fp8 1.1b rc=$? at $(elapsed)s"
  pin 16-31 timeout -k 5 $((560 - $(elapsed))) python3 benchmarks/precision/run.py --out $R/fp8_loss_7b --parts fp8_loss \
    --fp8-loss-shape llama-7b --fp8-loss-weights bf16 \
    --fp8-loss-variants bf16_compiled,torchao_tensorwise_compiled,torchao_rowwise_compiled \
    --fp8-loss-steps 30 --budget-s 130 > $R/fp8_loss_7b.log 2>&1
  echo "fp8 7b rc=$? at $(elapsed)s"
) > $R/lane1.txt 2>&1 &
wait
cat $R/lane0.txt $R/lane1.txt
tail -4 $R/speedups_tests.log
grep -h "fp8 loss" $R/fp8_loss_1b.log $R/fp8_loss_7b.log
for f in $R/sp_*/results.json; do python3 - "$f" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r.get("name"), r.get("status"), "s/upd", r.get("s_per_update"), "tok/s", r.get("tokens_per_s"),
          "gen", r.get("gen_share"), "score", r.get("score_s"), "train", r.get("train_s"), "peak", r.get("peak_gib"),
          (r.get("error") or "")[-300:])
PY
done
tar czf $OUT/s5call3.tgz -C $R . 2>/dev/null; ls -la $OUT
echo "total $(elapsed)s"
