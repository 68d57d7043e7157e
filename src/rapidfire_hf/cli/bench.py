"""`rapidfire bench NAME`: run one of the committed benchmark scripts of a source checkout.

The scripts live in ``benchmarks/<name>/`` of the repository (they are not part of the wheel) and
each writes results.json / CSV / PNG into ``--out``. Extra arguments are passed to the script.
``benchmarks/reproduce_h200.sh`` runs every command behind a number in the READMEs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = {
    "ppo": (
        "ppo_vs_trl/run.py",
        "stock TRL 1.12 PPO vs rapidfire PPO (needs TRL112_PATH for the stock side)",
    ),
    "grpo": ("grpo/run.py", "stock TRL GRPOTrainer vs enable_rapidfire(GRPOTrainer)"),
    "rollout": ("rollout/run.py", "HF generate vs the rollout engine: ms per decode step"),
    "optimizer": ("optimizer/run.py", "fused AdamW vs RapidFireOptimizer: step time, memory, snapshot cost"),
    "memory": ("memory/run.py", "allocator, compaction and selective checkpointing"),
    "precision": ("precision/run.py", "static vs adaptive fp16; FP8 vs bf16"),
    "ppo-precision": ("precision/ppo_ratio.py", "PPO bf16 vs adaptive vs fp32: log-prob gap, ratio and KL"),
    "sft-dpo": (
        "trl_trainers/run.py",
        "stock TRL SFTTrainer/DPOTrainer vs enable_rapidfire at sequence 2048",
    ),
}


def benchmarks_dir() -> Path | None:
    """``benchmarks/`` of the checkout this package was installed from (editable installs), if any."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "benchmarks"
        if (candidate / "ppo_vs_trl").is_dir():
            return candidate
    return None


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="Run a committed benchmark script (source checkout).",
        description="Run one of the committed benchmark scripts of a source checkout (benchmarks/<name>/); "
        "it writes results.json, CSV and PNG into --out. Arguments after `--` go to the script. "
        "`rapidfire bench --list` lists the benchmarks.",
    )
    p.add_argument("name", nargs="?", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("--out", default=None, help="output folder (default: benchmarks/<name>/results/local)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.set_defaults(extra=[])  # `rapidfire bench NAME -- ARGS...`: main() passes ARGS to the script
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    if args.list or args.name is None:
        for name, (_, what) in sorted(BENCHMARKS.items()):
            print(f"{name:10s} {what}")
        print("every README number: bash benchmarks/reproduce_h200.sh --list")
        return 0 if args.list else 2
    root = benchmarks_dir()
    if root is None:
        print(
            "rapidfire bench needs the benchmarks/ folder of a source checkout; clone the repository and "
            "install it with `pip install -e .`.",
            file=sys.stderr,
        )
        return 2
    script, _ = BENCHMARKS[args.name]
    out = args.out or str(root / Path(script).parent / "results" / "local")
    Path(out).mkdir(parents=True, exist_ok=True)  # a bad --out is said here (OSError: one line), not by the script
    cmd = [
        sys.executable,
        str(root / script),
        "--out",
        out,
        *(["--smoke"] if args.smoke else []),
        *args.extra,
    ]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)
