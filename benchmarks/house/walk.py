"""The walk of one steady PPO update through rapidfire_hf's source files (issue 44).

Builds a tiny PPOTrainer on the CPU (the demo's 2-layer Llama policy, a separate value model, the vowel
reward) with the ``balanced`` rapidfire config, trains 3 updates and, with ``sys.setprofile``, records every
call into a function of the package during the second one (a steady update: planned, warmed up), from its
``on_step_begin`` to the next one (rollout -> scoring -> PPO epochs -> optimizer steps -> log). Only call
events of frames whose code lives under ``src/rapidfire_hf`` are kept, in order, as their file.

Three rules count the walk (all printed, and written as JSON with ``--out``):

- ``every call`` (the first rule, 2026-12-06): every call event in the package, nested helpers and generator
  resumptions included.
- ``package`` (the walk as a reader follows it from part to part): only calls that cross a package
  boundary: the caller's file is in another package than the callee's (the packages of the import contract:
  ``ppo``, ``optim``, ``memory``, ...), or outside rapidfire_hf (torch calling a module's forward or a hook,
  transformers calling a callback). A call inside its package (``ppo/scoring.py`` -> ``ppo/core.py``,
  ``optim/optimizer.py`` -> ``optim/pipeline.py``) stays inside the part the walk entered.
- ``folder``: as ``package``, with every folder its own part (``ppo/recipe/`` apart from ``ppo/``).

For each rule:

- ``files``: distinct source files entered; ``packages``: distinct packages (``ppo``, ``optim``, ...);
- ``changes``: how often a counted call entered another file than the previous counted call;
- ``returns``: changes into a file already entered before in the update;
- the same within one optimizer step (the ``Stepper._step`` call that stepped: the largest one).

Usage: ``python benchmarks/house/walk.py [--out walk.json] [--sequence]`` (CPU only, a few seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

from transformers import TrainerCallback

import rapidfire_hf

PACKAGE = Path(rapidfire_hf.__file__).resolve().parent
# the stepper's optimizer step (a no-op call inside an accumulation window)
STEP = ("ppo/stepper.py", "_step")


def _rel(filename: str) -> str | None:
    try:
        return Path(filename).resolve().relative_to(PACKAGE).as_posix()
    except ValueError:
        return None


def folder(rel: str | None) -> str | None:
    """``ppo/recipe/trainer.py`` -> ``ppo/recipe``; a file at the package's top -> ``""``; outside -> None."""
    return None if rel is None else rel.rpartition("/")[0]


def package(rel: str | None) -> str | None:
    """``ppo/recipe/trainer.py`` -> ``ppo``; a file at the package's top -> ``""``; outside -> None."""
    return None if rel is None else rel.partition("/")[0] if "/" in rel else ""


