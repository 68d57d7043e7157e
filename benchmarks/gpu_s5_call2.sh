#!/usr/bin/env bash
# Fifth session (2026-11-30), device call 2 on two H200s, < 480 s: more of the PPO learning comparison
# (issue 4) on learn-small, 30 updates, 14 lanes (7 per GPU, 2 CPU cores each); every run has its own
# TMPDIR (call 1 lost rows to a shared temp file name):
#   stock TRL 1.12 and ours separate at lr 3e-4, seeds 8..15 (0..7 in call 1);
#   stock TRL 1.12 and ours separate at lr 6e-4, seeds 0..7 (every system gets the same learning-rate sweep);
#   ours fused: lr 3e-4 seeds 1,2,3,5,6,7 and lr 6e-4 seeds 0,4,6,7 (lost in call 1), lr 1e-3 seeds 8..15.
# Carry: .whl .whl-ds .whl-trl112. Results: $OUT/s5call2.tgz.
set -u
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site112 .whl-trl112/*.whl .whl/datasets* .whl/dill* .whl/multiprocess* 2>&1 | tail -1
R=/tmp/s5call2; mkdir -p $R
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
JOBS=()
for s in 8 9 10 11 12 13 14 15; do JOBS+=("learn_trl 3e-4 $s"); done
for s in 0 1 2 3 4 5 6 7; do JOBS+=("learn_trl 6e-4 $s"); done
for s in 8 9 10 11 12 13 14 15; do JOBS+=("learn_rapidfire_separate 3e-4 $s"); done
for s in 0 1 2 3 4 5 6 7; do JOBS+=("learn_rapidfire_separate 6e-4 $s"); done
for s in 1 2 3 5 6 7; do JOBS+=("learn_rapidfire_fused 3e-4 $s"); done
for s in 0 4 6 7; do JOBS+=("learn_rapidfire_fused 6e-4 $s"); done
for s in 8 9 10 11 12 13 14 15; do JOBS+=("learn_rapidfire_fused 1e-3 $s"); done
LANES=14
lane() {
  local i=$1 gpu=$(( $1 % 2 )) k=$(( $1 / 2 ))
  local c0=$(( gpu * 16 + k * 2 )) c1=$(( gpu * 16 + k * 2 + 1 ))
  local j
  for ((j = i; j < ${#JOBS[@]}; j += LANES)); do
    set -- ${JOBS[$j]}
    local name=$1 lr=$2 seed=$3 left=$((420 - $(elapsed)))
    if [ $left -lt 40 ]; then echo "skip $name lr=$lr s=$seed (time)"; continue; fi
    local tmp=$R/tmp/lr$lr.${name}_s$seed; mkdir -p $tmp
    TMPDIR=$tmp CUDA_VISIBLE_DEVICES=$gpu TRL112_PATH=/tmp/site112 OMP_NUM_THREADS=2 pin $c0-$c1 timeout -k 5 $left \
      python3 benchmarks/ppo_vs_trl/run.py --out $R/lr$lr/${name}_s$seed --part learning --only $name \
      --learn-lr $lr --learn-seeds $seed --timeout 200 > $R/lr$lr.${name}_s$seed.log 2>&1
    echo "$name lr=$lr s=$seed rc=$? at $(elapsed)s (gpu $gpu cores $c0-$c1)"
  done
}
for ((l = 0; l < LANES; l++)); do lane $l > $R/lane$l.txt 2>&1 & done
wait
cat $R/lane*.txt | sort -t= -k3 | tail -60
echo "learning done at $(elapsed)s"
rm -rf $R/tmp
for f in $R/lr*/*/results.json; do python3 - "$f" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])).get("rows", []):
    print(sys.argv[1].split("/")[-3], r.get("name"), r.get("lr"), r.get("status"), "last5", r.get("reward_last5"))
PY
done
tar czf $OUT/s5call2.tgz -C $R . 2>/dev/null; ls -la $OUT
echo "total $(elapsed)s"
