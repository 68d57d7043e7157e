#!/usr/bin/env bash
# The largest PPO model per engine: Llama-2-7B-shaped policy + separate value model, full fine-tuning,
# bf16, under ZeRO-3 and FSDP2 on 2 GPUs against one GPU; peak memory per GPU, OOM rows, tokens/s.
#
#   benchmarks/distributed/largest_model.sh OUT_DIR            # GPUs: ZeRO-3 x2, FSDP2 x2, 1 GPU, 1 GPU + RapidFireOptimizer
#   benchmarks/distributed/largest_model.sh OUT_DIR --smoke    # CPU: 2 gloo processes and 1 process, smoke shape
#   SET=bf16 benchmarks/distributed/largest_model.sh OUT_DIR [--smoke]   # a model 2 GPUs train and 1 does not
#
# SET=bf16 (benchmarks/distributed/gpu_largest2.sh runs it): pure bf16 on both sides (weights, fused
# value head, gradients, AdamW state; ppo_throughput.py --precision bf16, accelerate's mixed precision
# off so that FSDP2 keeps bf16 shards instead of fp32 masters), fused value head, frozen reference copy:
#   1. FSDP2 x2, llama-15b (15.5B): per GPU 29 GiB reference (PPOTrainer's own copy, not sharded) +
#      14.5 weight shard + 29 AdamW moments + 14.5 gradient shard (training) or 29 unsharded policy
#      (rollout, scoring) + 14.5 AdamW foreach temporary (the step): ~100-105 GiB peak of 139.8
#   2. 1 GPU, llama-15b, the same run: 29 reference + 29 weights + 29 gradients + 58 AdamW = 145 GiB
#      > 139.8: out of memory at the first AdamW step (train, update 1)  } at once, one GPU each
#   3. 1 GPU, llama-7b, the same run: ~75 GiB (12 bytes/param), what one GPU trains  }
#   4. ZeRO-3 x2, llama-7b, separate value model, bf16 mixed precision: the run of the default set
#      (scoring now gathers only the value model: ~126 GiB expected)
# --smoke stands in on the CPU: FSDP2 x2 through accelerate (ppo_throughput.py --cpu-fsdp2), two
# single processes at once, DDP x2 for ZeRO-3.
#
# Every run is one ppo_throughput.py call with its own time limit (cut to what BUDGET_S has left; default
# 300 s in all; a run is skipped when less than its minimum is left) and a --deadline 12 s shorter, so
# that each rank writes its row (ok / oom / error / timeout, phase, peak GiB) before the limit strikes.
# steps.jsonl gets one line per run; largest_report.py then writes largest_model.json and .png.
#
# Batch: 4 prompts per GPU (2 x 2 accumulation), 128 prompt + 64 response tokens, 2 PPO updates (the
# second one is timed), a weightless rule reward (no third 7B model), HF generate, no OOM splitting.
# OPT=rapidfire|adamw picks the optimizer of the first three runs (default adamw: PPOTrainer's torch
# AdamW; under ZeRO-3 / FSDP2 RapidFireOptimizer's pipeline falls back to a plain step anyway, and its
# rollback snapshot would add a copy of the weights); the last run repeats one GPU with
# RapidFireOptimizer(gradient_pipeline=True, rollback="auto"). SKIP="name ..." leaves runs out.
set -u
OUT=${1:?usage: largest_model.sh OUT_DIR [--smoke]}
MODE=${2:-gpu}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT/src:$ROOT:${PYTHONPATH:-}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
BUDGET_S=${BUDGET_S:-300}
OPT=${OPT:-adamw}
SET=${SET:-7b}
case $SET in 7b|bf16) ;; *) echo "SET=$SET: use 7b or bf16" >&2; exit 2 ;; esac
START=$(date +%s)
: > "$OUT/steps.jsonl"

# Ranks still alive after a step (a launcher killed before it could stop its workers, which run in
# sessions of their own) would hold GPU memory into the next run: end them by the pids they wrote.
leftovers() {
    local name=$1 pid alive=""
    for f in "$OUT/$name.ranks"/pid*; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        kill -0 "$pid" 2> /dev/null && alive="$alive $pid"
    done
    [ -z "$alive" ] && return 0
    echo "    ranks still running after the step:$alive (ending them)"
    for pid in $alive; do kill "$pid" 2> /dev/null; done
    sleep 5
    for pid in $alive; do kill -9 "$pid" 2> /dev/null; done
    sleep 2
}

# run NAME LIMIT_S MIN_S CMD...: ppo_throughput.py via CMD with --out OUT/NAME.json and a deadline;
# skipped when less than MIN_S seconds of the budget are left
run() {
    local name=$1 limit=$2 min=$3; shift 3
    case " ${SKIP:-} " in *" $name "*)
        echo "{\"name\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": \"SKIP\"}" >> "$OUT/steps.jsonl"
        return 0 ;;
    esac
    local left=$((BUDGET_S - ($(date +%s) - START)))
    if [ "$left" -lt "$min" ]; then
        echo "=== $name skipped: ${left}s of the budget left, needs ${min}s"
        echo "{\"name\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": \"time budget spent\"}" >> "$OUT/steps.jsonl"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local deadline=$((limit - 12))
    echo "=== $name (limit ${limit}s)"
    local t0=$(date +%s)
    timeout --kill-after=20 "$limit" "$@" --out "$OUT/$name.json" --deadline "$deadline" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "{\"name\": \"$name\", \"rc\": $rc, \"seconds\": $(($(date +%s) - t0)), \"limit\": $limit}" >> "$OUT/steps.jsonl"
    echo "    rc=$rc in $(($(date +%s) - t0))s  (log: $OUT/$name.log)"
    grep -h '"status"' "$OUT/$name.ranks"/rank*.json 2> /dev/null | tr -d ' \n'; echo
    leftovers "$name"
}