class Walk:
    """The in-package calls of the main thread while on:
    ``(file, function, optimizer step number or None, the caller's file or None when outside the package)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int | None, str | None]] = []
        self.steps = 0
        self._step_frame = None
        self._rel_cache: dict[str, str | None] = {}

    def _file(self, filename: str) -> str | None:
        if filename not in self._rel_cache:
            self._rel_cache[filename] = _rel(filename)
        return self._rel_cache[filename]

    def hook(self, frame, event, arg) -> None:
        if event == "call":
            rel = self._file(frame.f_code.co_filename)
            if rel is None or rel.startswith("demo/"):  # the demo's reward stands in for the user's code
                return
            if self._step_frame is None and (rel, frame.f_code.co_name) == STEP:
                self._step_frame, self.steps = frame, self.steps + 1
            caller = frame.f_back
            by = self._file(caller.f_code.co_filename) if caller is not None else None
            self.calls.append(
                (rel, frame.f_code.co_name, self.steps if self._step_frame is not None else None, by)
            )
        elif event == "return" and frame is self._step_frame:
            self._step_frame = None


class TraceUpdate(TrainerCallback):
    """Turns the walk on at the start of update ``index`` and off at the start of the next (or the end)."""

    def __init__(self, walk: Walk, index: int) -> None:
        self.walk, self.index, self.on = walk, index, False

    def on_step_begin(self, args, state, control, **kwargs):
        if self.on:
            sys.setprofile(None)
            self.on = False
        elif state.global_step == self.index:
            self.on = True
            sys.setprofile(self.walk.hook)

    def on_train_end(self, args, state, control, **kwargs):
        if self.on:
            sys.setprofile(None)
            self.on = False


def measures(files: list[str]) -> dict:
    """Distinct files and packages, file changes and returns to an already entered file, of a call sequence."""
    changes = returns = 0
    seen: set[str] = set()
    for i, f in enumerate(files):
        if i and f != files[i - 1]:
            changes += 1
            returns += f in seen
        seen.add(f)
    packages = sorted({f.split("/")[0] if "/" in f else "rapidfire_hf" for f in files})
    return {"files": len(seen), "packages": len(packages), "package_names": packages,
            "changes": changes, "returns": returns}  # fmt: skip


def run(out_dir: str) -> tuple[dict, Walk]:
    import torch

    from rapidfire_hf import PPOConfig, PPOTrainer
    from rapidfire_hf.demo import tiny_setup

    torch.manual_seed(0)
    setup = tiny_setup(num_prompts=32)
    args = PPOConfig(
        output_dir=out_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2,
        num_ppo_epochs=2, response_length=6, stop_token="eos", learning_rate=1e-3, max_steps=3,
        logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True, seed=3, num_sample_generations=0,
        save_strategy="no", rapidfire_config="balanced",
    )  # fmt: skip
    trainer = PPOTrainer(
        args=args, processing_class=setup.tokenizer, model=setup.policy, value_model=setup.value_model,
        reward_funcs=setup.reward, train_dataset=setup.dataset,
    )  # fmt: skip
    trainer.remove_progress_callbacks()  # no log lines printed
    walk = Walk()
    trainer.add_callback(TraceUpdate(walk, index=1))
    trainer.train()
    sys.setprofile(None)
    steps = Counter(s for _, _, s, _ in walk.calls if s is not None)
    step = max(steps, key=steps.get) if steps else None
    result = {"calls": len(walk.calls), "torch": torch.__version__}
    for rule, kept in RULES.items():
        files = [f for f, _, _, by in walk.calls if kept(f, by)]
        in_step = [f for f, _, s, by in walk.calls if s == step and kept(f, by)]
        result[rule] = {
            "update": measures(files),
            "optimizer_step": {**measures(in_step), "steps_in_update": len(steps)},
            "most_entered": Counter(f for i, f in enumerate(files) if not i or f != files[i - 1]).most_common(
                8
            ),
        }
    return result, walk


# which call events each rule counts: ``kept(callee file, caller file or None)``
RULES = {
    "every_call": lambda f, by: True,
    "package": lambda f, by: by is None or package(by) != package(f),
    "folder": lambda f, by: by is None or folder(by) != folder(f),
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the numbers as JSON here")
    p.add_argument(
        "--sequence", action="store_true", help="also print the file sequence (consecutive merged)"
    )
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result, walk = run(tmp)
    for rule, kept in RULES.items():
        u, s = result[rule]["update"], result[rule]["optimizer_step"]
        print(f"[{rule}] one steady update: {u['files']} files in {u['packages']} packages "
              f"({', '.join(u['package_names'])}), {u['changes']} file changes, "
              f"{u['returns']} returns to a file already entered")  # fmt: skip
        print(f"[{rule}] one optimizer step (of {s['steps_in_update']}): {s['files']} files, "
              f"{s['changes']} file changes, {s['returns']} returns")  # fmt: skip
        print(
            f"[{rule}] entered most often:", ", ".join(f"{f} x{n}" for f, n in result[rule]["most_entered"])
        )
        if a.sequence:
            files = [f for f, _, _, by in walk.calls if kept(f, by)]
            print(f"[{rule}]", " -> ".join(f for i, f in enumerate(files) if not i or f != files[i - 1]))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
