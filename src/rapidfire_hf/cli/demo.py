"""`rapidfire demo`: PPO on the embedded task, with a live table, a chart and summary.json.

Runs with no downloads: a tiny Llama-style policy built from a config, a character tokenizer built in
code, random-word prompts and a rule-based reward (vowels written, see ``rapidfire_hf.demo.task``).
``--model PATH`` trains any local HF causal LM on the same task instead.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

from rapidfire_hf.cli.demo_config import demo_ppo_config, demo_resume_command

DEMO_HELP = "Train PPO on the embedded demo task (no downloads; minutes on a laptop CPU)."


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help=DEMO_HELP, description=DEMO_HELP)
    p.add_argument("--steps", type=int, default=40, help="PPO updates to run (default 40).")
    p.add_argument(
        "--output-dir", default="rapidfire_demo", help="Where the chart, summary.json and metrics go."
    )
    p.add_argument(
        "--model", default=None, help="Local path of a HF causal LM to train instead of the tiny policy."
    )
    p.add_argument("--config", default=None, help="A rapidfire config: YAML path or preset name.")
    p.add_argument("--batch-size", type=int, default=32, help="Prompts per rollout batch (default 32).")
    p.add_argument(
        "--response-length", type=int, default=12, help="Generated tokens per response (default 12)."
    )
    p.add_argument("--learning-rate", type=float, default=1e-3, help="Learning rate (default 1e-3).")
    p.add_argument(
        "--seed", type=int, default=0, help="Seed of the model init, the prompts and sampling (default 0)."
    )
    p.add_argument("--cpu", action="store_true", help="Stay on the CPU even when a GPU is present.")
    p.add_argument(
        "--resume",
        action="store_true",
        help="Continue from the latest checkpoint in --output-dir (Ctrl-C or SIGTERM writes one), with the "
        "same flags otherwise.",
    )
    p.add_argument(
        "--sweep",
        action="append",
        metavar="FIELD=V1,V2,...",
        help="Train a sweep of LoRA trials on one shared base instead, one trial per value (repeat for a "
        "grid), e.g. --sweep kl_coef=0.01,0.05,0.2; writes sweep_curves.png and summary.json.",
    )
    p.set_defaults(func=run_demo)


def _load_models(args):
    """(tokenizer, policy, value_model or None, value_mode) for the demo or a user's local model."""
    from rapidfire_hf.demo import DemoTask

    if args.model is None:
        tok, policy, value, _ = DemoTask(seed=args.seed).build()
        return tok, policy, value, "separate"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(args.model)
    if not path.exists():
        raise SystemExit(f"--model {args.model}: no such local path (the demo never downloads models).")
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: not a folder of a HF model (no config.json in it)")
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        raise SystemExit(
            f"The tokenizer in {path} has no pad token distinct from EOS; add one (tokenizer.add_special_tokens"
            "({'pad_token': '<pad>'}), resize the model's embeddings) and save both again."
        )
    tok.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(path)
    return tok, policy, None, "fused"


