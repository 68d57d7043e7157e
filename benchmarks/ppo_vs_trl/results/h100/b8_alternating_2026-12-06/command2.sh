#!/usr/bin/env bash
# One device call (~330 s): PPO 1.1B batch 8, main then e0ac75f (.prev), 3 updates a row; then 7B LoRA batch
# 256 with the int8 KV cache on an 80 GB card (benchmarks/card80, 2 updates: warm-up + 1 timed).
set -u
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
T0=$SECONDS
CAP=""; total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
(( total > 90000 )) && CAP=79.19  # a bigger card: capped to an H100 80 GB's memory (speed stays the bigger card's)
row() {  # row NAME DIR(. or .prev)
  local name=$1 dir=$2
  if (( SECONDS - T0 > 150 )); then echo "$name skipped (time)"; return; fi
  ( cd $dir && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 100 python3 benchmarks/ppo_vs_trl/run.py --out $OUT/$name \
      --part throughput --timeout 90 --fused-batches "" --updates 3 --trl-batches "" --our-batches 8 \
      > $OUT/$name.log 2>&1; echo "$name rc=$? at $((SECONDS - T0)) s" )
}
row main1 .; row prev1 .prev
left=$(( 330 - (SECONDS - T0) )); (( left > 200 )) && left=200
UPDATES_80=2 CAP_GIB=$CAP timeout $left bash benchmarks/card80/h100.sh $OUT lora7b_int8kv > $OUT/lora_int8.log 2>&1
echo "lora rc=$? at $((SECONDS - T0)) s"; tail -6 $OUT/lora_int8.log
for n in main1 prev1; do
  python3 - "$OUT/$n/results.json" "$n" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as e:
    print(sys.argv[2], "no results", type(e).__name__); sys.exit()
for x in rows:
    print(sys.argv[2], x.get("status"), "s/update", x.get("s_per_update"), "tok/s", x.get("tokens_per_s"),
          "updates", x.get("update_times"), "score", x.get("score_times"), x.get("error", "")[:200])
PY
done
