"""Where one PPO update of our trainer spends its GPU time (torch.profiler), on the benchmark's workload.

    python benchmarks/ppo_vs_trl/profile_ours.py --out DIR [--batch 64] [--micro 8] [--value-mode separate]
        [--pipeline on|off]

Runs one warm-up update, then profiles the phases of one more (rollout, scoring, training) and writes
DIR/profile_<name>.txt: per phase the wall seconds and the 25 CUDA kernels / operators with the most
device time, so a speed change can be aimed at what costs most. Diagnostic only: no claims are drawn
from it (the throughput comparison is run.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import SHAPES  # noqa: E402
from worker import build_ours  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="llama-1.1b", choices=SHAPES)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=384)
    p.add_argument("--value-mode", default="separate", choices=("separate", "fused"))
    p.add_argument("--pipeline", default="on", choices=("on", "off"))
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--cuda-only", action="store_true", help="record device kernels only (less overhead)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = dict(
        name=f"profile_{args.value_mode}_b{args.batch}_m{args.micro}_pipe{args.pipeline}",
        shape=args.shape,
        shape_kwargs=SHAPES[args.shape],
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        updates=3,
        micro=args.micro,
        batch=args.batch,
        part="throughput",
        system="rapidfire",
        value_mode=args.value_mode,
        rapidfire_config={"gradient": {"pipeline": args.pipeline == "on"}},
    )
    trainer = build_ours(cfg, device)
    trainer.one_update(0)  # warm-up: graph recording, allocator growth
    _sync()
    activities = [] if args.cuda_only and device == "cuda" else [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines, phases = [], {}
    batch = trainer.next_prompts(1)
    for phase in ("rollout", "score", "optimize"):
        with torch.profiler.profile(activities=activities) as prof:
            _sync()
            t0 = time.perf_counter()
            if phase == "rollout":
                rollout = trainer.rollout(batch)
            elif phase == "score":
                exp = trainer.score(rollout)
            else:
                trainer.optimize(exp)
            _sync()
            phases[phase] = time.perf_counter() - t0
        lines.append(f"===== {phase}: {phases[phase]:.3f} s wall")
        lines.append(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=70))
    header = json.dumps({"config": {k: v for k, v in cfg.items() if k != "shape_kwargs"}, "phases_s": phases})
    text = header + "\n" + "\n".join(lines)
    (out / f"{cfg['name']}.txt").write_text(text)
    print(header)


if __name__ == "__main__":
    main()
