"""benchmarks/card80: the seeds' headline on the seeds' card, 7B PPO on one 80 GB GPU, planned to fit.

Rows (one PPO run each, in its own worker process: ``benchmarks/ppo_vs_trl/worker.py`` through
``benchmarks/presets``' row configuration; 7B random-init Llama shape, a 7B reward model, 128 + 384
tokens, fused value head, ``memory.optimization=aggressive``, chunks and micro-batch left to the plan):

- ``full7b``: full fine-tuning, rollout batch 160, the user's micro-batch 8;
- ``lora7b``: LoRA r=16 on q/k/v/o, rollout batch 256, micro-batch 8;
- ``full7b_off`` / ``full7b_offload``: ``full7b`` with PPOConfig's ``host_offload="off"`` (the plan without
  host offload, as before issue 46 item 2) and ``"auto"`` (the plan may keep the frozen reference and reward
  weights, and the optimizer state, in host memory between phases: ``rapidfire_hf.memory.offload_plan``).
  ``bash benchmarks/card80/h100.sh OUT full7b_trades`` runs the two in one device call;
- ``lora7b_modelkv`` / ``full7b_modelkv``: the cache in the model's dtype (``rollout_kv_cache_dtype="model"``),
  whatever ``"auto"`` chooses;
- ``lora7b_int8kv`` / ``full7b_int8kv``: ``lora7b_offload`` / ``full7b_offload`` with an 8-bit KV cache
  (``rollout_kv_cache_dtype="int8"``); ``h100.sh OUT lora7b_kv`` (or ``full7b_kv``) runs each beside its
  model-dtype row in one device call;
- ``lora7b_fuselora``: ``lora7b_offload`` with ``rollout_decode_fuse_lora=True`` (the LoRA layers in the fused
  decode projections, where the plan fuses); ``h100.sh OUT lora7b_fuse`` runs it beside ``lora7b_offload``.

For each row the results hold, per phase (generation, scoring, training): the peak the trainer's plan
predicted (``plan.phase_peak_bytes``, from its one-row probe on the card), the peak the same plan predicts
from the shape alone (``rapidfire_hf.memory.card_plan``, what ``rapidfire plan --gpu-memory`` prints) and
the measured allocator peak of the last update (``torch.cuda.max_memory_allocated`` reset before each
phase); and tokens/s, seconds per phase, the OOM splits (0 is the target: the plan fits by construction)
and the plan's choices (pieces of the micro-batch, recompute, chunks, 8-bit state, freed KV cache).

    python benchmarks/card80/run.py --out OUT --rows full7b    # one row: ~4-6 min on an H100
    python benchmarks/card80/run.py --out OUT --rows full7b_off,full7b_offload --updates 3
    python benchmarks/card80/run.py --out OUT --smoke          # CPU: the tiny shape, both rows
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, write_csv, write_json  # noqa: E402
from benchmarks.ppo_vs_trl.run import run_one  # noqa: E402
from benchmarks.presets.run import parse_args as preset_args  # noqa: E402
from benchmarks.presets.run import row_config  # noqa: E402

GIB = 1024**3
PHASES = {"generation": "rollout", "scoring": "scoring", "training": "training"}
ROWS = {
    "full7b": {"batch": 160, "peft": False},
    "lora7b": {"batch": 256, "peft": True},
    "full7b_off": {"batch": 160, "peft": False, "host_offload": "off"},
    "full7b_offload": {"batch": 160, "peft": False, "host_offload": "auto"},
    "lora7b_off": {"batch": 256, "peft": True, "host_offload": "off"},
    "lora7b_offload": {"batch": 256, "peft": True, "host_offload": "auto"},
    # PPOConfig.rollout_kv_cache_dtype="int8": the plan counts the 8-bit cache (0.516x bf16's bytes), so the
    # generation chunk grows (LoRA b256: 2 chunks of 128 -> one of 256) or other trades fit (full b160: the
    # fused decode projections); PPOConfig's defaults otherwise
    "lora7b_int8kv": {"batch": 256, "peft": True, "host_offload": "auto", "rollout_kv_cache_dtype": "int8"},
    "full7b_int8kv": {"batch": 160, "peft": False, "host_offload": "auto", "rollout_kv_cache_dtype": "int8"},
    # the cache in the model's dtype, whatever "auto" (the default) chooses: the other side of the int8 rows
    # (results/h100_2026-12-07c ran it as lora7b_offload, when "auto" was always the model's dtype)
    "lora7b_modelkv": {"batch": 256, "peft": True, "host_offload": "auto", "rollout_kv_cache_dtype": "model"},
    "full7b_modelkv": {
        "batch": 160,
        "peft": False,
        "host_offload": "auto",
        "rollout_kv_cache_dtype": "model",
    },
    # PPOConfig.rollout_decode_fuse_lora=True (opt-in, not measured on a GPU yet): the LoRA layers join the
    # fused decode projections where the plan fuses at all (benchmarks/ppo_vs_trl/worker.py "fuselora")
    "lora7b_fuselora": {"batch": 256, "peft": True, "host_offload": "auto", "decode_kernels": "fuselora"},
    # PPOConfig(use_liger_kernel=True) (Liger's RMSNorm, SwiGLU, RoPE in the policy and reference forwards of
    # scoring and training), then with torch_compile=True too: opt-in, measured at 1.1B only before
    "lora7b_liger": {"batch": 256, "peft": True, "host_offload": "auto", "liger": True},
    "full7b_liger": {"batch": 160, "peft": False, "host_offload": "auto", "liger": True},
    # the frozen reference and reward models in bitsandbytes 8-bit (issue 46 item 2's trade, not yet measured
    # on a GPU): what the room buys the plan, tokens/s and peak beside full7b_offload
    "full7b_frozen8": {
        "batch": 160,
        "peft": False,
        "host_offload": "auto",
        "ref_quant": "8bit",
        "reward_quant": "8bit",
    },
    "lora7b_ligercompile": {
        "batch": 256,
        "peft": True,
        "host_offload": "auto",
        "liger": True,
        "compile": True,
    },
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json / results.csv / table.md")
    p.add_argument("--rows", default="full7b,lora7b", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--updates", type=int, default=4, help="updates per row; the first is the warm-up")
    p.add_argument("--timeout", type=int, default=480, help="seconds per row")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny smoke shape, 8 + 8 tokens, batch 8")
    p.add_argument("--profile-update", type=int, default=None,
                   help="run this update (0-based, not the first) under torch.profiler and store its top "
                        "operators by device time in the row's 'profile'; it is kept out of the medians, so add "
                        "one to --updates (e.g. --updates 4 --profile-update 3)")  # fmt: skip
    p.add_argument("--cap-gib", type=float, default=None,
                   help="cap the card to this many GiB (79.19: an H100 80 GB's size on a bigger card): memory "
                        "only, the bigger card's speed stays; recorded in each row")  # fmt: skip
    args = p.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]
    if args.cap_gib is not None and not 0 < args.cap_gib < 1024:
        p.error(f"--cap-gib {args.cap_gib}: expected the GiB of the card to plan for, e.g. 79.19")
    if args.profile_update is not None and not 1 <= args.profile_update < args.updates:
        p.error(f"--profile-update {args.profile_update}: expected an update after the first and before "
                f"--updates ({args.updates}), e.g. --updates 4 --profile-update 3")  # fmt: skip
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {', '.join(unknown)}; known: {', '.join(ROWS)}")
    return args


def worker_config(row: str, args: argparse.Namespace) -> dict:
    """The ppo_vs_trl worker's configuration of ``row`` (presets' ``aggressive`` row at this batch)."""
    spec = ROWS[row]
    flags = ["--out", args.out, "--shape", "llama-7b", "--reward", "model", "--value-mode", "fused",
             "--batch", str(spec["batch"]), "--updates", str(args.updates), "--rows", "aggressive"]  # fmt: skip
    if spec["peft"]:
        flags.append("--peft")
    if args.smoke:
        flags.append("--smoke")
    cfg = row_config("aggressive", preset_args(flags))
    cfg["name"], cfg["row"] = f"{row}_b{cfg['batch']}", row
    for key in (
        "host_offload",
        "rollout_kv_cache_dtype",
        "decode_kernels",
        "liger",
        "compile",
        "ref_quant",
        "reward_quant",
    ):
        if key in spec:
            cfg[key] = spec[key]
    if args.cap_gib:
        cfg["gpu_cap_gib"] = args.cap_gib
    if args.profile_update is not None:
        cfg["profile_update"] = args.profile_update
    return cfg


def shape_prediction(row: dict) -> dict | None:
    """The plan of ``row``'s run made from the shape alone for the card it ran on (GiB per phase), or None
    where the run recorded no card (CPU)."""
    from rapidfire_hf.demo.shapes import llama_config, llama_shape
    from rapidfire_hf.memory.card_plan import RunShape, card_plan
    from rapidfire_hf.memory.estimate import DecoderShape
    from rapidfire_hf.memory.kv_choice import plan_kv_cache

    if not row.get("gpu_total_gib"):
        return None
    shape = DecoderShape.from_config(llama_config(llama_shape(row["shape"]), 520))
    kv = row.get("rollout_kv_cache_dtype") or "auto"
    run = RunShape(shape, row["batch"], row["micro"], row["prompt_len"], row["response_len"],
                   value_mode=row["value_mode"], peft=row["peft"], reward_model=row["reward"] == "model",
                   kv_cache_dtype=None if kv in ("auto", "model") else kv)  # fmt: skip
    card, offload = int(row["gpu_total_gib"] * GIB), row.get("host_offload") or "auto"
    if kv == "auto":  # what PPOTrainer's plan chooses (memory.kv_choice)
        plan = plan_kv_cache(run, card, "aggressive", host_offload=offload)[1]
    else:
        plan = card_plan(run, card, "aggressive", host_offload=offload)
    return {
        "peaks": {p: b / GIB for p, b in plan.phase_peak_bytes.items()},
        "choices": {k: getattr(plan, k) for k in ("train_rows", "splits", "checkpointing", "scoring_rows",
                                                   "generation_rows", "free_cache", "optimizer_state",
                                                   "offload_frozen", "offload_state", "kv_cache_dtype",
                                                   "fuse_projections")},
    }  # fmt: skip


def offloaded(plan: dict) -> str:
    """What the plan keeps in host memory between phases: "frozen", "state", both, or "none"."""
    keys = (("frozen", "offload_frozen"), ("state", "offload_state"))
    moved = [name for name, key in keys if plan.get(key)]
    return "+".join(moved) or "none"


def summary(row: dict) -> list[dict]:
    """One line per phase: the plan's prediction, the shape's, the measurement, and the row's speed."""
    plan = row.get("plan") or {}
    measured = row.get("phase_peak_gib") or {}
    shape = row.get("shape_plan") or {}
    out = []
    for phase, key in PHASES.items():
        predicted = (plan.get("phase_peak_bytes") or {}).get(phase)
        got = (measured.get(key) or [None])[-1]
        out.append({
            "row": row.get("row"),
            "phase": phase,
            "planned_gib": predicted / GIB if predicted is not None else None,
            "shape_planned_gib": (shape.get("peaks") or {}).get(phase),
            "measured_gib": got,
            "error": (predicted / GIB - got) / got if predicted is not None and got else None,
            "tokens_per_s": row.get("tokens_per_s"),
            "oom_splits": row.get("oom_splits"),
            "status": row.get("status"),
            "plan": (f"{plan.get('train_rows')} rows in {2 ** plan.get('splits', 0)} piece(s), "
                     f"{plan.get('checkpointing')}, score {plan.get('scoring_rows')}, generate "
                     f"{plan.get('generation_rows')}, {plan.get('optimizer_state')} state, cache "
                     f"{'freed' if plan.get('free_cache') else 'kept'}, offload: {offloaded(plan)}, KV "
                     f"{plan.get('kv_cache_dtype', 'model dtype')}, fused projections "
                     f"{'on' if plan.get('fuse_projections') else 'off'}") if plan else None,
        })  # fmt: skip
    return out


