#!/usr/bin/env bash
# Fourth session (2026-11-30), device call 1 on two H200s, about 7 minutes:
#   1 (both GPUs, <= 95 s): enable_rapidfire (SFTTrainer) under FSDP2 after the third DTensor fix (issue 8),
#     next to the GPU tests of the GRPO low-memory paths and of the optimizer on GPU 0 (tiny models)
#   2 GPU 0, CPU cores 0-15: the optimizer benchmark with step-level interleaving (every variant resident,
#     per-step paired ratios; issue 3), after one sequential round for the memory columns
#     GPU 1, CPU cores 16-31: stock TRL 1.12 PPO on the 7B shape, full fine-tuning and LoRA (issue 4)
# Carry: .whl .whl-ds .whl-trl112. Results come back as one tarball, $OUT/s4call1.tgz.
set -u
T0=$(date +%s)
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site112 .whl-trl112/*.whl .whl/datasets* .whl/dill* .whl/multiprocess* 2>&1 | tail -1
R=/tmp/s4call1; mkdir -p $R
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > $R/gpus.txt 2>&1
python3 -c "import torch, transformers, accelerate, trl; print(torch.__version__, transformers.__version__, accelerate.__version__, trl.__version__)" > $R/versions.txt 2>&1
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
( timeout -k 5 95 accelerate launch --main_process_port 29731 --config_file accelerate_configs/fsdp2.yaml \
    tests/distributed/scripts/sft_ranks.py $R/sft_fsdp2 --device cuda --bf16 > $R/sft_fsdp2.log 2>&1; echo "sft fsdp2 rc=$?" ) &
( CUDA_VISIBLE_DEVICES=0 timeout -k 5 95 python3 -m pytest -q -p no:cacheprovider -m gpu tests/integrations/test_grpo_lowmem.py tests/optim/test_gpu.py \
    --junitxml $R/gpu_tests.xml > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -1 $R/gpu_tests.log ) &
wait
echo "phase 1 done at $(($(date +%s) - T0))s"
for f in $R/sft_fsdp2/*.json; do [ -f "$f" ] && { echo "== $f"; head -c 1500 $f; echo; }; done
grep -q Traceback $R/sft_fsdp2.log && grep -m1 -A40 "Traceback (most recent call last)" $R/sft_fsdp2.log | tail -20
(
  export CUDA_VISIBLE_DEVICES=0
  pin 0-15 timeout -k 5 340 python3 benchmarks/optimizer/run.py --out $R/optimizer --rounds 1 --interleave 24 --only torch_adamw \
    rf_pipeline_off rf_pipeline_on rf_verify_only rf_pipeline_rollback torch_adamw_ckpt rf_pipeline_ckpt torch_adamw_accum \
    rf_pipeline_on_accum rf_verify_accum rf_rollback_accum bnb_adamw8bit rf_adamw8bit_pipeline > $R/optimizer.log 2>&1
  echo "optimizer rc=$?"
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  TRL112_PATH=/tmp/site112 pin 16-31 timeout -k 5 340 python3 benchmarks/ppo_vs_trl/run.py --out $R/trl7b --part size7b \
    --only s7_trl --size-timeout 160 > $R/trl7b.log 2>&1
  echo "trl7b rc=$?"
) > $R/lane1.txt 2>&1 &
wait
cat $R/lane0.txt $R/lane1.txt
grep -A20 "^variant" $R/optimizer.log | cut -c1-160
grep -A16 "^interleaved" $R/optimizer.log | cut -c1-160
grep -h '"name": "s7_' $R/trl7b.log | cut -c1-400
tar czf $OUT/s4call1.tgz --exclude='*.safetensors' --exclude='model' -C $R . 2>/dev/null; ls -la $OUT
echo "total $(($(date +%s) - T0))s"
