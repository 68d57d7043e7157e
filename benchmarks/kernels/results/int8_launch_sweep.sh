#!/usr/bin/env bash
# Device call part (one GPU): the flash-decoding kernel over an int8 cache, 7B and 1.1B shapes, batch 128 / 256,
# 320 of 512 slots filled, one row per launch (BLOCKxWARPSxSTAGES), beside the bf16 kernel. bash THIS_FILE OUT
set -u
OUT=${1:?output folder}
timeout ${SWEEP_S:-150} python3 benchmarks/kernels/run.py --out $OUT --kernels attention,attention_int8 \
  --batches 128,256 --launches 64x4x3,64x4x2,64x8x3,128x4x3,128x8x3,128x8x4,32x4x3,32x2x4,256x8x3 \
  --warmup 5 --repeats 10 2>&1 | grep -o "'shape': '[^']*', 'batch': [0-9]*, 'impl': '[^']*', 'ms': [0-9.]*" | tail -40
