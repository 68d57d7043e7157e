"""`rapidfire sweep`: run a PPO sweep from YAML, or control a running one from another shell.

    rapidfire sweep SWEEP.yaml                        # run (see rapidfire_hf.sweep.spec for the format)
    rapidfire sweep SWEEP.yaml --resume               # continue it from its checkpoints (after a crash,
                                                      # or with a larger max_steps)
    rapidfire sweep SWEEP.yaml --plan                 # print the throughput plan of its first update, no training
    rapidfire sweep ctl --dir out/sweep stop kl0.2    # stop a trial at the next update boundary
    rapidfire sweep ctl --dir out/sweep resume kl0.2
    rapidfire sweep ctl --dir out/sweep clone kl0.05 kl0.05-lr2 learning_rate=2e-5
    rapidfire sweep ctl --dir out/sweep status

``rapidfire demo --sweep kl_coef=0.01,0.05,0.2`` (see :func:`run_demo_sweep`) runs a sweep on the embedded
demo task.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

SWEEP_HELP = "Run many LoRA PPO trials at once on one shared base (SWEEP.yaml), or control one (ctl)."


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("sweep", help=SWEEP_HELP, description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="SWEEP.yaml to run, or `ctl` to control a running sweep")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="for ctl: --dir DIR {stop,resume,clone,status} ...")
    p.add_argument("--no-progress", action="store_true", help="No live table (for logs and CI).")
    p.add_argument(
        "--resume", action="store_true", help="Continue every trial from its latest complete checkpoint."
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="Print the throughput plan of the first update (rows per training forward across trials, "
        "scoring chunk, planned peak) and exit without training.",
    )
    p.set_defaults(func=run_sweep_command)


def _ctl_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rapidfire sweep ctl", description="Control a running sweep.")
    p.add_argument("--dir", required=True, help="The sweep's output_dir.")
    p.add_argument("op", choices=("stop", "resume", "clone", "status"))
    p.add_argument("names", nargs="*", help="stop/resume: TRIAL; clone: SRC NEW [field=value ...]")
    return p


def run_sweep_command(args) -> int:
    if args.target == "ctl":
        return run_ctl(_ctl_parser().parse_args(args.rest))
    flags = ("--no-progress", "--resume", "--plan")
    rest = [a for a in args.rest if a not in flags]  # REMAINDER also holds options after the file
    if rest:
        raise SystemExit(f"unexpected arguments after {args.target}: {' '.join(rest)}")
    from rapidfire_hf.sweep.spec import build, load_spec

    progress = not (args.no_progress or "--no-progress" in args.rest)
    resume = args.resume or "--resume" in args.rest
    spec = load_spec(args.target)  # every key checked before anything loads
    if args.plan or "--plan" in args.rest:
        if resume:
            raise SystemExit("--plan and --resume: give one (--plan trains nothing)")
        print(build(spec, progress=False).plan().table())
        return 0
    if progress:
        print(f"rapidfire sweep {args.target}: loading the model, the data and the trials ...", flush=True)
    sweep = build(spec, progress=progress)
    start = time.perf_counter()
    train_sweep(sweep, resume, f"rapidfire sweep {args.target} --resume")
    print_summary(sweep, time.perf_counter() - start)
    return 0


def train_sweep(sweep, resume: bool, resume_command: str) -> None:
    """``sweep.train`` with its failures as one line naming what to do on the command line (``resume_command``
    continues it): a damaged or mismatched checkpoint (the file named), a failure of every trial (the update
    and what was saved), an interrupt (where the checkpoints are)."""
    from rapidfire_hf.checkpoint.errors import CheckpointError
    from rapidfire_hf.sweep.sweep import SweepError
    from rapidfire_hf.utils.interrupt import TrainingInterrupted

    python_hint = "train(resume_from_checkpoint=True)"
    try:
        sweep.train(resume_from_checkpoint=True if resume else None)
    except (CheckpointError, SweepError) as err:
        raise SystemExit(" ".join(str(err).split()).replace(python_hint, f"`{resume_command}`")) from None
    except TrainingInterrupted as err:
        text = str(err).replace(f"{python_hint} (rapidfire sweep SWEEP.yaml --resume)", f"`{resume_command}`")
        raise TrainingInterrupted(text, err.checkpoint) from None


def run_ctl(ns) -> int:
    """Check the command against the sweep's live state, then queue it; ``status`` prints that state.
    Imports no torch: it answers in a fraction of a second."""
    out = Path(ns.dir)
    if not out.is_dir():
        raise SystemExit(f"--dir {out}: no such folder (give the running sweep's output_dir)")
    try:
        return _ctl(ns, out)
    except ValueError as err:  # the command does not fit the sweep: the message says why
        raise SystemExit(str(err)) from None


def _ctl(ns, out: Path) -> int:
    from rapidfire_hf.sweep.control import append_command, check_command, read_state

    if ns.op == "status":
        _print_status(read_state(out))
        return 0
    if ns.op in ("stop", "resume"):
        if len(ns.names) != 1:
            raise SystemExit(f"usage: rapidfire sweep ctl --dir DIR {ns.op} TRIAL")
        check_command(out, ns.op, ns.names[0])
        path = append_command(out, ns.op, ns.names[0])
    else:
        if len(ns.names) < 2:
            raise SystemExit("usage: rapidfire sweep ctl --dir DIR clone SRC NEW [field=value ...]")
        overrides = {}
        for text in ns.names[2:]:
            key, value = _parse_assignment(text, single=True)
            if key in overrides:
                raise SystemExit(f"{key} is given twice: give each field once")
            overrides[key] = value
        check_command(out, "clone", ns.names[0], new=ns.names[1], overrides=overrides)
        path = append_command(out, "clone", ns.names[0], new=ns.names[1], overrides=overrides)
    print(f"queued `{ns.op} {' '.join(ns.names)}` in {path}; applied at the next update boundary")
    return 0


def _print_status(state: dict) -> None:
    from rapidfire_hf.sweep.control import process_gone

    gone = state.get("status") == "running" and process_gone(state)
    gone = "; its process is gone: resume it with --resume" if gone else ""
    print(f"sweep {state.get('status', '?')} (pid {state.get('pid', '?')}, {state.get('time', '?')}{gone})")
    for name, s in state["trials"].items():
        s = s if isinstance(s, dict) else {}
        reward = s.get("reward_last")
        shown = f"{reward:.4f}" if isinstance(reward, int | float) else "-"
        line = f"{name:<24} {s.get('state', '?')!s:<14} {s.get('updates', '?')!s:>5}/{s.get('num_updates', '?')!s:<5}"
        print(f"{line} reward {shown}" + (f"  ({s['reason']})" if s.get("reason") else ""))
    for message in state.get("messages") or []:
        print(f"note: {message}")


def _coerce(key: str, text: str):
    """A command-line value in YAML syntax; a whole number for a float field becomes a float."""
    import yaml

    from rapidfire_hf.sweep.fields import FIELD_KINDS

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        raise SystemExit(
            f"{key}={text}: not a value (write it as in YAML: 0.01, true, [1, 0.5], {{a: 1}})"
        ) from None
    kind = FIELD_KINDS.get(key, "")
    if kind.startswith("float") and isinstance(value, int | str) and not isinstance(value, bool):
        try:  # YAML reads 1e-3 (no dot) as a string
            return float(value)
        except ValueError:
            raise SystemExit(f"{key}={text}: {key} takes a number") from None
    return value


def _parse_assignment(text: str, single: bool = False):
    """``field=v1,v2`` -> ``(field, [v1, v2])`` (or ``(field, v1)`` with ``single``)."""
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise SystemExit(
            f"{text!r}: write field=value{'' if single else '[,value...]'} (e.g. kl_coef=0.01,0.05)"
        )
    if single:
        return key, _coerce(key, values)
    parsed = [_coerce(key, v) for v in values.split(",")]
    for i, value in enumerate(parsed):
        if value in parsed[:i]:
            raise SystemExit(f"{text}: the value {value!r} of {key} is given twice: give each value once")
    return key, parsed


def _check_trial_field(key: str, text: str, values: list) -> None:
    """``key`` must be a PPOConfig field a trial may set (rapidfire_hf.sweep.PER_TRIAL_FIELDS), with values
    of its kind."""
    import difflib

    from rapidfire_hf.sweep.fields import PER_TRIAL_FIELDS, value_problem

    if key in PER_TRIAL_FIELDS:
        for value in values:
            problem = value_problem(key, value)
            if problem is not None:
                raise SystemExit(f"--sweep {text}: {problem}")
        return
    close = difflib.get_close_matches(key, sorted(PER_TRIAL_FIELDS), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    problem = "a field every trial shares" if _is_ppo_field(key) else "not a field a trial can set"
    raise SystemExit(
        f"--sweep {text}: {key} is {problem}{hint}; a trial can set the fields of "
        "rapidfire_hf.sweep.PER_TRIAL_FIELDS (docs/sweep.md, 'What a trial owns')"
    )


def _is_ppo_field(key: str) -> bool:
    import dataclasses

    from rapidfire_hf.ppo import PPOConfig

    return key in {f.name for f in dataclasses.fields(PPOConfig)}


def demo_trials(assignments: list[str]) -> dict[str, dict]:
    """``["kl_coef=0.01,0.05", "seed=0,1"]`` -> the grid of trials, named ``kl_coef=0.01,seed=0`` etc."""
    from rapidfire_hf.sweep.fields import check_trial_name

    axes = [_parse_assignment(a) for a in assignments]
    seen = set()
    for (key, values), text in zip(axes, assignments, strict=True):
        if key in seen:
            raise SystemExit(
                f"--sweep {text}: {key} is given by another --sweep too: list all its values in one"
            )
        seen.add(key)
        _check_trial_field(key, text, values)
    trials = {}
    for combo in itertools.product(*[[(k, v) for v in vs] for k, vs in axes]):
        name = "_".join(f"{k}={v}" for k, v in combo)
        try:
            check_trial_name(name)
        except ValueError as err:
            raise SystemExit(f"--sweep: {err}") from None
        if name in trials:
            raise SystemExit(f"--sweep: two trials would both be named {name}: give distinct values")
        trials[name] = dict(combo)
    return trials


def run_demo_sweep(args) -> int:
    """`rapidfire demo --sweep ...`: the demo task as a sweep of LoRA trials on one tiny base model."""
    from peft import LoraConfig

    from rapidfire_hf.cli.demo_config import demo_ppo_config, demo_resume_command
    from rapidfire_hf.demo import DemoTask, make_prompt_dataset, vowel_reward
    from rapidfire_hf.sweep import PPOSweep

    if args.model is not None:
        raise SystemExit("--sweep runs on the embedded demo model; drop --model")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trials = demo_trials(args.sweep)
    tok, policy, _, _ = DemoTask(seed=args.seed).build()
    shared = demo_ppo_config(args, out_dir)
    if shared.use_cpu:
        import torch

        # the demo model is tiny: a second intra-op thread only adds synchronisation (3 trials, 5 updates:
        # 3.2 s of CPU time on one thread; with two threads on a loaded 2-core machine ~10x the wall time)
        torch.set_num_threads(1)
    sweep = PPOSweep(
        args=shared,
        trials=trials,
        model=policy,
        processing_class=tok,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(max(512, args.batch_size * 4), seed=args.seed),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
        progress=True,
    )
    start = time.perf_counter()
    train_sweep(sweep, args.resume, demo_resume_command())
    print_summary(sweep, time.perf_counter() - start)
    return 0


def print_summary(sweep, wall: float) -> None:
    from rapidfire_hf.sweep import outputs

    summary = outputs.write_all(sweep, wall_seconds=wall)
    out = Path(sweep.args.output_dir)
    # set apart from the progress lines or table above it
    print(f"\nsummary ({out / 'summary.json'}):")
    for name, s in summary["trials"].items():
        first, last, kl = s["reward_first"], s["reward_last"], s["kl_last"]
        if first is None:
            print(f"{name}: {s['state']} before its first update")
            continue
        print(f"{name}: reward {first:.3f} -> {last:.3f}, KL {kl:.3f}, {s['updates']} updates, {s['state']}")
    print(
        f"{len(summary['trials'])} trials in {wall:.0f} s on {summary['device']}; chart {out / outputs.CHART}"
    )
