#!/usr/bin/env bash
# Short 2-GPU call (what a small device budget allows): PPO tokens/s on 1 vs 2 GPUs (DDP), then the
# NCCL tests. Copies the summary files to $OUT (at most 8 files come back).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=$PYTHONPATH:/tmp/site
D=/tmp/dist; mkdir -p $D
timeout 75 accelerate launch --config_file accelerate_configs/single_gpu.yaml benchmarks/distributed/ppo_throughput.py --out $D/tput_1.json > $D/tput_1.log 2>&1; echo "tput_1 rc=$?"
timeout 75 accelerate launch --config_file accelerate_configs/multi_gpu.yaml benchmarks/distributed/ppo_throughput.py --out $D/tput_2.json > $D/tput_2.log 2>&1; echo "tput_2 rc=$?"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_ddp.py -k cuda > $D/nccl.log 2>&1; echo "nccl rc=$?"
cp $D/tput_1.json $D/tput_2.json $OUT/ 2>/dev/null
for f in tput_1 tput_2 nccl; do { echo "== $f"; tail -c 2000 $D/$f.log; } >> $OUT/logs.txt; done
python3 benchmarks/distributed/report.py $D > /dev/null 2>&1 && cp $D/results.json $D/*.png $OUT/ 2>/dev/null
tail -c 1500 $OUT/logs.txt
