"""The crash-test sweep of tests/sweep/test_resume.py, and a runner that SIGKILLs it at a chosen point.

    python -m tests.sweep.crash OUT WHERE TARGET N

kills this process (no clean-up of any kind runs, as with a power cut or the OOM killer) on the N-th
``os.replace`` onto a path named TARGET (WHERE=replace), the N-th ``torch.save`` of a file named TARGET
(WHERE=save: before it is written), or the N-th PPO-epochs phase (WHERE=optimize).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from .helpers import TRIALS, make_sweep

A, B = "kl0.01", "kl0.2-lr3"
CLONE = "kl0.01-fast"  # made from A at the boundary after A's update 2, with another learning rate
SETTINGS = dict(max_steps=4, save_strategy="steps", save_steps=1)


class CloneAtUpdate2:
    def on_step_end(self, args, state, control, sweep=None, trial=None, **kwargs):
        if trial == A and state.global_step == 2:
            sweep.clone(A, CLONE, learning_rate=1e-2)


class CountUpdates:
    def __init__(self):
        self.updates = 0

    def on_step_end(self, *args, **kwargs):
        self.updates += 1


def crash_sweep(tokenizer, out_dir, **settings):
    sweep = make_sweep(tokenizer, out_dir, {A: TRIALS[A], B: TRIALS[B]}, **{**SETTINGS, **settings})
    sweep.callbacks += [CloneAtUpdate2(), CountUpdates()]
    return sweep


def kill_on(n: int):
    """A hook that SIGKILLs this process at its ``n``-th call (the kill points of the crash tests)."""
    seen = [0]

    def hit():
        seen[0] += 1
        if seen[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)

    return hit


def main(out: str, where: str, target: str, n: int) -> None:
    import torch

    from rapidfire_hf.demo import build_char_tokenizer
    from rapidfire_hf.sweep.phases import SweepPhases

    torch.set_num_threads(1)
    hit = kill_on(n)
    if where == "replace":
        replace = os.replace

        def killing_replace(src, dst, *args, **kwargs):
            if Path(dst).name == target:
                hit()
            return replace(src, dst, *args, **kwargs)

        os.replace = killing_replace
    elif where == "save":
        save = torch.save

        def killing_save(obj, f, *args, **kwargs):
            if Path(f).name == target:
                hit()
            return save(obj, f, *args, **kwargs)

        torch.save = killing_save
    elif where == "optimize":
        optimize = SweepPhases.optimize

        def killing_optimize(self, *args, **kwargs):
            hit()
            return optimize(self, *args, **kwargs)

        SweepPhases.optimize = killing_optimize
    crash_sweep(build_char_tokenizer(), out).train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