def markdown(lines: list[dict]) -> str:
    def cell(v, fmt="{:.1f}"):
        return "-" if v is None else (fmt.format(v) if isinstance(v, float) else str(v))

    head = (
        "| row | phase | planned GiB | from the shape | measured GiB | error | tokens/s | OOM splits | plan |"
    )
    rows = [head, "|" + "---|" * 9]
    for x in lines:
        rows.append(
            f"| {x['row']} | {x['phase']} | {cell(x['planned_gib'])} | {cell(x['shape_planned_gib'])} | "
            f"{cell(x['measured_gib'])} | {cell(x['error'], '{:+.1%}')} | {cell(x['tokens_per_s'], '{:,.0f}')} | "
            f"{cell(x['oom_splits'])} | {cell(x['plan'])} |"
        )
    return "\n".join(rows) + "\n"


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    env["command"] = " ".join(["python", "benchmarks/card80/run.py", *(argv or sys.argv[1:])])
    rows, lines = [], []
    for i, name in enumerate(args.rows, 1):
        print(f"[{i}/{len(args.rows)}] {name} ...", flush=True)
        row = run_one(worker_config(name, args), out, args.timeout)
        row.pop("shape_kwargs", None)
        row["shape_plan"] = shape_prediction(row) if row.get("shape") == "llama-7b" else None
        rows.append(row)
        lines = [x for r in rows for x in summary(r)]
        write_json(out / "results.json", {"environment": env, "rows": rows, "summary": lines})
        write_csv(out / "results.csv", lines)
        (out / "table.md").write_text(markdown(lines))
        print(markdown(summary(row)), flush=True)
    return lines


if __name__ == "__main__":
    main()
