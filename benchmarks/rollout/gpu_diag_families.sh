#!/usr/bin/env bash
# Issue 45's gemma2 / mixtral GPU failures, one device call (run from the repository root on the GPU machine,
# .whl/ carried; < 150 s in all):
#   bash benchmarks/rollout/gpu_diag_families.sh "$OUT"
# in this order, each part under its own time limit (seconds, capped by what is left of TOTAL_S, default 145):
#   variants  benchmarks/rollout/gpu_diag_families.py: one line per variant (gemma2 fp32 with the reference on
#             eager / sdpa attention, TF32 off / on; gemma2 and mixtral bf16 argmax misses and excused ties;
#             mixtral fp32)                                                                ~20 s, cap 50
#   tests     the fixed GPU tests: tests/rollout/test_families_gpu.py -k "gemma2 or mixtral"  ~50 s, cap 85
# Writes variants.log, tests.log and parts.log under OUT.
set -u
PY=${PYTHON:-python3}
OUT=${1:-${OUT:?output folder: the first argument or \$OUT}}
mkdir -p "$OUT"
# the wheels once per call: a caller that sourced gpu_env.sh already has /tmp/site on PYTHONPATH
[[ ":${PYTHONPATH:-}:" == *":/tmp/site:"* ]] || source benchmarks/common/gpu_env.sh
TOTAL_S=${TOTAL_S:-145}
SECONDS=0

# run NAME CAP COMMAND...: COMMAND under `timeout`, at most CAP seconds and at most what is left of TOTAL_S
run() {
  local name=$1 cap=$2 left=$((TOTAL_S - SECONDS))
  shift 2
  ((cap > left)) && cap=$left
  if ((cap < 10)); then
    echo "== $name: skipped, ${left}s left of ${TOTAL_S}s" | tee -a "$OUT/parts.log"
    return 0
  fi
  echo "== $name (limit ${cap}s, at ${SECONDS}s)"
  local start=$SECONDS
  timeout -k 5 "$cap" "$@" </dev/null
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start))s$( ((rc == 124 || rc == 137)) && echo ' (time limit)')" |
    tee -a "$OUT/parts.log"
}

run variants 50 bash -o pipefail -c "$PY benchmarks/rollout/gpu_diag_families.py --device cuda 2>&1 |
  grep -v -e Warning -e 'warnings.warn' -e gemm_4bit | tee '$OUT/variants.log'"
# --tb=short --show-capture=no: each failure with its assertion message (the whole log in tests.log)
run tests 85 bash -o pipefail -c "$PY -m pytest -q -p no:cacheprovider tests/rollout/test_families_gpu.py \
  -k 'gemma2 or mixtral' --tb=short --show-capture=no 2>&1 | tee '$OUT/tests.log' | tail -25"
echo "== done at ${SECONDS}s"
