#!/usr/bin/env bash
# Fifth session (2026-11-30), device call 4 on two H200s, < 330 s.
#   GPU 0 (cores 0-15): stock TRL 1.12 at rollout batch 256 and ours fused with Liger + per-layer compile at
#     batch 256, default (compiled) decode, in one run.py run (issue 4: the best configurations side by side).
#   GPU 1 (cores 16-31): FP8 end to end on the 1.1B shape with bf16 weights (call 3 used fp32 master weights
#     there, and FP8 was slower than compiled bf16), then ours separate with per-layer compile at batch 256.
# Carry: .whl .whl-ao .whl-trl112 (DeepSpeed is not needed; all four exceed the 64 MiB carry limit). Results: $OUT/s5call4.tgz.
set -u
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site112 .whl-trl112/*.whl .whl/datasets* .whl/dill* .whl/multiprocess* 2>&1 | tail -1
R=/tmp/s5call4; mkdir -p $R
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
(
  export CUDA_VISIBLE_DEVICES=0
  TRL112_PATH=/tmp/site112 pin 0-15 timeout -k 5 $((320 - $(elapsed))) python3 benchmarks/ppo_vs_trl/run.py --out $R/best_a \
    --part throughput --updates 2 --timeout 220 --trl-batches 256 --our-batches "" --fused-batches 256 \
    --fused-variants liger+compile > $R/best_a.log 2>&1
  echo "best a rc=$? at $(elapsed)s"
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  pin 16-31 timeout -k 5 100 python3 benchmarks/precision/run.py --out $R/fp8_loss_1b_bf16 --parts fp8_loss \
    --fp8-loss-weights bf16 --fp8-loss-variants bf16_compiled,torchao_tensorwise_compiled \
    --fp8-loss-steps 40 --budget-s 60 > $R/fp8_loss_1b_bf16.log 2>&1
  echo "fp8 1.1b bf16 rc=$? at $(elapsed)s"
  pin 16-31 timeout -k 5 $((320 - $(elapsed))) python3 benchmarks/ppo_vs_trl/run.py --out $R/best_b \
    --part throughput --updates 2 --timeout 220 --trl-batches "" --our-batches 256 --fused-batches "" \
    --ours-variants compile > $R/best_b.log 2>&1
  echo "best b rc=$? at $(elapsed)s"
) > $R/lane1.txt 2>&1 &
wait
cat $R/lane0.txt $R/lane1.txt
grep -h "fp8 loss" $R/fp8_loss_1b_bf16.log
for f in $R/best_*/results.json; do python3 - "$f" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r.get("name"), r.get("status"), "s/upd", r.get("s_per_update"), "tok/s", r.get("tokens_per_s"),
          "gen", r.get("gen_share"), "score", r.get("score_s"), "train", r.get("train_s"), "peak", r.get("peak_gib"),
          (r.get("error") or "")[-300:])
PY
done
tar czf $OUT/s5call4.tgz -C $R . 2>/dev/null; ls -la $OUT
echo "total $(elapsed)s"
