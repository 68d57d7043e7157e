#!/usr/bin/env bash
# One device call of benchmarks/sweep on the H200 (run from the repository root with .whl/ and .whl-trl112/
# carried; ../shared/gpu/wheels.sh trl112 fetches them):
#   bash benchmarks/sweep/h200.sh OUT          # 1.1B, 8 trials (kl_coef 0.01/0.1 x lr 3e-5..1e-3), U = 12 (~8 min)
#   bash benchmarks/sweep/h200.sh OUT 7b       # 7B, 4 trials (kl_coef 0.01/0.1 x lr 1e-4/1e-3), U = 8 (a call of its own)
#   bash benchmarks/sweep/h200.sh OUT bounded  # training forwards of 8 rows: 8 trials' peak and speed against PPOTrainer
#   bash benchmarks/sweep/h200.sh OUT packing  # the same at 16 and 32 rows (TRAIN_ROWS), PPOTrainer once;
#     SWEEP_PLANS="on off" adds all trials with the sweep's throughput plan and with the fixed rule it replaced
# The parts run in order of what the targets need most (halving, stock TRL, ours one after another, all
# trials without halving), each with its own timeout and all within --budget-s; results.json is rewritten
# after every part, so a part cut by its timeout leaves the others (and what it measured itself).
set -u
OUT=${1:?output folder}
PART=${2:-1b}
PY=${PYTHON:-python3}  # reproduce_h200.sh's PYTHON (its tests record the commands instead of running them)
if [ -d .whl ]; then  # the carried wheels (a machine without internet)
  source benchmarks/common/gpu_env.sh  # also installs .whl-trl112 (TRL112_PATH)
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
case "$PART" in
  1b) $PY benchmarks/sweep/run.py --out "$OUT" --updates 12 --rungs 4,8 --keep 0.5 --all-updates 4 --trl-updates 3 \
        --parts sweep_halving,trl,sequential_ours,sweep_all \
        --timeouts sweep_halving=200,trl=80,sequential_ours=260,sweep_all=130 --budget-s 450 ;;
  7b) $PY benchmarks/sweep/run.py --out "$OUT" --shape llama-7b --kl 0.01,0.1 --lr 1e-4,1e-3 --updates 8 --rungs 2,4 \
        --all-updates 3 --trl-updates 2 --parts sweep_halving,trl,sequential_ours,sweep_all \
        --timeouts sweep_halving=200,trl=100,sequential_ours=240,sweep_all=120 --budget-s 450 ;;
  routing)  # the halving sweep with the block route and with the index route (sweep/lora.py), one call
    for r in blocks index; do
      $PY benchmarks/sweep/run.py --out "$OUT/$r" --updates 12 --rungs 4,8 --keep 0.5 --parts sweep_halving \
        --decode-routing $r --timeouts sweep_halving=250 --budget-s 260
    done ;;
  bounded)  # memory: training forwards bounded to one micro-batch of rows, against one trial's peak
    $PY benchmarks/sweep/run.py --out "$OUT" --updates 6 --rungs 2,4 --all-updates 4 --seq-updates 3 --train-rows 8 \
      --decode-routing index --parts sweep_all,sequential_ours --timeouts sweep_all=200,sequential_ours=220 \
      --budget-s 440 ;;
  packing)  # the packing between bounded (8 rows) and the default (64 rows at 256 tokens): all trials, no
    # halving, one folder per row count (TRAIN_ROWS), then PPOTrainer one trial after another (~5 min)
    for rows in ${TRAIN_ROWS:-16 32}; do
      $PY benchmarks/sweep/run.py --out "$OUT/rows$rows" --updates 6 --rungs 2,4 --all-updates 4 --train-rows "$rows" \
        --decode-routing index --parts sweep_all --timeouts sweep_all=120 --budget-s 130
    done
    for plan in ${SWEEP_PLANS:-}; do  # e.g. SWEEP_PLANS="on off": the sweep's plan against the fixed rule
      $PY benchmarks/sweep/run.py --out "$OUT/plan_$plan" --updates 6 --rungs 2,4 --all-updates 4 --sweep-plan "$plan" \
        --decode-routing index --parts sweep_all --timeouts sweep_all=120 --budget-s 130
    done
    $PY benchmarks/sweep/run.py --out "$OUT/sequential" --updates 6 --rungs 2,4 --seq-updates 3 \
      --parts sequential_ours --timeouts sequential_ours=110 --budget-s 120 ;;
  *) echo "unknown part $PART (1b, 7b, routing, bounded, packing)"; exit 2 ;;
esac
