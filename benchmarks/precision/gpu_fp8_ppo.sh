#!/usr/bin/env bash
# Device script for the precision benchmarks (issue 6): carry .whl .whl-ds .whl-ao (torchao 0.17.0).
#   lane 0 (GPU 0): benchmarks/precision/run.py, every part (fp16 overflow; FP8 vs bf16 speed on the 1.1B
#                   and 7B linears per backend; 40-step 1.1B FP8 vs bf16 loss), ~3 min
#   lane 1 (GPU 1 when there are two, else after lane 0 on GPU 0): ppo_ratio.py, bf16 vs adaptive vs fp32,
#                   20 updates of llama-160m, ~4 min
# PARTS=fp8 or PARTS=ppo runs one lane only (one H200 runs both in ~7 min of its 10-minute limit).
# Results: $OUT/fp8.tgz (precision/, its log, versions) and $OUT/ppo_ratio.tgz, each packed as its lane ends.
set -u
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
R=/tmp/precision_run; rm -rf $R; mkdir -p $R
PARTS=${PARTS:-fp8,ppo}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpus.csv 2>&1
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)" > $R/versions.txt 2>&1
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
fp8() {
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 320 python3 benchmarks/precision/run.py --out $R/precision \
    --budget-s 220 > $R/precision.log 2>&1; echo "precision rc=$?"
  tar czf $OUT/fp8.tgz -C $R precision precision.log versions.txt gpus.csv 2>/dev/null
}
ppo() {
  CUDA_VISIBLE_DEVICES=$1 timeout -k 5 420 python3 benchmarks/precision/ppo_ratio.py --out $R/ppo_ratio \
    --rollout-decode-mode cuda_graph --updates 20 > $R/ppo_ratio.log 2>&1; echo "ppo_ratio rc=$?"
  tar czf $OUT/ppo_ratio.tgz -C $R ppo_ratio ppo_ratio.log 2>/dev/null
}
case $PARTS in
  fp8) fp8 ;;
  ppo) ppo 0 ;;
  *) if [ "$NGPU" -ge 2 ]; then fp8 & ppo 1 & wait; else fp8; ppo 0; fi ;;
esac
cat $R/versions.txt
grep -E "^fp8 |seconds per part|final loss" $R/precision.log 2>/dev/null
tail -4 $R/ppo_ratio.log 2>/dev/null
ls -la $OUT
