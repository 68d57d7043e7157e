#!/usr/bin/env bash
# Fourth session (2026-11-30), device call 2 on two H200s, < 560 s:
#   1 (both GPUs, <= 410 s): benchmarks/distributed/gpu_largest2.sh (issue 8: llama-15b fused pure bf16 on
#     FSDP2 x2 vs 1 GPU, llama-7b on 1 GPU, ZeRO-3 x2 7B separate again)
#   2 when at least 150 s are left, one lane per GPU:
#     GPU 0, CPU cores 0-15: optimizer, pipeline bucket sizes and side-stream overlap, interleaved (issue 3)
#     GPU 1, CPU cores 16-31: our PPOTrainer on the 7B shape, separate value model, full fine-tuning, after
#       the default AdamW became fused (issue 4; it was out of memory at 136.6 GiB with foreach)
# Carry: .whl .whl-ds. Results: $OUT/largest2.tgz, $OUT/largest2_summary.txt, $OUT/s4call2.tgz.
set -u
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
TOTAL_S=410 bash benchmarks/distributed/gpu_largest2.sh > /tmp/largest2_driver.log 2>&1
echo "largest2 done at $(elapsed)s"; cat $OUT/largest2_summary.txt | cut -c1-400
source benchmarks/gpu_env.sh > /dev/null 2>&1
R=/tmp/s4call2; mkdir -p $R
left=$((545 - $(elapsed)))
echo "lanes with ${left}s"
if [ $left -ge 150 ]; then
  pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
  (
    export CUDA_VISIBLE_DEVICES=0
    pin 0-15 timeout -k 5 $((left - 10)) python3 benchmarks/optimizer/run.py --out $R/optimizer_buckets --rounds 1 --interleave 24 \
      --no-snapshot --bucket-mb 128 256 512 --only torch_adamw rf_pipeline_on rf_pipeline_bucket128 rf_pipeline_bucket256 \
      rf_pipeline_bucket512 rf_pipeline_rollback rf_rollback_overlap rf_pipeline_overlap > $R/optimizer_buckets.log 2>&1
    echo "optimizer rc=$?"
  ) > $R/lane0.txt 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    pin 16-31 timeout -k 5 $((left - 10)) python3 benchmarks/ppo_vs_trl/run.py --out $R/size7b_fused_adamw --part size7b \
      --only s7_rapidfire_full --size-timeout $((left - 25)) > $R/size7b.log 2>&1
    echo "size7b rc=$?"
  ) > $R/lane1.txt 2>&1 &
  wait
  cat $R/lane0.txt $R/lane1.txt
  grep -A12 "^interleaved" $R/optimizer_buckets.log | cut -c1-160
  grep -h '"name": "s7_' $R/size7b.log | cut -c1-400
fi
tar czf $OUT/s4call2.tgz -C $R . 2>/dev/null; ls -la $OUT
echo "total $(elapsed)s"
