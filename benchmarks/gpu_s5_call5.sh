#!/usr/bin/env bash
# Fifth session (2026-12-01), device call 5 on two H200s, < 280 s.
#   GPU 0 (cores 0-15): stock TRL 1.12 at rollout batches 8 and 32, then the FP8 GPU tests (enable_fp8's new
#     default threshold).
#   GPU 1 (cores 16-31): ours at rollout batch 32 with the speed-ups (separate: compile; fused: liger+compile)
#     and batch 8 separate with compile; default compiled decode.
# Carry: .whl .whl-ao .whl-trl112. Results: $OUT/s5call5.tgz.
set -u
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
source benchmarks/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site112 .whl-trl112/*.whl .whl/datasets* .whl/dill* .whl/multiprocess* 2>&1 | tail -1
R=/tmp/s5call5; mkdir -p $R
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
(
  export CUDA_VISIBLE_DEVICES=0
  TRL112_PATH=/tmp/site112 pin 0-15 timeout -k 5 170 python3 benchmarks/ppo_vs_trl/run.py --out $R/small_trl \
    --part throughput --updates 2 --timeout 120 --trl-batches 8,32 --our-batches "" --fused-batches "" > $R/small_trl.log 2>&1
  echo "small trl rc=$? at $(elapsed)s"
  pin 0-15 timeout -k 5 $((265 - $(elapsed))) python3 -m pytest -q -p no:cacheprovider -m gpu tests/precision/test_fp8.py > $R/fp8_tests.log 2>&1
  echo "fp8 tests rc=$? at $(elapsed)s"
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  pin 16-31 timeout -k 5 255 python3 benchmarks/ppo_vs_trl/run.py --out $R/small_ours \
    --part throughput --updates 2 --timeout 120 --trl-batches "" --our-batches 32,8 --fused-batches 32 \
    --ours-variants compile --fused-variants liger+compile > $R/small_ours.log 2>&1
  echo "small ours rc=$? at $(elapsed)s"
) > $R/lane1.txt 2>&1 &
wait
cat $R/lane0.txt $R/lane1.txt
tail -3 $R/fp8_tests.log
for f in $R/small_*/results.json; do python3 - "$f" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r.get("name"), r.get("status"), "s/upd", r.get("s_per_update"), "tok/s", r.get("tokens_per_s"),
          "gen", r.get("gen_share"), "peak", r.get("peak_gib"), (r.get("error") or "")[-300:])
PY
done
tar czf $OUT/s5call5.tgz -C $R . 2>/dev/null; ls -la $OUT
echo "total $(elapsed)s"
