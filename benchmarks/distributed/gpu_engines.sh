#!/usr/bin/env bash
# 2-GPU device call: PPOTrainer smoke runs under DDP, DeepSpeed ZeRO-2/3 and FSDP2 (accelerate configs of
# accelerate_configs/), then PPO tokens/s on 1 vs 2 GPUs. Installs the carried wheels (.whl, .whl-ds:
# DeepSpeed built here as a pure-Python wheel with DS_BUILD_OPS=0). Summary files go to $OUT.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-ds/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site
python3 -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'gpus', torch.cuda.device_count())" 2>&1 | tail -1
D=/tmp/dist
SKIP="nccl_tests" BUDGET_S=${BUDGET_S:-520} bash benchmarks/distributed/run.sh $D
cp $D/results.json $D/*.png $OUT/ 2>/dev/null
for f in $D/smoke_*.log $D/tput_*.log; do { echo "== $f"; tail -c 1500 $f; } ; done > $OUT/logs.txt 2>/dev/null
cp $D/steps.jsonl $OUT/ 2>/dev/null
cat $D/steps.jsonl
