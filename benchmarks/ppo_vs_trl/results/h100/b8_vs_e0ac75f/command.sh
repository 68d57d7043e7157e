#!/usr/bin/env bash
# session call 1: PPO 1.1B b8 same call (main, e0ac75f, stock TRL 1.12), then the families GPU tests
set -u
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, transformers, trl; print(torch.__version__, transformers.__version__, trl.__version__)" | tee -a $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
PY=python3
B8="--part throughput --updates 4 --timeout 140 --fused-batches \"\""
# ours (main), ours (e0ac75f), stock, ours (main) again: the two main rows bracket the others
timeout 170 $PY benchmarks/ppo_vs_trl/run.py --out $OUT/b8_main --part throughput --updates 4 --timeout 140 --trl-batches "" --our-batches 8 --fused-batches "" > $OUT/b8_main.log 2>&1; echo "main rc=$?"
( cd .prev && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 170 $PY benchmarks/ppo_vs_trl/run.py --out $OUT/b8_prev --part throughput --updates 4 --timeout 140 --trl-batches "" --our-batches 8 --fused-batches "" > $OUT/b8_prev.log 2>&1; echo "prev rc=$?" )
timeout 170 $PY benchmarks/ppo_vs_trl/run.py --out $OUT/b8_trl --part throughput --updates 4 --timeout 140 --trl-batches 8 --our-batches "" --fused-batches "" > $OUT/b8_trl.log 2>&1; echo "trl rc=$?"
grep -h "s/update\|tokens/s\|tok/s" $OUT/b8_*.log | tail -20
for d in b8_main b8_prev b8_trl; do python3 - "$OUT/$d/results.json" <<'PY'
import json,sys
try:
    r=json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[1], "no results", e); sys.exit()
rows = r.get("rows") or r.get("results") or r
for x in (rows if isinstance(rows, list) else rows.values() if isinstance(rows, dict) else []):
    if isinstance(x, dict):
        print(sys.argv[1].split("/")[-2], {k: x.get(k) for k in ("name","status","s_per_update","tokens_per_s","peak_gib","gen_share","rollout_backend")})
PY
done
timeout 240 $PY -m pytest -q -rf -p no:cacheprovider tests/rollout/test_families_gpu.py -k "gemma2 or qwen3_moe or mixtral" tests/rollout/test_generic_gpu.py tests/rollout/test_moe_decode.py > $OUT/tests.log 2>&1; echo "tests rc=$?"
tail -40 $OUT/tests.log
