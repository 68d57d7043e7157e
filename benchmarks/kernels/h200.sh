#!/usr/bin/env bash
# One device call for benchmarks/kernels (run from the repository root on the GPU machine, .whl/ carried):
#   bash benchmarks/kernels/h200.sh OUT
# in this order, each part under its own time limit (seconds, capped by what is left of TOTAL_S for the call),
# each writing its rows as they finish, so a part that runs out of time keeps what it measured:
#   tests     the GPU tests of the Triton kernels (tests/kernels -m gpu)                      ~40 s, cap 90
#   kernels   benchmarks/kernels/run.py: each kernel against its PyTorch path and the floor   ~90 s, cap 120
#   logprobs  benchmarks/kernels/logprobs.py: chunked log-probs, ours / TRL 1.16 / Liger      ~45 s, cap 70
#   rollout   benchmarks/rollout/run.py: the decode step end to end, with and without Triton  ~150 s, cap 170
#             (ROLLOUT_CAP_S; ROLLOUT_SYSTEMS, ROLLOUT_BATCHES and ROLLOUT_BUDGET_S pick what it runs)
#   ppo       (only when named in PARTS) PPO batch 8 / 32: stock TRL 1.12 and ours, ours +fuse, ours +skinny (fused projections through the Triton skinny matmul)
#   profile   benchmarks/kernels/profile_decode.py: the compiled decode step by kernel category,
#             1.1B / 7B, batch 8 / 64 / 256, default and Triton; ~25-40 s a cell, so the cells left when
#             its budget ends are recorded as skipped (run them with PARTS=profile PROFILE_BATCHES=...)
# PARTS picks parts (default all, in the order above); KERNELS the sections of run.py; PROFILE_SHAPES,
# PROFILE_FIRST_STEP (184: the 16 profiled steps sit at the response's mean cache length, 320 of 512
# slots) and PPO_KERNELS (e.g. "base tattn") change a part; TOTAL_S (default 510) bounds the call after the
# wheel install, which takes ~15-20 s. On the rollout part's compiled batch 8 / 64 steps the profile reuses
# inductor's on-disk cache (same step, same shapes).
set -u
PY=${PYTHON:-python3}  # reproduce_h200.sh's PYTHON (its tests record the commands instead of running them)
OUT=${1:?output folder}
mkdir -p "$OUT"
source benchmarks/common/gpu_env.sh
PARTS=${PARTS:-tests kernels logprobs rollout profile}
TOTAL_S=${TOTAL_S:-510}
SECONDS=0

# run NAME CAP COMMAND...: COMMAND under `timeout`, at most CAP seconds and at most what is left of TOTAL_S
run() {
  local name=$1 cap=$2 left=$((TOTAL_S - SECONDS))
  shift 2
  case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
  ((cap > left)) && cap=$left
  if ((cap < 15)); then
    echo "== $name: skipped, ${left}s left of ${TOTAL_S}s" | tee -a "$OUT/parts.log"
    return 0
  fi
  echo "== $name (limit ${cap}s, at ${SECONDS}s)"
  local start=$SECONDS
  timeout -k 10 "$cap" "$@"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start))s$( ((rc == 124 || rc == 137)) && echo ' (time limit: rows so far kept)')" |
    tee -a "$OUT/parts.log"
}

# --tb=line --show-capture=no: one line per failure, naming the assertion (a failing compiled test's captured
# torch logs otherwise push it out of the device tool's output)
run tests 90 bash -o pipefail -c "$PY -m pytest -q -p no:cacheprovider tests/kernels -m gpu --tb=line --show-capture=no 2>&1 | tail -8"
run kernels 120 bash -o pipefail -c "$PY benchmarks/kernels/run.py --out '$OUT/kernels' --kernels ${KERNELS:-attention,sampling,matmul} 2>&1 | grep -v '^{' | tail -3"
run logprobs 70 bash -o pipefail -c "$PY benchmarks/kernels/logprobs.py --out '$OUT/logprobs' --budget-s ${LOGPROBS_BUDGET_S:-45} \
  2>&1 | grep -E '^\{|wrote' | cut -c1-220 | tail -30"
run rollout ${ROLLOUT_CAP_S:-170} bash -o pipefail -c "$PY benchmarks/rollout/run.py --out '$OUT/rollout' --batches ${ROLLOUT_BATCHES:-8,64} \
  --budget-s ${ROLLOUT_BUDGET_S:-140} --no-correctness \
  --systems ${ROLLOUT_SYSTEMS:-ours_compile,ours_compile+fuse,ours_compile+fuse_skinny,ours_compile+autotune,ours_compile+triton} \
  2>&1 | tail -14"
# PPO at batch 8 and 32 (issue 31's end-to-end target): stock TRL 1.12, ours, ours with each decode option;
# not in the default PARTS (a call of its own: ~450 s; needs .whl-trl112 carried)
# (PPO_CAP_S: seconds per variant, 200; PPO_BATCHES: ours, 8,32; PPO_TRL_BATCHES: stock's, in the base variant, 8,32:
# stock's generation is Python-bound, ~10 s an update on a slow host, when 200 s no longer fit stock and ours)
for k in ${PPO_KERNELS:-base fuse skinny}; do
  flag=$([ $k = base ] || echo "--ours-decode-kernels $k")
  trl=$([ $k = base ] && echo "${PPO_TRL_BATCHES-8,32}" || echo "")
  run ppo ${PPO_CAP_S:-200} bash -o pipefail -c "$PY benchmarks/ppo_vs_trl/run.py --out '$OUT/ppo_$k' --part throughput \
    --trl-batches '$trl' --our-batches ${PPO_BATCHES:-8,32} --fused-batches '' --updates 4 $flag 2>&1 | tail -4"
done
# the profile's own budget leaves ~40 s for the cell started last (a compiled 7B cell)
left=$((TOTAL_S - SECONDS))
run profile $left bash -o pipefail -c "$PY benchmarks/kernels/profile_decode.py --out '$OUT/profile' \
  --batches ${PROFILE_BATCHES:-8,64,256} --variants ${PROFILE_VARIANTS:-default,fuse,triton} --mode ${PROFILE_MODE:-compile} --budget-s ${PROFILE_BUDGET_S:-$((left - 40))} \
  --shapes ${PROFILE_SHAPES:-llama-1.1b,llama-7b} --first-step ${PROFILE_FIRST_STEP:-8} \
  2>&1 | grep -E '^\{|wrote' | cut -c1-260 | tail -14"
echo "== done in ${SECONDS}s"
# the device tool returns at most 8 files from OUT: one archive of every part's files, parts.log beside it
tar -cf "$OUT/results.tar" -C "$OUT" --exclude results.tar --exclude parts.log . &&
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name results.tar ! -name parts.log -exec rm -rf {} +
