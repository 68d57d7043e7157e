#!/usr/bin/env bash
# Issue 8 on 2 GPUs, one device call (< 540 s; every step has its own time limit):
#   part 2 (~90 s): SFTTrainer + enable_rapidfire (tests/distributed/scripts/sft_ranks.py) under DDP,
#          ZeRO-2, ZeRO-3 and FSDP2 at once (distinct ports); an engine that fails is run once more with a
#          static precision plan, which says whether adaptive precision was what broke
#   part 1 (~300 s): the largest PPO model per engine (benchmarks/distributed/largest_model.sh): Llama-7B
#          shape, separate value model, full fine-tuning under ZeRO-3 and FSDP2 on 2 GPUs and on 1 GPU
#   then the reports; $OUT/issue8.tgz holds everything, $OUT/issue8_summary.txt the verdicts.
# Needs the wheels in .whl (trl, datasets, ...) and .whl-ds (deepspeed and its dependencies).
set -u
T0=$(date +%s)
TOTAL_S=${TOTAL_S:-540}
OUT=${OUT:?set OUT to the folder that comes back}
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
R=/tmp/issue8; rm -rf $R; mkdir -p $R/sft $R/largest
elapsed() { echo $(($(date +%s) - T0)); }
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv > $R/gpus.txt 2>&1
python3 -c "import torch, transformers, accelerate, trl, deepspeed; print(torch.__version__, transformers.__version__, accelerate.__version__, trl.__version__, deepspeed.__version__)" > $R/versions.txt 2>&1
echo "setup done at $(elapsed)s: $(tail -1 $R/versions.txt)"

# pack: $OUT/issue8_summary.txt (the verdicts) and $OUT/issue8.tgz (everything, bar weights); called after
# part 2 already, so that its results come back even if the call is cut short later
pack() {
python3 - > $OUT/issue8_summary.txt 2>&1 <<'PY'
import json, pathlib
R = pathlib.Path("/tmp/issue8")
print("== versions:", (R / "versions.txt").read_text().strip().splitlines()[-1])
print("== part 2: SFTTrainer + enable_rapidfire, 4 steps, tiny Llama, 2 GPUs")
try:
    runs = json.loads((R / "sft/sft_engines.json").read_text())["runs"]
except Exception as e:
    runs = {}
    print("   no sft_engines.json:", e)
for name, r in runs.items():
    line = f"   {name:14s} rc={r.get('rc')} {r['status']:7s} engine={r.get('engine')} losses={r.get('losses')}"
    line += f" finite={r.get('params_finite')} equal_ranks={r.get('params_equal_across_ranks')}"
    if r["status"] != "ok":
        line += f"\n      failed in {r.get('failed_phase')}: {(r.get('error') or '')[:300]}"
    print(line)
import sys
sys.path.insert(0, "benchmarks/distributed")
try:
    from report import smoke_result
    ppo = smoke_result(R / "sft/ppo_zero3")
    print(f"   ppo_zero3 (tiny PPOTrainer smoke): finished={ppo.get('finished')} updates={ppo.get('updates')}"
          f" params_finite={ppo.get('params_finite')}")
except Exception as e:
    print("   ppo_zero3 (tiny PPOTrainer smoke): no result:", type(e).__name__, e)
print("== part 1: largest PPO model per engine")
try:
    for v in json.loads((R / "largest/largest_model.json").read_text())["verdicts"]:
        print("  ", v)
except Exception as e:
    print("   no largest_model.json:", e)
PY
tar czf $OUT/issue8.tgz -C /tmp --exclude='*.safetensors' --exclude='sft_rank*.pt' --exclude='tput_run' --exclude='run' issue8
}

# ---- part 2: enable_rapidfire under each engine -------------------------------------------------
# sft_wave LIMIT SUFFIX CONFIG ENGINE...: the engines at once, each on both GPUs with its own port
sft_wave() {
    local limit=$1 suffix=$2 config=$3; shift 3
    local port=29600
    for engine in "$@"; do
        case $engine in
            ddp) cfg=multi_gpu ;;
            zero2) cfg=deepspeed_zero2 ;;
            zero3) cfg=deepspeed_zero3 ;;
            fsdp2) cfg=fsdp2 ;;
        esac
        port=$((port + 11))
        local name=$engine$suffix
        (
            timeout -k 10 "$limit" accelerate launch --main_process_port $port --config_file accelerate_configs/$cfg.yaml \
                tests/distributed/scripts/sft_ranks.py $R/sft/sft_$name --device cuda --bf16 ${config:+--config "$config"} \
                > $R/sft/$name.log 2>&1
            echo "{\"run\": \"$name\", \"rc\": $?}" >> $R/sft/rc.jsonl
        ) &
    done
    wait
}
failed_engines() {  # engines of the last wave whose rank 0 did not report ok
    for engine in "$@"; do
        grep -q '"status": "ok"' $R/sft/sft_$engine/sft.json 2> /dev/null || echo $engine
    done
}
# beside them, the tiny PPO smoke under ZeRO-3 (weights gathered once per rollout): tells a ZeRO-3 failure
# of part 1 that is about the engine from one that is about the 7B size
(
    timeout -k 10 85 accelerate launch --main_process_port 29690 --config_file accelerate_configs/deepspeed_zero3.yaml \
        tests/distributed/scripts/ppo_ranks.py $R/sft/ppo_zero3 --device cuda --bf16 --gather --rollout-backend hf \
        > $R/sft/ppo_zero3.log 2>&1
    echo "{\"run\": \"ppo_zero3\", \"rc\": $?}" >> $R/sft/rc.jsonl
) &
sft_wave 85 "" "" ddp zero2 zero3 fsdp2  # its wait also waits for the PPO smoke
echo "part 2 wave 1 done at $(elapsed)s: $(tr -d '\n' < $R/sft/rc.jsonl)"
FAILED=$(failed_engines ddp zero2 zero3 fsdp2)
if [ -n "$FAILED" ] && [ "$(elapsed)" -lt 120 ]; then
    sft_wave 55 "_static" '{"precision": {"mode": "static"}}' $FAILED
    echo "part 2 wave 2 (static precision: $FAILED) done at $(elapsed)s"
fi
for f in $R/sft/sft_*/pid_rank*; do  # ranks a killed launcher left behind (they run in their own sessions)
    [ -f "$f" ] || continue
    pid=$(cat $f); kill -0 $pid 2> /dev/null && { echo "ending leftover rank $pid ($f)"; kill -9 $pid; }
done
python3 benchmarks/distributed/report.py --sft $R/sft > $R/sft/report.log 2>&1
for f in $R/sft/*.log; do  # the first rank-0 traceback of each failed launch, for a quick look
    grep -q "Traceback" $f && { echo "===== $(basename $f)"; grep -m1 -A60 "Traceback (most recent call last)" $f | tail -25; }
done > $R/sft/errors.txt

pack

# ---- part 1: the largest PPO model per engine ---------------------------------------------------
left=$((TOTAL_S - 45 - $(elapsed)))
[ $left -gt 320 ] && left=320
echo "part 1 with a budget of ${left}s (at $(elapsed)s)"
BUDGET_S=$left bash benchmarks/distributed/largest_model.sh $R/largest 2>&1 | tee $R/largest/driver.log

# ---- results --------------------------------------------------------------------------------------
pack
cat $OUT/issue8_summary.txt
echo "total $(elapsed)s"
