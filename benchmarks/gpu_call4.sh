#!/usr/bin/env bash
# Last device call of the 2026-11-30 (third) session, two H200s, about 5.5 minutes:
#   1 (both GPUs, ~75 s): enable_rapidfire (SFTTrainer) and PPOTrainer smoke under FSDP2 after the DTensor
#     fixes, next to the GPU test of the GRPO lowmem2 offload paths
#   2 GPU 0: GRPO stock vs rapidfire_lowmem2 (the <= 1/2 memory target), CPU cores 0-15
#     GPU 1: the optimizer benchmark's core variants, 3 interleaved rounds, CPU cores 16-31 (call 2 ran
#     it next to a compiling neighbour on shared cores: its step times were noisy)
# Carry: .whl .whl-ds. Results come back as one tarball.
set -u
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
R=/tmp/call4; mkdir -p $R
pin() { local cores=$1; shift; if command -v taskset > /dev/null; then taskset -c "$cores" "$@"; else "$@"; fi; }
( timeout -k 5 90 accelerate launch --main_process_port 29731 --config_file accelerate_configs/fsdp2.yaml \
    tests/distributed/scripts/sft_ranks.py $R/sft_fsdp2 --device cuda --bf16 > $R/sft_fsdp2.log 2>&1; echo "sft fsdp2 rc=$?" ) &
( timeout -k 5 90 accelerate launch --main_process_port 29741 --config_file accelerate_configs/fsdp2.yaml \
    tests/distributed/scripts/ppo_ranks.py $R/ppo_fsdp2 --device cuda --bf16 --rollout-backend hf > $R/ppo_fsdp2.log 2>&1; echo "ppo fsdp2 rc=$?" ) &
( CUDA_VISIBLE_DEVICES=0 timeout -k 5 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/integrations/test_grpo_lowmem.py tests/optim/test_gpu.py \
    --junitxml $R/gpu_tests.xml > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -1 $R/gpu_tests.log ) &
wait
python3 - > $R/fsdp2_summary.txt 2>&1 <<'PY'
import json, pathlib, torch
for name in ("sft_fsdp2", "ppo_fsdp2"):
    d = pathlib.Path("/tmp/call4") / name
    for f in sorted(d.glob("*.json")) + sorted(d.glob("*rank0.pt")):
        if f.suffix == ".json":
            print(name, f.name, json.dumps(json.loads(f.read_text()), default=str)[:1500])
        else:
            r = torch.load(f, weights_only=False)
            print(name, f.name, {"updates": len([h for h in r["history"] if "objective/kl" in h]),
                  "world_size": r["world_size"], "params_finite": bool(torch.isfinite(r["params"]).all()) if r["params"].numel() else None,
                  "optimizer_stats": r.get("optimizer_stats")})
PY
(
  export CUDA_VISIBLE_DEVICES=0
  pin 0-15 timeout -k 5 250 python3 benchmarks/grpo/run.py --out $R/grpo2 --variants stock,rapidfire_lowmem2 > $R/grpo2.log 2>&1; echo "grpo rc=$?"
) > $R/lane0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  pin 16-31 timeout -k 5 220 python3 benchmarks/optimizer/run.py --out $R/optimizer --rounds 3 --only torch_adamw rf_pipeline_off \
    rf_pipeline_on rf_verify_only rf_pipeline_rollback torch_adamw_ckpt rf_pipeline_ckpt torch_adamw_accum rf_pipeline_on_accum \
    rf_verify_accum rf_rollback_accum > $R/optimizer.log 2>&1; echo "optimizer rc=$?"
) > $R/lane1.txt 2>&1 &
wait
cat $R/lane0.txt $R/lane1.txt $R/fsdp2_summary.txt | cut -c1-600
grep -A14 "^variant" $R/optimizer.log
tar czf $OUT/call4.tgz --exclude='*.safetensors' --exclude='model' -C $R . 2>/dev/null; ls -la $OUT
