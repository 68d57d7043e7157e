#!/usr/bin/env bash
# Two-GPU checks and benchmark of rapidfire_hf, or their CPU smoke version.
#
#   benchmarks/distributed/run.sh OUT_DIR            # 2 GPUs: NCCL tests, PPO smoke per engine, tokens/s 1 vs 2
#   benchmarks/distributed/run.sh OUT_DIR --smoke    # CPU, 2 gloo processes, tiny models
#
# Writes OUT_DIR/results.json and OUT_DIR/tokens_per_second.png (benchmarks/distributed/report.py).
# SKIP="name ..." leaves out the named steps. Every step has its own time limit and the whole run stops starting new steps after BUDGET_S
# seconds (default 450), so that it ends within 8 minutes even when a step hangs; a failed step is
# recorded in results.json and the next one runs.
set -u
OUT=${1:?usage: run.sh OUT_DIR [--smoke]}
MODE=${2:-gpu}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT/src:$ROOT:${PYTHONPATH:-}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
BUDGET_S=${BUDGET_S:-450}
START=$(date +%s)
: > "$OUT/steps.jsonl"

# step NAME LIMIT_S CMD...: run CMD with a time limit (cut to what the budget has left), log its result
step() {
    local name=$1 limit=$2; shift 2
    case " ${SKIP:-} " in *" $name "*)  # SKIP="nccl_tests tput_1": steps recorded by an earlier run
        echo "{\"name\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": \"SKIP\"}" >> "$OUT/steps.jsonl"
        return 0 ;;
    esac
    local left=$((BUDGET_S - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        echo "{\"name\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": \"time budget spent\"}" >> "$OUT/steps.jsonl"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s)"
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "{\"name\": \"$name\", \"rc\": $rc, \"seconds\": $(($(date +%s) - t0)), \"limit\": $limit}" >> "$OUT/steps.jsonl"
    echo "    rc=$rc in $(($(date +%s) - t0))s  (log: $OUT/$name.log)"
    [ $rc -ne 0 ] && tail -n 15 "$OUT/$name.log"
    return $rc
}

TORCHRUN="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
SCRIPTS=tests/distributed/scripts

if [ "$MODE" = "--smoke" ]; then
    export OMP_NUM_THREADS=1
    step optim_gloo 120 $TORCHRUN $SCRIPTS/optim_ranks.py "$OUT/optim" --only rollback,sync
    step smoke_ddp 120 $TORCHRUN $SCRIPTS/ppo_ranks.py "$OUT/smoke_ddp"
    TINY="--tiny --updates 2 --per-device-batch 2 --accumulation 2 --prompt-length 8 --response-length 8"
    step tput_1 120 python3 benchmarks/distributed/ppo_throughput.py --out "$OUT/tput_1.json" $TINY
    step tput_2 120 $TORCHRUN benchmarks/distributed/ppo_throughput.py --out "$OUT/tput_2.json" $TINY
else
    CFG=accelerate_configs
    # 1-3: DDP equivalence, cross-rank rollback and sync debug over NCCL (the same assertions as on CPU)
    step nccl_tests 120 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_ddp.py -k cuda \
        --junitxml "$OUT/nccl_tests.xml"
    # PPOTrainer smoke per engine (tiny model, bf16); sharded engines gather weights once per rollout
    # on failure, the same engine once more with plain AdamW and no weight gathering: says which part broke
    for engine in ddp zero2 zero3 fsdp2; do
        case $engine in
            ddp) cfg=multi_gpu; extra="" ;;
            zero2) cfg=deepspeed_zero2; extra="" ;;
            zero3) cfg=deepspeed_zero3; extra="--gather --rollout-backend hf" ;;
            fsdp2) cfg=fsdp2; extra="--gather --rollout-backend hf" ;;
        esac
        step smoke_$engine 75 accelerate launch --config_file $CFG/$cfg.yaml \
            $SCRIPTS/ppo_ranks.py "$OUT/smoke_$engine" --device cuda --bf16 $extra \
        || step smoke_${engine}_adamw 75 accelerate launch --config_file $CFG/$cfg.yaml \
            $SCRIPTS/ppo_ranks.py "$OUT/smoke_${engine}_adamw" --device cuda --bf16 --optimizer adamw --rollout-backend hf
    done
    # PPO tokens/s, 1.1B Llama shape, bf16, 128 prompt + 128 response tokens, 32 prompts per rank
    step tput_1 150 accelerate launch --config_file $CFG/single_gpu.yaml \
        benchmarks/distributed/ppo_throughput.py --out "$OUT/tput_1.json"
    step tput_2 150 accelerate launch --config_file $CFG/multi_gpu.yaml \
        benchmarks/distributed/ppo_throughput.py --out "$OUT/tput_2.json"
fi
python3 benchmarks/distributed/report.py "$OUT"
echo "total $(($(date +%s) - START))s; results: $OUT/results.json"
