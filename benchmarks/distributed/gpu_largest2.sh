#!/usr/bin/env bash
# Issue 8, the largest PPO model per engine, second call: a model that 2 GPUs train and 1 GPU does not,
# under the same numerics, plus the ZeRO-3 7B row again. One device call on 2 H200s, < 420 s in all.
#
#   OUT=/folder/that/comes/back bash benchmarks/distributed/gpu_largest2.sh
#
# Runs `SET=bf16 benchmarks/distributed/largest_model.sh` (see there; each run has its own time limit
# and a deadline 12 s shorter, so that every rank writes its row, OOM included):
#   1. FSDP2 x2, llama-15b (15.5B), fused value head, pure bf16    ~70-90 s (limit 130), ~100-105 GiB/GPU
#   2. 1 GPU,    llama-15b, the same run: out of memory at the first AdamW step  } at once, ~40-50 s
#   3. 1 GPU,    llama-7b,  the same run: trains at ~75 GiB                      } (limit 80 each)
#   4. ZeRO-3 x2, llama-7b, separate value model, bf16 mixed precision  ~80-100 s (limit 130), ~126 GiB
# then largest_report.py. $OUT/largest2_summary.txt: verdicts and comparisons; $OUT/largest2.tgz: every
# row, log, largest_model.json and .png (/tmp/largest2 on the machine).
# Needs the wheels in .whl (trl, datasets, ...) and .whl-ds (deepspeed and its dependencies).
# SMOKE=1: the CPU stand-ins of the same set (largest_model.sh --smoke), no wheels, to check this script.
set -u
T0=$(date +%s)
TOTAL_S=${TOTAL_S:-410}
OUT=${OUT:?set OUT to the folder that comes back}
MODE=gpu
if [ -n "${SMOKE:-}" ]; then
    MODE=--smoke
else
    source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
fi
R=/tmp/largest2
rm -rf $R
mkdir -p $R
elapsed() { echo $(($(date +%s) - T0)); }
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv > $R/gpus.txt 2>&1
echo "setup done at $(elapsed)s"

# what is left after the setup, less 35 s: a run's kill-after (20 s), the leftover-rank sweep and the report
left=$((TOTAL_S - 35 - $(elapsed)))
[ $left -gt 360 ] && left=360
echo "runs with a budget of ${left}s"
SET=bf16 BUDGET_S=$left bash benchmarks/distributed/largest_model.sh $R $MODE 2>&1 | tee $R/driver.log

python3 - > $OUT/largest2_summary.txt 2>&1 <<'PY'
import json, pathlib
R = pathlib.Path("/tmp/largest2")
print((R / "gpus.txt").read_text().strip())
try:
    results = json.loads((R / "largest_model.json").read_text())
except Exception as e:
    print("no largest_model.json:", e)
else:
    print("== verdicts")
    for v in results["verdicts"]:
        print("  ", v)
    print("== comparisons (same model, value mode and precision)")
    for c in results["comparisons"]:
        print("  ", c)
    print("== per run: status, peak GiB per GPU, phase peaks of rank 0, dtypes, resident after prepare")
    for r in results["runs"]:
        phases = (r.get("phase_peak_gib") or [None])[0] or {}
        print(f"   {r['name']:18s} {r['status']:8s} rc={r.get('rc')} {r.get('seconds')}s"
              f" peaks={[round(p, 1) for p in r.get('peak_gib_per_rank') or [] if p is not None]}"
              f" phases={ {k: round(v, 1) for k, v in phases.items()} }"
              f" params={r.get('param_dtypes')} adam={r.get('optimizer_state_dtypes')}"
              f" resident={[round(x, 1) for x in r.get('resident_gib_after_prepare') or [] if x is not None]}")
        if r["status"] not in ("ok", "skipped"):
            print(f"      {(r.get('error') or '')[:300]}")
PY
tar czf $OUT/largest2.tgz -C /tmp --exclude='tput_run' largest2
cat $OUT/largest2_summary.txt
echo "total $(elapsed)s"
