#!/usr/bin/env bash
# One device call of benchmarks/presets on the H200 (run from the repository root with .whl/ and
# .whl-trl112/ carried; ../shared/gpu/wheels.sh trl112 fetches them):
#   bash benchmarks/presets/h200.sh OUT b64     # 1.1B, batch 64, separate value: stock, none, every config
#   bash benchmarks/presets/h200.sh OUT b256    # 1.1B, batch 256, fused value + Liger + compile
#   bash benchmarks/presets/h200.sh OUT b256p1  # the same: none, conservative, aggressive, stock (not run yet)
#   bash benchmarks/presets/h200.sh OUT b256p2  # the same: none, advanced.yaml, the snippet, balanced (not run yet)
#   bash benchmarks/presets/h200.sh OUT b8      # 1.1B, batch 8, separate value (B8_ROWS, B8_UPDATES, B8_TIMEOUT)
#   bash benchmarks/presets/h200.sh OUT release8  # batch 8: no config and balanced under the release default
#                                               # (pressure) and the previous one (+alwaysrelease), stock,
#                                               # aggressive; the last update of each of ours profiled
#   bash benchmarks/presets/h200.sh OUT b8prof  # batch 8: none and three presets, one update each profiled
#   bash benchmarks/presets/h200.sh OUT clip64  # 1.1B, batch 64: balanced with the clip_prediction default
#                                               # (exact) against the previous one (scale), no config, stock
#   bash benchmarks/presets/h200.sh OUT full7b  # 7B full fine-tuning, 7B reward model: stock b4, ours b160
#   bash benchmarks/presets/h200.sh OUT lora7b  # 7B LoRA, 7B reward model: stock b64, ours b256
#     (full7b / lora7b: ROWS_7B and UPDATES_7B pick rows and updates; three rows of ~200 s do not fit one
#     600 s call, e.g. ROWS_7B=aggressive,handtuned UPDATES_7B=3 in one call and the stock row in the next;
#     BATCH_7B sets full7b's rollout batch, a row name may end in +sdpa / +tattn: the decode attention, or
#     +freecache: rollout_cache="auto", e.g. ROWS_7B=aggressive,aggressive+freecache,trl, not run yet)
#   bash benchmarks/presets/h200.sh OUT pipe64  # 1.1B, batch 64: the gradient pipeline on/off at 1, 4, 8
#                                               # accumulation steps (balanced, planner off), stock
#   bash benchmarks/presets/h200.sh OUT pipe7b  # 7B full fine-tuning, 7B reward model, batch 32: the same
#                                               # six pipeline rows (a call of its own; no stock row)
set -u
OUT=${1:?output folder}; shift
PY=${PYTHON:-python3}  # reproduce_h200.sh's PYTHON (its tests record the commands instead of running them)
if [ -d .whl ]; then  # the carried wheels (a machine without internet)
  source benchmarks/common/gpu_env.sh  # also installs .whl-trl112 (TRL112_PATH)
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
for part in "$@"; do
  case "$part" in
    b64) $PY benchmarks/presets/run.py --out "$OUT/b64" --batch 64 --timeout 120 \
           --rows none,balanced,aggressive,advanced,snippet,conservative,aggressive-noplan,trl ;;
    b256) $PY benchmarks/presets/run.py --out "$OUT/b256" --batch 256 --value-mode fused --liger --compile \
           --timeout 150 --rows none,balanced,balancedscale,trl ;;
    b256p1|b256p2)  # issue 27's batch-256 target for every preset: four rows of ~130 s per call, no config in both
      rows=$([ "$part" = b256p1 ] && echo none,conservative,aggressive,trl || echo none,advanced,snippet,balanced)
      $PY benchmarks/presets/run.py --out "$OUT/$part" --batch 256 --value-mode fused --liger --compile \
           --timeout 140 --rows "$rows" ;;
    clip64) $PY benchmarks/presets/run.py --out "$OUT/clip64" --batch 64 --timeout 120 \
           --rows none,balanced,balancedscale,trl ;;
    full7b) $PY benchmarks/presets/run.py --out "$OUT/full7b" --shape llama-7b --reward model --batch ${BATCH_7B:-160} \
           --value-mode fused --trl-batch 4 --timeout ${TIMEOUT_7B:-240} --hand-optimizer adamw8bit --hand-gen-chunk 80 \
           --updates ${UPDATES_7B:-4} --rows ${ROWS_7B:-aggressive,handtuned,trl} ;;
    lora7b) $PY benchmarks/presets/run.py --out "$OUT/lora7b" --shape llama-7b --reward model --batch 256 \
           --peft --value-mode fused --trl-batch 64 --timeout 240 --updates ${UPDATES_7B:-4} \
           --rows ${ROWS_7B:-aggressive,handtuned,trl} ;;
    pipe64) $PY benchmarks/presets/run.py --out "$OUT/pipe64" --batch 64 --timeout 100 \
           --rows pipeline-a1,nopipeline-a1,pipeline-a4,nopipeline-a4,pipeline-a8,nopipeline-a8,trl ;;
    pipe7b) $PY benchmarks/presets/run.py --out "$OUT/pipe7b" --shape llama-7b --reward model --batch 32 \
           --value-mode fused --timeout 150 --updates 3 \
           --rows pipeline-a1,nopipeline-a1,pipeline-a4,nopipeline-a4,pipeline-a8,nopipeline-a8 ;;
    b8) $PY benchmarks/presets/run.py --out "$OUT/b8" --batch 8 --timeout ${B8_TIMEOUT:-120} --updates ${B8_UPDATES:-4} \
           --rows ${B8_ROWS:-none,balanced,aggressive,conservative,advanced,snippet,trl} ;;
    release8) $PY benchmarks/presets/run.py --out "$OUT/release8" --batch 8 --timeout 210 --updates 7 \
           --profile-update 6 --rows none,none+alwaysrelease,trl,balanced,balanced+alwaysrelease,aggressive ;;
    b8prof) $PY benchmarks/presets/run.py --out "$OUT/b8prof" --batch 8 --timeout 120 --updates 5 \
           --profile-update 4 --rows none,conservative,balanced,aggressive ;;  # where the presets' cost goes
    *) echo "unknown part $part (b64, b256, b256p1, b256p2, b8, b8prof, release8, clip64, full7b, lora7b, pipe64, pipe7b)"; exit 2 ;;
  esac
done
