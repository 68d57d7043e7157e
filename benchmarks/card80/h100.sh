#!/usr/bin/env bash
# One device call of benchmarks/card80 on one 80 GB card (run from the repository root with .whl/ carried;
# ../shared/gpu/wheels.sh fetches it). One row per call keeps each under 9 minutes:
#   bash benchmarks/card80/h100.sh OUT full7b   # 7B full fine-tuning, batch 160 (~5 min)
#   bash benchmarks/card80/h100.sh OUT lora7b   # 7B LoRA, batch 256 (~5 min)
#   bash benchmarks/card80/h100.sh OUT full7b_trades  # full7b without and with host offload, 3 updates each
#                                                     # (~2 x 3.5 min; each row its own worker process)
#   bash benchmarks/card80/h100.sh OUT lora7b_kv      # lora7b_modelkv and lora7b_int8kv (the KV cache in the
#                                                     # model's dtype, then in int8)
#   bash benchmarks/card80/h100.sh OUT full7b_kv      # full7b_modelkv and full7b_int8kv, 3 updates each
#   bash benchmarks/card80/h100.sh OUT lora7b_fuse    # lora7b_offload and lora7b_fuselora (LoRA layers in
#                                                     # the fused decode projections), 3 updates each
#   bash benchmarks/card80/h100.sh OUT full7b_frozen  # full7b_offload and full7b_frozen8 (the frozen reference
#                                                     # and reward models in 8-bit), 3 updates each
#   bash benchmarks/card80/h100.sh OUT liger          # lora7b_offload and lora7b_liger, then full7b_offload and
#                                                     # full7b_liger (use_liger_kernel=True), 3 updates each
# UPDATES_80 (default 4) sets the updates of a row; the first is the warm-up. CAP_GIB=79.19 caps a bigger
# card to an H100 80 GB's memory (the allocator refuses past it; speed stays the bigger card's).
set -u
OUT=${1:?output folder}; shift
PY=${PYTHON:-python3}
if [ -d .whl ]; then  # the carried wheels (a machine without internet)
  source benchmarks/common/gpu_env.sh
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
for part in "$@"; do
  case "$part" in
    full7b|lora7b|lora7b_offload|lora7b_off|lora7b_int8kv|full7b_int8kv|lora7b_modelkv|full7b_modelkv) $PY benchmarks/card80/run.py --out "$OUT/$part" --rows "$part" --updates ${UPDATES_80:-4} ${CAP_GIB:+--cap-gib $CAP_GIB} \
                     --timeout 500 ;;
    full7b_trades) $PY benchmarks/card80/run.py --out "$OUT/$part" --rows full7b_off,full7b_offload \
                     --updates ${UPDATES_80:-3} --timeout 265 ${CAP_GIB:+--cap-gib $CAP_GIB} ;;
    lora7b_kv|full7b_kv) base=${part%_kv}
                 $PY benchmarks/card80/run.py --out "$OUT/$part" --rows ${base}_modelkv,${base}_int8kv \
                     --updates ${UPDATES_80:-3} --timeout 265 ${CAP_GIB:+--cap-gib $CAP_GIB} ;;
    lora7b_fuse) $PY benchmarks/card80/run.py --out "$OUT/$part" --rows lora7b_offload,lora7b_fuselora \
                     --updates ${UPDATES_80:-3} --timeout 265 ${CAP_GIB:+--cap-gib $CAP_GIB} ;;
    full7b_frozen) $PY benchmarks/card80/run.py --out "$OUT/$part" --rows full7b_offload,full7b_frozen8 \
                     --updates ${UPDATES_80:-3} --timeout 265 ${CAP_GIB:+--cap-gib $CAP_GIB} ;;
    liger) for base in lora7b full7b; do
             $PY benchmarks/card80/run.py --out "$OUT/${base}_liger" --rows ${base}_offload,${base}_liger \
                 --updates ${UPDATES_80:-3} --timeout 265 ${CAP_GIB:+--cap-gib $CAP_GIB}
           done ;;
    *) echo "unknown part $part (full7b, lora7b, full7b_trades, lora7b_kv, full7b_kv, lora7b_fuse, full7b_frozen, liger)"; exit 2 ;;
  esac
done