def _check_args(args) -> None:
    """What the flags alone can get wrong, before a model is built (a one-line error, exit 2)."""
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps}: must be at least 1")
    for flag in ("batch_size", "response_length"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.config is not None:
        from rapidfire_hf.config import ConfigError, load_config

        try:
            load_config(args.config)
        except ConfigError as err:
            raise err.with_source(f"--config {args.config}") from None
    if getattr(args, "sweep", None):
        from rapidfire_hf.cli.sweep import demo_trials

        demo_trials(args.sweep)  # unknown or shared fields, before the demo model is built


def _announce_pid() -> None:
    """One line with this process's id and the command that watches it from another shell."""
    import os

    pid = os.getpid()
    print(f"rapidfire demo: pid {pid}; watch its memory with: rapidfire monitor --pid {pid}", flush=True)


def run_demo(args) -> int:
    from rapidfire_hf.demo import make_prompt_dataset, vowel_reward
    from rapidfire_hf.demo.chart import plot_demo_chart
    from rapidfire_hf.ppo import PPOTrainer
    from rapidfire_hf.utils.reporting import LiveTableCallback

    _check_args(args)
    _announce_pid()
    if getattr(args, "sweep", None):
        from rapidfire_hf.cli.sweep import run_demo_sweep

        return run_demo_sweep(args)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, policy, value, value_mode = _load_models(args)
    ppo_args = demo_ppo_config(args, out_dir)
    ppo_args.value_mode = value_mode
    live = LiveTableCallback(
        columns={
            "objective/scores": "reward",
            "objective/kl": "KL",
            "response_length": "resp len",
            "loss/value_avg": "value loss",
            "tokens_per_second": "tok/s",
        },
        title="rapidfire demo: PPO on the vowel task",
    )
    trainer = PPOTrainer(
        args=ppo_args,
        processing_class=tok,
        model=policy,
        value_model=value,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(max(512, args.batch_size * 4), seed=args.seed),
        callbacks=[live],
    )
    trainer.remove_progress_callbacks()
    start = time.perf_counter()
    from rapidfire_hf.utils.interrupt import TrainingInterrupted

    try:
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    except TrainingInterrupted as err:  # the checkpoint is named; say how to continue from the shell
        text = str(err).replace("train(resume_from_checkpoint=True)", f"`{demo_resume_command()}`")
        raise TrainingInterrupted(text, err.checkpoint) from None
    except FileNotFoundError as err:
        if not args.resume:
            raise
        raise SystemExit(f"--resume: {err}; run the demo without --resume to start it") from None
    wall = time.perf_counter() - start
    history = [h for h in trainer.state.log_history if "objective/scores" in h]
    summary = _write_outputs(out_dir, history, wall, trainer)
    live.console.print(
        f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} in {wall:.0f} s on "
        f"{summary['device']}; chart: {out_dir / 'demo_curves.png'}"
    )
    if summary["pipelined_steps"] is not None:
        live.console.print(
            f"gradient pipeline: {summary['pipelined_steps']} optimizer steps pipelined, clip-prediction "
            f"miss rate {summary['clip_miss_rate']:.1%}, {summary['skipped_steps']} steps skipped"
            + _deferred_note(summary["deferred_steps"])
        )
    plot_demo_chart(history, out_dir / "demo_curves.png", ppo_args)  # with the reward's range, the KL scale
    return 0


def _write_outputs(out_dir: Path, history: list[dict], wall: float, trainer) -> dict:
    keys = sorted({k for h in history for k in h})
    with open(out_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)
    summary = {
        "reward_first": history[0]["objective/scores"],
        "reward_last": history[-1]["objective/scores"],
        "kl_last": history[-1]["objective/kl"],
        "updates": len(history),
        "wall_seconds": round(wall, 2),
        "device": str(trainer.accelerator.device),
        "rollout_backend": trainer.run_state.rollout_backend,
        "tokens_per_second_mean": sum(h["tokens_per_second"] for h in history) / len(history),
        # the gradient pipeline (a rapidfire config): windows stepped inside backward, predicted clip misses
        **_optimizer_summary(trainer),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _deferred_note(deferred: dict | None) -> str:
    """Why steps were not pipelined, in words (``clip_may_bind``: gradient.clip_prediction 'exact')."""
    if not deferred:
        return ""
    words = {"clip_may_bind": "clipping could bind (stepped exactly after backward)",
             "recent_clip_miss": "backing off after a clip-prediction miss"}  # fmt: skip
    parts = [f"{n} because {words.get(reason, reason)}" for reason, n in sorted(deferred.items())]
    return "; not pipelined: " + ", ".join(parts)


def _optimizer_summary(trainer) -> dict:
    """Pipelined steps, clip-prediction miss rate and skipped steps of a RapidFireOptimizer (None without)."""
    opt = trainer.rapidfire_optimizer
    if opt is None:
        return {
            "pipelined_steps": None,
            "clip_miss_rate": None,
            "skipped_steps": None,
            "deferred_steps": None,
        }
    stats = opt.stats()
    return {
        "pipelined_steps": stats["pipelined_steps"],
        "clip_miss_rate": stats["clip_misses"] / max(1, stats["clip_checks"]),
        "skipped_steps": stats["skipped"] - stats["clip_misses"],
        "deferred_steps": dict(stats["deferred_steps"]),  # reason -> optimizer steps stepped after backward
    }


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - `python -m rapidfire_hf.cli.demo`
    parser = argparse.ArgumentParser(prog="rapidfire demo")
    sub = parser.add_subparsers()
    add_parser(sub)
    ns = parser.parse_args(["demo", *(argv or [])])
    return ns.func(ns)
