"""benchmarks/presets: what each rapidfire config costs or pays in one PPO run, next to stock TRL 1.12.

Every row is one configuration of ``benchmarks/ppo_vs_trl/worker.py`` (its own interpreter, the same
models, prompts and rule reward as the ppo_vs_trl suite), run one after another in one call:

- ``trl``: stock TRL 1.12 PPO at the same batch (needs ``TRL112_PATH``; ``skipped`` otherwise);
- ``none``: our PPOTrainer with no rapidfire config (the user's micro-batch, TRL's chunks);
- each preset (``conservative``, ``balanced``, ``aggressive``), ``config/advanced.yaml`` and the articles'
  snippet (``{"gradient_pipeline": True, "memory_optimization": "aggressive", "precision": "adaptive"}``),
  with the throughput planner (the default) and, as ``<name>-noplan``, with ``memory.planner: false``;
- ``pipeline-aN`` / ``nopipeline-aN``: ``balanced`` without the planner, the gradient pipeline on / off, at
  N accumulation steps (micro-batch = rollout batch / N): where the pipeline pays.

Tokens/s = rollout batch x (prompt + response) / median s per update of the updates after the first.
Each row stores the plan the trainer printed. Writes ``results.json``, ``results.csv`` and ``presets.png``.

    python benchmarks/presets/run.py --out OUT --batch 64 --rows trl,none,conservative,balanced,aggressive
    python benchmarks/presets/run.py --out OUT --smoke   # CPU: the tiny shape, two rows
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import bar_chart, environment, write_csv, write_json  # noqa: E402
from benchmarks.ppo_vs_trl.run import SHAPES, run_one  # noqa: E402

SNIPPET = {"gradient_pipeline": True, "memory_optimization": "aggressive", "precision": "adaptive"}
CONFIGS = {
    "none": None,
    "conservative": "conservative",
    "balanced": "balanced",
    "aggressive": "aggressive",
    "advanced": str(ROOT / "config" / "advanced.yaml"),
    "snippet": SNIPPET,
    # the balanced preset with the clip prediction of earlier versions (gradient.clip_prediction: scale)
    "balancedscale": {"preset": "balanced", "gradient": {"clip_prediction": "scale"}},
}
# a row name may end in "-<flag>": that config with these memory settings ("aggressive-noplan": the planner
# off; "balanced-pressurerelease": the cache released between scoring and training only under pressure)
MEMORY_FLAGS = {
    "noplan": {"planner": False},
    "pressurerelease": {"release_after_rollout": "pressure"},
}
ROW_NAMES = (
    "trl",
    "handtuned",
    *CONFIGS,
    *(f"{n}-{f}" for f in MEMORY_FLAGS for n in CONFIGS if n != "none"),
)
# the gradient pipeline at a given number of accumulation steps: "pipeline-a4" / "nopipeline-a4" run
# `balanced` with the planner off (the user's split kept) and micro-batch = rollout batch / 4
ACCUMULATION_ROWS = ("pipeline-a", "nopipeline-a")


def pipeline_row(name: str) -> tuple[bool, int] | None:
    """``(pipeline on, accumulation steps)`` of a pipeline row, or None for any other row."""
    for prefix in ACCUMULATION_ROWS:
        if name.startswith(prefix) and name[len(prefix) :].isdigit() and int(name[len(prefix) :]) >= 1:
            return prefix == "pipeline-a", int(name[len(prefix) :])
    return None


LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def rapidfire_config(name: str):
    """The rapidfire_config a row passes (``<config>-<flag>``: that config with ``MEMORY_FLAGS[flag]``)."""
    base, _, flag = name.partition("-")
    config = CONFIGS[base]
    if not flag:
        return config
    memory = MEMORY_FLAGS[flag]
    if isinstance(config, dict) and "preset" in config:
        return {**config, "memory": {**config.get("memory", {}), **memory}}
    if isinstance(config, str) and config in CONFIGS:  # a preset name
        return {"preset": config, "memory": dict(memory)}
    return _with_memory(config, memory)  # the short form (the snippet) or a YAML path


def _with_memory(config, memory: dict) -> dict:
    """``config`` (a short-form dict or a YAML path) in the nested form, its memory section updated."""
    from rapidfire_hf.config import load_config

    data = load_config(config).to_dict()
    data["memory"].update(memory)
    return data


# a row name may end in "+<decode option>" (benchmarks/ppo_vs_trl/worker.DECODE_KERNELS): "aggressive+sdpa"
# is `aggressive` with rollout_decode_attention="sdpa", "aggressive+tattn" the same with the Triton kernel,
# "aggressive+freecache" with rollout_cache="auto", "aggressive+keepcache" with rollout_cache="keep",
# "aggressive+nofuse" without fused decode projections
# ("+alwaysrelease" / "+pressurerelease": the memory callback's release between scoring and training,
# worker.MEMORY_RELEASE; the only way to the previous default for a row without a config, "none")
DECODE_SUFFIXES = (
    "sdpa",
    "tattn",
    "fuse",
    "nofuse",
    "freecache",
    "keepcache",
    "fuselora",
    "alwaysrelease",
    "pressurerelease",
)


def row_config(name: str, args) -> dict:
    """The worker configuration of row ``name`` (``name+<decode option>``: that row with the option)."""
    name, _, decode = name.partition("+")
    if decode and decode not in DECODE_SUFFIXES:
        raise SystemExit(f"row {name}+{decode}: unknown decode option; known: {', '.join(DECODE_SUFFIXES)}")
    cfg = _row_config(name, args)
    if decode:
        cfg["name"] = f"{name}+{decode}_b{cfg['batch']}"
        cfg["row"] = f"{name}+{decode}"
        cfg["decode_kernels"] = decode
    return cfg


def _row_config(name: str, args) -> dict:
    batch = args.trl_batch if name == "trl" and args.trl_batch else args.batch
    cfg = {
        "name": f"{name}_b{batch}",
        "row": name,
        # the 7B shape: models built straight on the GPU in bf16, no reference copy with LoRA
        "part": "size7b" if args.shape.startswith("llama-7b") or args.peft else "throughput",
        "shape": args.shape,
        "shape_kwargs": SHAPES[args.shape],
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "updates": args.updates,
        "batch": batch,
        "micro": min(args.micro, batch),
        "value_mode": "separate" if name == "trl" else args.value_mode,
        "peft": args.peft,
        "lora": LORA if args.peft else None,
        "reward": args.reward,
        "system": "trl" if name == "trl" else "rapidfire",
        "rollout_backend": "auto",
        "liger": args.liger and name != "trl",
        "compile": args.compile and name != "trl",
    }
    pipe = pipeline_row(name)
    if pipe is not None:
        on, steps = pipe
        if batch % steps:
            raise SystemExit(
                f"row {name}: the rollout batch {batch} does not split into {steps} micro-batches"
            )
        cfg["micro"] = batch // steps
        cfg["rapidfire_config"] = {
            "preset": "balanced",
            "memory": {"planner": False},
            "gradient": {"pipeline": on},
        }
        cfg["score_chunk"] = "auto"
        cfg["rollout_generation_batch_size"] = "auto"
    elif name == "handtuned":  # today's hand-set sizes: no rapidfire config, everything given by hand
        cfg["micro"] = args.hand_micro
        cfg["score_chunk"] = args.hand_score_chunk
        if args.hand_gen_chunk:
            cfg["rollout_generation_batch_size"] = args.hand_gen_chunk
        if args.hand_optimizer:
            cfg["optimizer"] = args.hand_optimizer
    elif name != "trl":
        cfg["rapidfire_config"] = rapidfire_config(name)
        cfg["score_chunk"] = "auto"  # the chunks are left to the trainer (the planner, or TRL's default)
        cfg["rollout_generation_batch_size"] = "auto"
    if args.profile_update is not None and name != "trl":
        cfg["profile_update"] = args.profile_update  # that update under torch.profiler (worker.ProfileUpdate)
    return cfg


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json / results.csv / presets.png")
    p.add_argument(
        "--rows",
        default="trl,none,conservative,balanced,aggressive,advanced,snippet",
        help=f"comma-separated rows, in order; known: {', '.join(ROW_NAMES)}, pipeline-aN / nopipeline-aN "
        "(the gradient pipeline on / off at N accumulation steps)",
    )
    p.add_argument("--batch", type=int, default=64, help="rollout batch (prompts per update)")
    p.add_argument(
        "--micro", type=int, default=8, help="per_device_train_batch_size (the user's micro-batch)"
    )
    p.add_argument("--shape", default="llama-1.1b", choices=sorted(SHAPES))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=384)
    p.add_argument("--updates", type=int, default=4, help="updates per row; the first is the warm-up")
    p.add_argument(
        "--value-mode", default="separate", choices=("separate", "fused"), help="ours (stock: separate)"
    )
    p.add_argument("--peft", action="store_true", help="LoRA r=16 on q/k/v/o (both systems)")
    p.add_argument(
        "--reward",
        default="rule",
        choices=("rule", "model"),
        help="rule: the rule reward module; model: a reward model of the policy's shape (7B rows)",
    )
    p.add_argument("--trl-batch", type=int, default=None, help="stock TRL's rollout batch (default --batch)")
    p.add_argument("--hand-micro", type=int, default=8, help="handtuned row: per_device_train_batch_size")
    p.add_argument(
        "--hand-score-chunk", type=int, default=16, help="handtuned row: local_rollout_forward_batch_size"
    )
    p.add_argument(
        "--hand-gen-chunk", type=int, default=None, help="handtuned row: rollout_generation_batch_size"
    )
    p.add_argument(
        "--hand-optimizer",
        default=None,
        choices=("adamw8bit",),
        help="handtuned row: RapidFireOptimizer(optimizer='adamw8bit', gradient_pipeline=True)",
    )
    p.add_argument("--liger", action="store_true", help="ours with use_liger_kernel=True")
    p.add_argument("--compile", action="store_true", help="ours with torch_compile=True")
    p.add_argument("--timeout", type=int, default=600, help="seconds per row")
    p.add_argument(
        "--profile-update", type=int, default=None,
        help="run this update (0-based; not the first, which compiles) of our rows under torch.profiler and "
        "store its top operators by device time in results.json (the row's 'profile'); that update is kept "
        "out of the medians, so add one to --updates (e.g. --updates 5 --profile-update 4)",
    )  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny smoke shape, 8 + 8 tokens, batch 8")
    args = p.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]

    def known(row: str) -> bool:
        base, plus, decode = row.partition("+")
        if plus and (base == "trl" or decode not in DECODE_SUFFIXES):
            return False
        return base in ROW_NAMES or pipeline_row(base) is not None

    unknown = [r for r in args.rows if not known(r)]
    if unknown:
        p.error(
            f"unknown row(s) {', '.join(unknown)}; known: {', '.join(ROW_NAMES)}, and any but trl with "
            f"+{' / +'.join(DECODE_SUFFIXES)}"
        )
    if args.smoke:
        args.shape, args.prompt_len, args.response_len, args.batch, args.micro = "smoke", 8, 8, 8, 2
        args.updates = min(args.updates, 3)
    if args.profile_update is not None and not 1 <= args.profile_update < args.updates:
        p.error(
            f"--profile-update {args.profile_update}: give an update after the first and before --updates "
            f"({args.updates}{', the smoke maximum' if args.smoke else ''}), e.g. --updates 5 --profile-update 4"
        )
    return args


def summary_row(row: dict, baseline: dict | None) -> dict:
    plan = row.get("plan") or {}
    tps = row.get("tokens_per_s")
    base = baseline.get("tokens_per_s") if baseline else None
    return {
        "row": row.get("row"),
        "batch": row.get("batch"),
        "status": row.get("status"),
        "s_per_update": row.get("s_per_update"),
        "tokens_per_s": tps,
        "vs_none": tps / base if tps and base else None,
        "peak_gib": row.get("peak_gib"),
        "train_s": row.get("train_s"),
        "score_s": row.get("score_s"),
        "plan_train_rows": plan.get("train_rows"),
        "plan_checkpointing": plan.get("checkpointing"),
        "plan_scoring_rows": plan.get("scoring_rows"),
        "plan_generation_rows": plan.get("generation_rows"),
        "plan_fuse_projections": plan.get("fuse_projections"),
        "plan_peak_gib": plan.get("planned_peak_bytes", 0) / 2**30 if plan else None,
        "micro": row.get("micro"),
        "pipeline": row.get("pipeline"),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, env = [], environment()
    env["command"] = " ".join(["python", "benchmarks/presets/run.py", *(argv or sys.argv[1:])])
    for i, name in enumerate(args.rows, 1):
        print(f"[{i}/{len(args.rows)}] {name} at batch {args.batch} ...", flush=True)
        row = run_one(row_config(name, args), out, args.timeout)
        row.pop("shape_kwargs", None)
        rows.append(row)
        none = next((r for r in rows if r.get("row") == "none" and r.get("status") == "ok"), None)
        s = summary_row(row, none)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}, flush=True)
        summary = [summary_row(r, none) for r in rows]
        write_json(out / "results.json", {"environment": env, "rows": rows, "summary": summary})
        write_csv(out / "results.csv", summary)
    plot(summary, out / "presets.png", args)


def plot(summary: list[dict], path: Path, args) -> None:
    ok = [r for r in summary if r["status"] == "ok"]
    if not ok:
        return
    none = next((r["tokens_per_s"] for r in ok if r["row"] == "none"), None)
    bar_chart(
        path,
        [f"{r['row']} ({r['peak_gib'] or 0:.1f} GiB)" for r in ok],
        [r["tokens_per_s"] for r in ok],
        f"PPO {args.shape}, rollout batch {args.batch}, {args.prompt_len}+{args.response_len} tokens, "
        f"{args.value_mode} value (ratio: to no config)",
        "tokens / s (median of the updates after the first)",
        reference=none,
    )


if __name__ == "__main__":
    main()