# gpu I CMD...: CMD with only GPU I visible (the one-GPU runs of SET=bf16 run at once, one GPU each)
gpu() {
    local i=$1; shift
    CUDA_VISIBLE_DEVICES=$i "$@"
}

CFG=accelerate_configs
PPO=benchmarks/distributed/ppo_throughput.py
PURE="--value-mode fused --precision bf16 --optimizer adamw"
if [ "$SET" = "bf16" ] && [ "$MODE" = "--smoke" ]; then
    export OMP_NUM_THREADS=1
    SIZE="--tiny --reward rule --per-device-batch 2 --accumulation 2 --prompt-length 8 --response-length 8 --updates 2"
    SIZE="$SIZE --rollout-backend hf --max-oom-splits 0"
    run fsdp2_fused_bf16 150 20 accelerate launch --mixed_precision no --main_process_port 29821 \
        --config_file $CFG/fsdp2.yaml $PPO $SIZE --shape smoke $PURE --cpu-fsdp2
    run single_fused_bf16 120 20 python3 $PPO $SIZE --shape smoke $PURE &
    run single_fused_bf16_tiny 120 20 python3 $PPO $SIZE --shape llama-tiny $PURE &
    wait
    run ddp2_separate 120 20 python3 -m torch.distributed.run --standalone --nproc_per_node 2 $PPO $SIZE \
        --shape smoke --value-mode separate --optimizer "$OPT"
elif [ "$SET" = "bf16" ]; then
    export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
    SIZE="--reward rule --per-device-batch 2 --accumulation 2 --prompt-length 128 --response-length 64 --updates 2"
    SIZE="$SIZE --rollout-backend hf --max-oom-splits 0"
    # 1. FSDP2 on 2 GPUs, 15.5B, pure bf16 (--mixed_precision no: the launcher's environment agrees)
    run fsdp2_fused_15b 130 80 accelerate launch --mixed_precision no --main_process_port 29821 \
        --config_file $CFG/fsdp2.yaml $PPO $SIZE --shape llama-15b $PURE
    # 2.+3. one GPU each, at once: the same 15.5B run (an OOM row is the result) and the 7B one. Plain
    # python3: single_gpu.yaml's gpu_ids would put both on GPU 0
    gpu 0 run single_fused_15b 80 40 python3 $PPO $SIZE --shape llama-15b $PURE &
    gpu 1 run single_fused_7b 80 40 python3 $PPO $SIZE --shape llama-7b $PURE &
    wait
    # 4. ZeRO-3 on 2 GPUs, the default set's 7B run again
    run zero3_separate 130 70 accelerate launch --main_process_port 29811 \
        --config_file $CFG/deepspeed_zero3.yaml $PPO $SIZE --shape llama-7b --value-mode separate --optimizer "$OPT"
elif [ "$MODE" = "--smoke" ]; then
    export OMP_NUM_THREADS=1
    TWO="python3 -m torch.distributed.run --standalone --nproc_per_node 2 $PPO"
    ONE="python3 $PPO"
    SIZE="--tiny --shape smoke --reward rule --per-device-batch 2 --accumulation 2 --prompt-length 8 --response-length 8 --updates 2"
    SIZE="$SIZE --rollout-backend hf --max-oom-splits 0"
    run ddp2_separate 120 20 $TWO $SIZE --value-mode separate --optimizer "$OPT"
    run single_fused_rapidfire 120 20 $ONE $SIZE --value-mode fused --optimizer rapidfire
else
    # what PPOTrainer's memory callback switches on at run time, from the first allocation (the 7B build) on
    export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
    # HF generate everywhere (the sharded engines need it; on one GPU it spares compiling a 7B decode
    # step) and no OOM splitting, so that a batch that does not fit is an OOM row
    SIZE="--shape llama-7b --reward rule --per-device-batch 2 --accumulation 2 --prompt-length 128 --response-length 64 --updates 2"
    SIZE="$SIZE --rollout-backend hf --max-oom-splits 0"
    launch() { echo "accelerate launch --main_process_port $1 --config_file $CFG/$2.yaml $PPO"; }
    # 1. ZeRO-3 on 2 GPUs: weights, gradients and optimizer state sharded; rollout gathers once (hf backend)
    run zero3_separate 130 70 $(launch 29811 deepspeed_zero3) $SIZE --value-mode separate --optimizer "$OPT"
    # 2. FSDP2 on 2 GPUs (accelerate keeps fp32 master weights in the shards)
    run fsdp2_separate 120 70 $(launch 29813 fsdp2) $SIZE --value-mode separate --optimizer "$OPT"
    # 3. one GPU, the same run: what the sharded engines are measured against
    run single_separate 80 45 $(launch 29812 single_gpu) $SIZE --value-mode separate --optimizer "$OPT"
    # 4. one GPU with RapidFireOptimizer (gradient pipeline + rollback snapshot), as the earlier 1-GPU runs
    run single_separate_rapidfire 70 45 $(launch 29814 single_gpu) $SIZE --value-mode separate --optimizer rapidfire
fi
python3 benchmarks/distributed/largest_report.py "$OUT"
echo "total $(($(date +%s) - START))s; results: $OUT/largest_model.json"
