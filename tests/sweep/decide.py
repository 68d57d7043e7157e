"""The decision-heavy sweep of tests/sweep/test_durable_decisions.py, and a runner that SIGKILLs it at a
chosen point.

    python -m tests.sweep.decide OUT WHERE TARGET N

kills this process (SIGKILL: no clean-up of any kind runs) at the N-th time the sweep journals a decision
line with op TARGET, right after the line is on disk (WHERE=after) or just before it is written
(WHERE=before); at the N-th ``os.replace`` onto a path named TARGET (WHERE=replace); or in the N-th PPO
epochs phase (WHERE=optimize). WHERE=none runs it to the end.

The sweep: trials A, B, C; a callback clones A at its update 1 (A-fast, another learning rate); at B's
update 2 a callback writes ``ctl stop C`` to the control file (read at that boundary); at A's update 3 a
callback resumes C (which then runs one update behind, pinned); at A-fast's update 2 a callback stops it
through ``control.should_training_stop``; successive halving at update 3 keeps the best 30% (C, pinned, is
never cut); at update 4 a callback stops A with ``sweep.stop`` if it still runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rapidfire_hf.sweep.control import SuccessiveHalving, append_command

from .crash import kill_on
from .helpers import make_sweep

A, B, C, FAST = "A", "B", "C", "A-fast"
TRIALS = {A: {"kl_coef": 0.01}, B: {"kl_coef": 0.2, "learning_rate": 3e-3, "seed": 5}, C: {"seed": 3}}
SETTINGS = dict(max_steps=5, save_strategy="steps", save_steps=2)


class Decide:
    """Takes the sweep's decisions from its callbacks (see the module docstring)."""

    def on_step_end(self, args, state, control, sweep=None, trial=None, **kwargs):
        step = state.global_step
        if trial == A and step == 1:
            sweep.clone(A, FAST, learning_rate=1e-2)
        ctl_file = Path(sweep.args.output_dir) / "control.jsonl"
        if trial == B and step == 2 and not ctl_file.exists():  # sent once, as a user in another shell does
            append_command(sweep.args.output_dir, "stop", C)
        if trial == A and step == 3:
            sweep.resume(C)
        if trial == FAST and step == 2:
            control.should_training_stop = True
        if trial == A and step == 4 and sweep.trials[A].status == "running":
            sweep.stop(A, "enough")


class CountUpdates:
    def __init__(self):
        self.updates = 0

    def on_step_end(self, *args, **kwargs):
        self.updates += 1


def decide_sweep(tokenizer, out_dir):
    sweep = make_sweep(tokenizer, out_dir, dict(TRIALS), **SETTINGS)
    sweep.early_stopping = SuccessiveHalving(rungs=(3,), keep=0.3)
    sweep.callbacks += [Decide(), CountUpdates()]
    return sweep


def main(out: str, where: str, target: str, n: int) -> None:
    import torch

    from rapidfire_hf.demo import build_char_tokenizer
    from rapidfire_hf.sweep.journal import DecisionJournal
    from rapidfire_hf.sweep.phases import SweepPhases

    torch.set_num_threads(1)
    hit = kill_on(n)
    if where in ("before", "after"):
        record = DecisionJournal.record

        def killing_record(self, entry):
            mine = entry.get("op") == target and not self._known[__import__("json").dumps(entry, sort_keys=True)]
            if mine and where == "before":
                hit()
            record(self, entry)
            if mine and where == "after":
                hit()

        DecisionJournal.record = killing_record
    elif where == "replace":
        replace = os.replace

        def killing_replace(src, dst, *args, **kwargs):
            if Path(dst).name == target:
                hit()
            return replace(src, dst, *args, **kwargs)

        os.replace = killing_replace
    elif where == "optimize":
        optimize = SweepPhases.optimize

        def killing_optimize(self, *args, **kwargs):
            hit()
            return optimize(self, *args, **kwargs)

        SweepPhases.optimize = killing_optimize
    sweep = decide_sweep(build_char_tokenizer(), out)
    sweep.train()
    for name, t in sweep.trials.items():
        print(name, t.status, t.state.global_step, t.reason, t.pinned)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
