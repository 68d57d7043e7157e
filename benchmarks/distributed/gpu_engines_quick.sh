#!/usr/bin/env bash
# Short 2-GPU call: PPOTrainer smoke under ZeRO-2, ZeRO-3 and FSDP2 at once (tiny model, distinct ports),
# first traceback of a failed run kept; then the optimizer benchmark on GPU 0 for what time is left.
set -u
source benchmarks/gpu_env.sh  # carried wheels -> /tmp/site, PYTHONPATH
R=/tmp/q; mkdir -p $R; port=29710
for engine in zero2 zero3 fsdp2; do
  case $engine in
    zero2) cfg=deepspeed_zero2; extra="" ;;
    zero3) cfg=deepspeed_zero3; extra="--gather --rollout-backend hf" ;;
    fsdp2) cfg=fsdp2; extra="--gather --rollout-backend hf" ;;
  esac
  port=$((port + 7))
  ( timeout -k 5 90 accelerate launch --main_process_port $port --config_file accelerate_configs/$cfg.yaml \
      tests/distributed/scripts/ppo_ranks.py $R/$engine --device cuda --bf16 $extra > $R/$engine.log 2>&1
    echo "{\"engine\": \"$engine\", \"rc\": $?}" >> $R/rc.jsonl ) &
done
wait
python3 - <<'PY' > $OUT/engines.json
import json, pathlib, torch
out = {"rc": [json.loads(l) for l in open("/tmp/q/rc.jsonl")]}
for e in ("zero2", "zero3", "fsdp2"):
    f = pathlib.Path(f"/tmp/q/{e}/ppo_rank0.pt")
    if f.is_file():
        d = torch.load(f, weights_only=False)
        out[e] = {"updates": len([h for h in d["history"] if "objective/kl" in h]), "world_size": d["world_size"],
                  "params_finite": bool(torch.isfinite(d["params"]).all()) if d["params"].numel() else None,
                  "engine": d["engine"], "optimizer_stats": d["optimizer_stats"]}
print(json.dumps(out, indent=1, default=str))
PY
for e in zero2 zero3 fsdp2; do echo "===== $e"; grep -m1 -A40 "Traceback (most recent call last)" $R/$e.log | grep "rank0\|^[A-Za-z]" | tail -12; done > $OUT/engines_errors.txt
cat $R/rc.jsonl
CUDA_VISIBLE_DEVICES=0 timeout -k 5 75 python3 benchmarks/optimizer/run.py --out $R/optimizer --no-snapshot --rounds 1 > $R/optimizer.log 2>&1; echo "optimizer rc=$?"
cp $R/optimizer/results.json $OUT/optimizer_results.json 2>/dev/null; cp $R/optimizer/*.png $OUT/ 2>/dev/null; tail -c 3000 $R/optimizer.log > $OUT/optimizer_log.txt
