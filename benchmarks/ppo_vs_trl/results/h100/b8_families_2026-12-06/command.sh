#!/usr/bin/env bash
# One H100 call: PPO batch 8, ours (main) vs ours (e0ac75f, .prev) alternating, and PPO batch 8 on the
# Gemma-3-1B and OLMo-2-1B shapes, ours vs stock TRL 1.12. Rows past 430 s of the call are skipped.
set -u
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a $OUT/gpu.txt
git log -1 --format=%H 2>/dev/null | tee -a $OUT/gpu.txt; date -u | tee -a $OUT/gpu.txt
T0=$SECONDS
row() {  # row NAME DIR(. or .prev) ARGS...
  local name=$1 dir=$2; shift 2
  if (( SECONDS - T0 > 430 )); then echo "$name skipped (time)"; return; fi
  ( cd $dir && PYTHONPATH=$PWD/src:$PWD:/tmp/site timeout 150 python3 benchmarks/ppo_vs_trl/run.py --out $OUT/$name \
      --part throughput --timeout 130 --fused-batches "" "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?" )
}
row main1 . --updates 3 --trl-batches "" --our-batches 8
row prev1 .prev --updates 3 --trl-batches "" --our-batches 8
row gemma3_ours . --shape gemma3-1b --updates 3 --trl-batches "" --our-batches 8
row gemma3_trl . --shape gemma3-1b --updates 3 --trl-batches 8 --our-batches ""
row main2 . --updates 3 --trl-batches "" --our-batches 8
row prev2 .prev --updates 3 --trl-batches "" --our-batches 8
row olmo2_ours . --shape olmo2-1b --updates 3 --trl-batches "" --our-batches 8
row olmo2_trl . --shape olmo2-1b --updates 3 --trl-batches 8 --our-batches ""
for n in main1 prev1 gemma3_ours gemma3_trl olmo2_ours olmo2_trl main2 prev2; do
  python3 - "$OUT/$n/results.json" "$n" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as e:
    print(sys.argv[2], "no results", type(e).__name__); sys.exit()
for x in rows:
    print(sys.argv[2], x.get("status"), x.get("system"), x.get("backend") or x.get("rollout_backend"),
          "s/update", x.get("s_per_update"), "tok/s", x.get("tokens_per_s"), "score_s", x.get("score_s"), x.get("error", "")[:200])
PY
done
