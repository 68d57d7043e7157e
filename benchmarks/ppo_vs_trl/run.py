"""Stock TRL 1.12 PPO against rapidfire_hf PPO on the same GPU, in the same run.

    # on the GPU machine, with trl 1.12.0 installed in its own directory (never beside trl 1.16):
    TRL112_PATH=/tmp/site112 python benchmarks/ppo_vs_trl/run.py --out benchmarks/ppo_vs_trl/results
    python benchmarks/ppo_vs_trl/run.py --out /tmp/ppo_smoke --smoke      # tiny shape on CPU
    TRL112_PATH=/tmp/site112 python benchmarks/ppo_vs_trl/run.py --out DIR --part size7b   # 7B part

Four parts (`--part`, default "throughput,learning"; size7b and sweep run only when asked for), each
configuration in its own subprocess (clean peak-memory numbers; an OOM ends only that configuration):

* throughput: the 1.1B Llama shape of the README's numbers (hidden 2048, 22 layers, 32 heads, 4 KV heads, vocab
  32000), 128 prompt + 384 response tokens, 1 PPO epoch, separate policy / reference / value / reward
  models, bf16, for several rollout batch sizes: seconds per update (median of the timed updates after a
  warm-up update), generation share, peak GPU memory, tokens/s = batch * (prompt + response) / s.
* learning: a smaller shape on a rule-based reward (the share of response tokens from a target set,
  computed by a reward "model" both trainers call the same way), the same number of updates for stock
  TRL, ours with a separate value model and ours with the fused value head: reward per update.
* size7b: the 7B Llama shape (Llama-2-7B: hidden 4096, 32 layers, 32 heads, 32 KV heads, intermediate
  11008, vocab 32000), rollout batch 8, 128 prompt + 128 response tokens, 2 updates (the second timed),
  built directly on the GPU in bf16. For stock TRL, ours with a separate value model and ours with the
  fused value head, each with full fine-tuning and with LoRA (r=16, alpha 32, q/k/v/o projections of the
  policy, through each trainer's `peft_config`; the reference is then the adapter-disabled base, and a
  separate value model is still trained in full, as both trainers ship): status ok / oom / error, peak
  GPU memory, s/update, tokens/s. What fits on one GPU is the finding; an OOM row is a result.
* sweep: N LoRA trials that differ in kl_coef and seed, each at one rollout batch: stock TRL running
  them one after another, ours (`PPOTrainer`) one after another, and `PPOSweep` training all N on one
  shared base. The sequential cost of N trials is the sum of their seconds per update; `summarize.py
  --sweep` sets it against one PPOSweep round (`--sweep-trials`, `--sweep-batch`, `--sweep-systems`).

Writes results.json (GPU, versions, date, command, one row per configuration), results.csv and
ppo_vs_trl.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rapidfire_hf.demo.shapes import FAMILY_SHAPES, LLAMA_SHAPES, llama_shape

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import environment as common_environment  # noqa: E402
from benchmarks.common import write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
# rapidfire_hf.demo.shapes, plus the learning part's shapes: a 64-token vocabulary, so that each target
# token is sampled often enough per rollout batch for PPO to learn the rule reward within tens of updates
# (with 512 or 32000 tokens and 1/16 of them targets, no trainer moved off chance in 25-40 updates)
SHAPES = {
    **LLAMA_SHAPES,
    "learn-tiny": llama_shape("smoke", vocab_size=64),  # hidden 64, 2 layers: the CPU run
    "learn-small": llama_shape("llama-tiny", vocab_size=64),  # hidden 256, 4 layers: the GPU default
    # other decoder families at their published size (the worker builds them from FAMILY_SHAPES)
    **{name: {"family": name, "vocab_size": kw["vocab_size"]} for name, (_, kw) in FAMILY_SHAPES.items()},
}


# a family shape's config overrides under --smoke: the family's classes at a CPU size
FAMILY_SMOKE = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
)

PARTS = ("throughput", "learning", "size7b", "sweep")
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def run_one(cfg: dict, out_dir: Path, timeout: int) -> dict:
    """Run one configuration in a fresh interpreter; returns its result row (or the failure)."""
    env = dict(os.environ)
    if cfg["system"] == "trl":
        trl_path = os.environ.get("TRL112_PATH")
        if not trl_path:
            return {**cfg, "status": "skipped", "error": "TRL112_PATH is not set (trl 1.12.0 install dir)"}
        env["PYTHONPATH"] = trl_path + os.pathsep + env.get("PYTHONPATH", "")
    # a file of its own: runs of one configuration name in parallel (e.g. at two learning rates) must not
    # read each other's rows
    fd, name = tempfile.mkstemp(prefix=f"ppo_vs_trl_row_{cfg['name']}_", suffix=".json")
    os.close(fd)
    result_file = Path(name)
    result_file.unlink()
    cmd = [sys.executable, str(HERE / "worker.py"), json.dumps(cfg), str(result_file)]
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {**cfg, "status": "timeout", "error": f"over {timeout} s"}
    if result_file.is_file():
        row = json.loads(result_file.read_text())
        result_file.unlink()
        return row
    tail = (proc.stdout + proc.stderr)[-1500:]
    status = "oom" if "OutOfMemoryError" in tail or "out of memory" in tail else "error"
    return {**cfg, "status": status, "error": tail}


def parse_variant(text: str) -> dict:
    """One speed-up variant of our trainer: "base", or knobs joined by "+": "liger", "compile", "m<N>"
    (micro-batch N). E.g. "liger+compile+m32"."""
    knobs = {"liger": False, "compile": False, "micro": None}
    for part in [x for x in text.split("+") if x and x != "base"]:
        if part in ("liger", "compile"):
            knobs[part] = True
        elif part.startswith("m") and part[1:].isdigit() and int(part[1:]) > 0:
            knobs["micro"] = int(part[1:])
        else:
            raise argparse.ArgumentTypeError(
                f"unknown variant knob {part!r} in {text!r}: use base, liger, compile, m<N> joined by '+'"
            )
    return knobs


def variant_list(text: str) -> list[dict]:
    return [parse_variant(v) for v in text.split(",") if v]


def with_variant(row: dict, knobs: dict, args) -> dict:
    """A throughput row of ours with a speed-up variant: the knobs recorded in the row, a name suffix
    (_liger, _compile, _m<N>; none for the baseline) and, with compile, the backend and mode."""
    micro = min(knobs["micro"], row["batch"]) if knobs["micro"] else row["micro"]  # smoke: batch 8
    suffix = ("_liger" if knobs["liger"] else "") + ("_compile" if knobs["compile"] else "")
    suffix += f"_m{micro}" if knobs["micro"] else ""
    tags = [k for k in ("liger", "compile") if knobs[k]] + ([f"m{micro}"] if knobs["micro"] else [])
    out = {
        **row,
        "name": row["name"] + suffix,
        "micro": micro,
        "variant": "+".join(tags) or "base",
        "liger": knobs["liger"],
        "compile": knobs["compile"],
        "rollout_decode_mode": args.ours_decode_mode,
    }
    if knobs["compile"]:
        out.update(compile_backend=args.ours_compile_backend, compile_mode=args.ours_compile_mode)
    if getattr(args, "ours_gen_chunk", None):  # rollout_generation_batch_size: prompts generated at once
        out["rollout_generation_batch_size"] = args.ours_gen_chunk
        out["name"] += f"_g{args.ours_gen_chunk}"
    if getattr(args, "ours_score_chunk", None):  # local_rollout_forward_batch_size of ours (default: batch)
        out["score_chunk"] = args.ours_score_chunk
        out["name"] += f"_s{args.ours_score_chunk}"
    if getattr(args, "ours_decode_kernels", None):  # "fuse", "triton" or "fuse+triton" (worker.DECODE_KERNELS)
        out["decode_kernels"] = args.ours_decode_kernels
        out["name"] += "_" + args.ours_decode_kernels.replace("+", "_")
    return out


def configs(args) -> list[dict]:
    rows = []
    parts = set(args.part)
    common = dict(
        shape=args.shape,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        updates=args.updates,
        micro=args.micro,
        part="throughput",
    )
    for system, batches in (("trl", args.trl_batches), ("rapidfire", args.our_batches)):
        if "throughput" not in parts:
            break
        for b in batches:
            row = {
                **common,
                "system": system,
                "value_mode": "separate",
                "batch": b,
                "name": f"tp_{system}_b{b}",
            }
            rows += [row] if system == "trl" else [with_variant(row, v, args) for v in args.ours_variants]
    for b in args.fused_batches if "throughput" in parts else []:
        row = {**common, "system": "rapidfire", "value_mode": "fused", "batch": b, "name": f"tp_fused_b{b}"}
        rows += [with_variant(row, v, args) for v in args.fused_variants]
    learn = dict(
        shape=args.learn_shape,
        prompt_len=args.learn_prompt_len,
        response_len=args.learn_response_len,
        updates=args.learn_updates,
        micro=args.learn_batch,
        batch=args.learn_batch,
        part="learning",
        lr=args.learn_lr,
        kl_coef=args.learn_kl_coef,
        target_mod=args.learn_target_mod,
        temperature=args.learn_temperature,
        max_grad_norm=args.learn_max_grad_norm,
        dtype=args.learn_dtype,
    )
    if args.learn_updates > 0 and "learning" in parts:
        for seed in args.learn_seeds:
            for system, mode in (("trl", "separate"), ("rapidfire", "separate"), ("rapidfire", "fused")):
                name = f"learn_{system}_{mode}_s{seed}"
                rows.append({**learn, "system": system, "value_mode": mode, "seed": seed, "name": name})
    size = dict(
        shape=args.size_shape,
        prompt_len=args.size_prompt_len,
        response_len=args.size_response_len,
        updates=args.size_updates,
        micro=args.size_micro,
        batch=args.size_batch,
        part="size7b",
        timeout=args.size_timeout,
        reward=args.size_reward,
    )
    if "size7b" in parts:
        for system, mode, tag in (
            ("trl", "separate", "trl"),
            ("rapidfire", "separate", "rapidfire"),
            ("rapidfire", "fused", "fused"),
        ):
            for peft in (None, "lora"):
                for batch in (
                    args.size_batches_trl if system == "trl" else [args.size_batch_ours or args.size_batch]
                ):
                    row = {
                        **size,
                        "batch": batch,
                        "system": system,
                        "value_mode": mode,
                        "peft": peft,
                        **({"lora": LORA} if peft else {}),
                        "name": f"s7_{tag}_{peft or 'full'}"
                        + (f"_b{batch}" if batch != args.size_batch else ""),
                    }
                    if system == "rapidfire":  # ours: its own micro-batch and generation/scoring chunks
                        row["micro"] = min(args.size_micro_ours or args.size_micro, batch)
                        if args.ours_gen_chunk:
                            row["rollout_generation_batch_size"] = args.ours_gen_chunk
                        if args.ours_score_chunk:
                            row["score_chunk"] = args.ours_score_chunk
                        for key in ("optimizer", "ref_quant", "reward_quant"):
                            if getattr(args, f"ours_{key}"):
                                row[key] = getattr(args, f"ours_{key}")
                    rows.append(row)
    return rows + (sweep_configs(args) if "sweep" in parts else [])


SWEEP_KL = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)  # trial i's kl_coef (then 1.0 + i)


def sweep_configs(args) -> list[dict]:
    """Part "sweep": N LoRA trials (trial i: kl_coef SWEEP_KL[i], seed i) run three ways, each trial at
    rollout batch --sweep-batch: stock TRL one trial after another (sw_trl_t<i>, LoRA with its separate
    value model), our PPOTrainer one trial after another (sw_rapidfire_t<i>, LoRA, fused value head) and
    PPOSweep with all N trials on one base (sw_sweep_n<N>). The sequential rows run once for the largest N;
    the N-trial cost of a sequential sweep is the sum over its first N trials (summarize.py --sweep)."""
    base = dict(
        shape=args.sweep_shape,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        updates=args.sweep_updates,
        micro=min(args.micro, args.sweep_batch),
        batch=args.sweep_batch,
        part="sweep",
        peft="lora",
        lora=LORA,
        reward=args.sweep_reward,
    )
    kl = [SWEEP_KL[i] if i < len(SWEEP_KL) else 1.0 + i for i in range(max(args.sweep_trials))]
    rows = []
    for system, mode, tag in (("trl", "separate", "trl"), ("rapidfire", "fused", "rapidfire")):
        if tag in args.sweep_systems:
            rows += [
                {
                    **base,
                    "system": system,
                    "value_mode": mode,
                    "name": f"sw_{tag}_t{i}",
                    "trial": i,
                    "kl_coef": kl[i],
                    "seed": i,
                }
                for i in range(max(args.sweep_trials))
            ]
    if "sweep" in args.sweep_systems:
        rows += [
            {
                **base,
                "system": "sweep",
                "value_mode": "fused",
                "name": f"sw_sweep_n{n}",
                "trials": n,
                "trial_kl": kl[:n],
            }
            for n in args.sweep_trials
        ]
    return rows


def environment() -> dict:
    """``benchmarks.common.environment`` plus the two settings that change this benchmark's stock side."""
    return common_environment(
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"), trl112_path=os.environ.get("TRL112_PATH")
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = [r for r in rows if r.get("part") == "size7b"]
    fig, axes = plt.subplots(1, 4 if size else 3, figsize=(21 if size else 16, 4.2))
    tp = [r for r in rows if r["part"] == "throughput"]
    series = [("stock TRL 1.12", lambda r: r["system"] == "trl")]
    for mode in ("separate", "fused"):
        # one line per speed-up variant of ours (--ours-variants), the baseline first
        ours = [r for r in tp if r["system"] == "rapidfire" and r["value_mode"] == mode]
        variants = sorted({r.get("variant", "base") for r in ours} | {"base"}, key=lambda v: (v != "base", v))
        for v in variants:
            label = f"rapidfire ({mode} value)" + (f" [{v}]" if v != "base" else "")
            series.append(
                (
                    label,
                    lambda r, mode=mode, v=v: (
                        r["system"] == "rapidfire"
                        and r["value_mode"] == mode
                        and r.get("variant", "base") == v
                    ),
                )
            )
    for label, keep in series:
        ok = [r for r in tp if keep(r) and r.get("status") == "ok"]
        failed = [r for r in tp if keep(r) and r.get("status") != "ok"]
        line = axes[0].plot(
            [r["batch"] for r in ok], [r["tokens_per_s"] for r in ok], marker="o", label=label
        )
        axes[1].plot([r["batch"] for r in ok], [r["peak_gib"] for r in ok], marker="o", label=label)
        for r in failed:
            axes[0].annotate(r.get("status", "?").upper(), (r["batch"], 0), color=line[0].get_color())
    log = any(r.get("status") == "ok" for r in tp)  # log axes need data
    axes[0].set(
        xscale="log" if log else "linear",
        yscale="log" if log else "linear",
        xlabel="rollout batch",
        ylabel="tokens / s",
        title="PPO throughput",
    )
    axes[1].set(
        xscale="log" if log else "linear", xlabel="rollout batch", ylabel="peak GiB", title="peak GPU memory"
    )
    plot_learning(axes[2], [r for r in rows if r["part"] == "learning" and r.get("status") == "ok"])
    if size:
        plot_size(axes[3], size)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


LEARN_SYSTEMS = (("trl", "separate"), ("rapidfire", "separate"), ("rapidfire", "fused"))


def learning_curves(rows: list[dict]) -> dict:
    """Reward per update of each (system, value mode) of the last learning shape: the mean over its
    seeds, with the per-seed minimum and maximum and first / last / max / mean-of-last-5 of the mean."""
    shape = rows[-1]["shape"] if rows else None
    curves = {}
    for system, mode in LEARN_SYSTEMS:
        runs = [
            r["rewards"] for r in rows if (r["shape"], r["system"], r["value_mode"]) == (shape, system, mode)
        ]
        runs = [x for x in runs if x]
        if not runs:
            continue
        n = min(len(x) for x in runs)
        mean = [sum(x[i] for x in runs) / len(runs) for i in range(n)]
        curves[f"{system}_{mode}"] = {
            "shape": shape,
            "seeds": len(runs),
            "mean": mean,
            "min": [min(x[i] for x in runs) for i in range(n)],
            "max": [max(x[i] for x in runs) for i in range(n)],
            "first": mean[0],
            "last": mean[-1],
            "best": max(mean),
            "last5": sum(mean[-5:]) / len(mean[-5:]),
        }
    return curves


def plot_learning(ax, rows: list[dict]) -> None:
    """Reward per update of the three systems (mean over seeds, the band spans the seeds)."""
    labels = {
        "trl_separate": "stock TRL 1.12",
        "rapidfire_separate": "rapidfire (separate value)",
        "rapidfire_fused": "rapidfire (fused value)",
    }
    curves = learning_curves(rows)
    for key, c in curves.items():
        x = range(1, len(c["mean"]) + 1)
        line = ax.plot(x, c["mean"], label=f"{labels[key]}, {c['seeds']} seed(s)")
        if c["seeds"] > 1:
            ax.fill_between(x, c["min"], c["max"], color=line[0].get_color(), alpha=0.15)
    shape = next(iter(curves.values()))["shape"] if curves else None
    chance = None
    if rows and rows[-1].get("target_mod"):
        chance = 1 / rows[-1]["target_mod"]
        ax.axhline(chance, color="gray", linestyle=":", linewidth=0.8)
    ax.set(
        xlabel="PPO update",
        ylabel="mean reward of the rollout batch",
        title=f"learning, {shape}, rule reward"
        + (f" (dotted: 1/{rows[-1]['target_mod']})" if chance else ""),
    )


def plot_size(ax, rows: list[dict]) -> None:
    """size7b: peak memory per configuration, coloured by status, labelled with tokens/s or the status."""
    colors = {"ok": "tab:green", "oom": "tab:red"}
    names = [r["name"].removeprefix("s7_") for r in rows]
    peaks = [r.get("peak_gib") or 0.0 for r in rows]
    ax.bar(names, peaks, color=[colors.get(r.get("status"), "tab:gray") for r in rows])
    for i, r in enumerate(rows):
        label = f"{r['tokens_per_s']:,.0f} tok/s" if r.get("status") == "ok" else str(r.get("status")).upper()
        ax.annotate(label, (i, peaks[i]), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    total = next((r["gpu_total_gib"] for r in rows if r.get("gpu_total_gib")), None)
    if total:
        ax.axhline(total, color="black", linestyle="--", linewidth=0.8)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    shape = rows[0].get("shape")
    ax.set(
        ylabel="peak GiB (at the end or at the OOM)", title=f"{shape}: what fits (batch {rows[0]['batch']})"
    )


def write_outputs(out: Path, rows: list[dict], env: dict) -> None:
    import csv

    data = {"environment": env, "rows": rows}
    learning = learning_curves([r for r in rows if r.get("part") == "learning" and r.get("status") == "ok"])
    if learning:  # first / last / best / mean of the last 5 updates of the seed-mean curve, per system
        data["learning_summary"] = {
            k: {m: c[m] for m in ("shape", "seeds", "first", "last", "best", "last5")}
            for k, c in learning.items()
        }
    write_json(out / "results.json", data)
    keys = [
        "name",
        "part",
        "shape",
        "system",
        "value_mode",
        "peft",
        "batch",
        "variant",
        "micro",
        "status",
        "s_per_update",
        "gen_share",
        "score_s",
        "train_s",
        "peak_gib",
        "tokens_per_s",
        "trainable_params",
        "build_s",
        "reward_first",
        "reward_last",
        "run_command",
        "date",
    ]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "ppo_vs_trl.png")


def merge(out: Path, files: list[str]) -> None:
    """Combine the rows of several runs (each keeps its own command and date) into one result set."""
    rows, envs = [], []
    for f in files:
        data = json.loads(Path(f).read_text())
        envs.append(data["environment"])
        for r in data["rows"]:
            rows.append(
                {
                    **r,
                    "run_command": data["environment"].get("command"),
                    "date": data["environment"].get("date"),
                }
            )
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(out, rows, {"merged_from": envs, "gpu": envs[0].get("gpu")})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--smoke", action="store_true", help="tiny shape, CPU, our system only unless TRL112_PATH is set"
    )
    p.add_argument("--shape", default="llama-1.1b", choices=SHAPES)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=384)
    p.add_argument("--updates", type=int, default=3, help="updates per throughput config (first is warm-up)")
    p.add_argument("--micro", type=int, default=8, help="micro-batch (per_device_train_batch_size)")
    p.add_argument("--trl-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[8, 32, 64])
    p.add_argument(
        "--our-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[8, 32, 64, 256]
    )
    p.add_argument("--fused-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[64, 256])
    p.add_argument("--learn-shape", default="learn-small", choices=SHAPES)
    p.add_argument("--learn-updates", type=int, default=30)
    p.add_argument("--learn-batch", type=int, default=32)
    p.add_argument(
        "--learn-lr",
        type=float,
        default=3e-4,
        help="learning rate of every learning run (3e-3 was tuned on learn-tiny; on learn-small it made both "
        "trainers collapse onto the pad token, results/cpu/learning_learn_small/)",
    )
    p.add_argument("--learn-kl-coef", type=float, default=0.01)
    p.add_argument("--learn-target-mod", type=int, default=4, help="reward: share of response ids %% N == 0")
    p.add_argument("--learn-temperature", type=float, default=1.0)
    p.add_argument(
        "--learn-max-grad-norm",
        type=float,
        default=0.0,
        help="ours only: gradient clipping (0 = off, as TRL 1.12's PPO, which never clips)",
    )
    p.add_argument(
        "--learn-dtype",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="weights + mixed precision of the learning runs: auto = bf16 on the GPU, fp32 on the CPU",
    )
    p.add_argument("--learn-seeds", type=lambda s: [int(x) for x in s.split(",") if x], default=[0, 1, 2])
    p.add_argument("--learn-prompt-len", type=int, default=8)
    p.add_argument("--learn-response-len", type=int, default=16)
    p.add_argument(
        "--part",
        type=lambda s: [x for x in s.split(",") if x],
        default=["throughput", "learning"],
        help=f"comma-separated parts to run, of {', '.join(PARTS)} (size7b and sweep only when named)",
    )
    p.add_argument("--size-shape", default="llama-7b", choices=SHAPES)
    p.add_argument("--size-batch", type=int, default=8)
    p.add_argument("--size-micro", type=int, default=8)
    p.add_argument(
        "--size-batches-trl",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=None,
        help="size7b: stock TRL's rollout batches, one row each (default --size-batch)",
    )
    p.add_argument(
        "--size-batch-ours", type=int, default=None, help="size7b: our rollout batch (default --size-batch)"
    )
    p.add_argument(
        "--size-micro-ours", type=int, default=None, help="size7b: our micro-batch (default --size-micro)"
    )
    p.add_argument("--size-updates", type=int, default=2, help="updates per size7b config (first is warm-up)")
    p.add_argument("--size-prompt-len", type=int, default=128)
    p.add_argument("--size-response-len", type=int, default=128)
    p.add_argument("--size-timeout", type=int, default=300, help="seconds per size7b configuration")
    p.add_argument(
        "--size-reward",
        default="rule",
        choices=["rule", "model"],
        help="size7b reward, the same for both trainers: 'rule' (a rule reward behind a reward-model interface, "
        "no weights) or 'model' (a sequence-classification model of the policy's shape, bf16, random init)",
    )
    p.add_argument(
        "--sweep-trials",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[4],
        help="sweep: numbers of trials N, one PPOSweep row each (the sequential rows run max(N) trials)",
    )
    p.add_argument("--sweep-batch", type=int, default=32, help="sweep: rollout batch of each trial")
    p.add_argument("--sweep-updates", type=int, default=4, help="sweep: updates per trial (first is warm-up)")
    p.add_argument("--sweep-shape", default="llama-1.1b", choices=SHAPES)
    p.add_argument("--sweep-reward", default="rule", choices=["rule", "model"], help="as --size-reward")
    p.add_argument(
        "--sweep-systems",
        type=lambda s: [x for x in s.split(",") if x],
        default=["trl", "rapidfire", "sweep"],
        help="sweep: which of trl (stock, one trial after another), rapidfire (ours, one after another) "
        "and sweep (PPOSweep) to run",
    )
    p.add_argument("--timeout", type=int, default=240, help="seconds per configuration")
    p.add_argument("--only", default=None, help="run only configurations whose name starts with this prefix")
    p.add_argument(
        "--rollout-backend", default="auto", choices=["auto", "static", "hf"], help="our rollout engine"
    )
    ours = p.add_argument_group(
        "speed-ups of our trainer (throughput part; TRL rows keep --micro and stock settings)",
        "Each of our throughput rows runs once per variant. Without --ours-variants, the single variant "
        "the three switches below describe (none: the baseline, named as before).",
    )
    ours.add_argument("--ours-liger", action="store_true", help="use_liger_kernel=True (CUDA only)")
    ours.add_argument("--ours-compile", action="store_true", help="torch_compile=True: each decoder layer")
    ours.add_argument("--ours-micro", type=int, default=None, help="micro-batch of ours (default --micro)")
    ours.add_argument(
        "--ours-variants",
        type=variant_list,
        default=None,
        help="comma-separated variants, each 'base' or knobs joined by '+': liger, compile, m<N>; e.g. "
        "'base,liger,compile,liger+compile,m32' (names get _liger, _compile, _m<N>)",
    )
    ours.add_argument(
        "--fused-variants",
        type=variant_list,
        default=None,
        help="for the fused rows (default: --ours-variants)",
    )
    ours.add_argument(
        "--ours-compile-backend",
        default=None,
        help="torch_compile_backend (default inductor; --smoke: aot_eager)",
    )
    ours.add_argument("--ours-compile-mode", default=None, help="torch_compile_mode (default: torch's)")
    ours.add_argument(
        "--ours-decode-mode",
        default="auto",
        choices=["auto", "compile", "cuda_graph", "eager"],
        help="rollout_decode_mode of ours (auto: the compiled decode step, ~25 s of compilation per "
        "configuration; cuda_graph: recorded uncompiled, no compilation, slower decode)",
    )
    ours.add_argument(
        "--ours-decode-kernels",
        default=None,
        choices=["fuse", "triton", "fuse+triton", "skinny", "tattn", "sdpa", "fuse+tattn", "nofuse"],
        help="decode-step options of ours: fuse = rollout_decode_fuse_projections, triton = the Triton "
        "attention and sampler (rollout_decode_attention / rollout_decode_sampler 'triton'), skinny = fused "
        "projections through the Triton skinny matmul (rollout_decode_linear 'triton'), tattn = the Triton "
        "attention alone, sdpa = SDPA attention named explicitly, nofuse = the module projections "
        "(rollout_decode_fuse_projections=False, the default until 2026-12-04); default none",
    )
    ours.add_argument(
        "--ours-gen-chunk",
        type=int,
        default=None,
        help="rollout_generation_batch_size of ours: generate the rollout batch this many prompts at a time "
        "(bounds the KV cache, for rollout batches larger than one generation fits); rows get _g<N>",
    )
    ours.add_argument(
        "--ours-score-chunk",
        type=int,
        default=None,
        help="local_rollout_forward_batch_size of ours (rows per scoring forward; default: the rollout batch, "
        "as TRL gets); rows get _s<N>",
    )
    ours.add_argument(
        "--ours-optimizer",
        default=None,
        choices=["adamw8bit", "adamw8bit_nopipe"],
        help="size7b: our optimizer, RapidFireOptimizer over bitsandbytes' AdamW8bit with the gradient pipeline "
        "(adamw8bit) or without it (adamw8bit_nopipe); default: the trainer's fused AdamW",
    )
    ours.add_argument(
        "--ours-ref-quant",
        default=None,
        choices=["8bit", "4bit"],
        help="size7b: ref_model_quantization of ours",
    )
    ours.add_argument(
        "--ours-reward-quant",
        default=None,
        choices=["8bit", "4bit"],
        help="size7b: reward_model_quantization of ours (with --size-reward model)",
    )
    args = p.parse_args(argv)
    if args.size_batches_trl is None:
        args.size_batches_trl = [args.size_batch]
    for flag in ("ours_gen_chunk", "ours_score_chunk"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.ours_variants is None:
        if args.ours_micro is not None and args.ours_micro < 1:
            p.error("--ours-micro must be >= 1")
        args.ours_variants = [
            {"liger": args.ours_liger, "compile": args.ours_compile, "micro": args.ours_micro}
        ]
    elif args.ours_liger or args.ours_compile or args.ours_micro is not None:
        p.error("--ours-variants replaces --ours-liger/--ours-compile/--ours-micro: give one or the others")
    if args.fused_variants is None:
        args.fused_variants = args.ours_variants
    if set(args.sweep_systems) - {"trl", "rapidfire", "sweep"} or not args.sweep_systems:
        p.error(f"--sweep-systems {args.sweep_systems}: choose from trl, rapidfire, sweep")
    if not args.sweep_trials or min(args.sweep_trials) < 1 or args.sweep_batch < 1:
        p.error("--sweep-trials needs numbers >= 1 and --sweep-batch must be >= 1")
    unknown = set(args.part) - set(PARTS)
    if unknown:
        p.error(f"unknown --part {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.smoke:
        # a family shape stays that family, shrunk (FAMILY_SMOKE): its classes and switches run on the CPU
        args.shape = args.shape if args.shape in FAMILY_SHAPES else "smoke"
        args.learn_shape = "learn-tiny"
        args.prompt_len, args.response_len, args.updates, args.micro = 8, 8, 2, 4
        args.trl_batches, args.our_batches, args.fused_batches = [8], [8], [8]
        args.learn_updates, args.learn_batch, args.learn_prompt_len, args.learn_response_len = 3, 8, 8, 8
        args.size_shape, args.size_prompt_len, args.size_response_len, args.size_micro = "smoke", 8, 8, 4
        args.sweep_shape, args.sweep_updates, args.sweep_batch = "smoke", 2, 4
        if args.ours_compile_backend is None:  # inductor on a 2-core CPU takes minutes per graph
            args.ours_compile_backend = "aot_eager"
    return args


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "merge":  # run.py merge OUT results1.json results2.json ...
        merge(Path(sys.argv[2]), sys.argv[3:])
        return
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for cfg in configs(args):
        if args.only and not cfg["name"].startswith(args.only):
            continue
        cfg["shape_kwargs"] = dict(SHAPES[cfg["shape"]])
        if args.smoke and cfg["shape"] in FAMILY_SHAPES:
            cfg["shape_kwargs"].update(overrides=FAMILY_SMOKE, vocab_size=FAMILY_SMOKE["vocab_size"])
        cfg["rollout_backend"] = args.rollout_backend
        row = run_one(cfg, out, cfg.pop("timeout", args.timeout))
        rows.append(row)
        keys = ("name", "status", "s_per_update", "gen_share", "peak_gib", "tokens_per_s")
        if row.get("score_s") is not None:
            keys += ("score_s", "train_s")
        if cfg["part"] == "learning":
            keys += ("reward_first", "reward_max", "reward_last5")
        brief = {k: row.get(k) for k in keys}
        if row.get("status") not in ("ok", None):
            brief["error"] = str(row.get("error", ""))[-200:]
        print(json.dumps(brief), flush=True)
        write_outputs(out, rows, environment())


if __name__ == "__main__":
    main()
