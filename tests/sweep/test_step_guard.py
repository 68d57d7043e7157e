"""Each trial's optimizer step goes through the finite-step guard PPOTrainer's Stepper uses (issue 28 item 4):
a window whose gradients are not finite is skipped (the weights never take it), counted in
``rapidfire/skipped_steps``, and ``max_consecutive_skips`` skipped windows in a row stop the trial as
``diverged``; the other trials go on exactly as alone."""

from __future__ import annotations

import math

import pytest
import torch

from .helpers import TRIALS, curves, make_sweep, max_abs_diff

A, B = "kl0.01", "kl0.2-lr3"
TWO = {A: TRIALS[A], B: TRIALS[B]}


def _nan_gradients_of_b(sweep, calls: int | None) -> None:
    """B's value-head gradient turns NaN in its first ``calls`` backward passes (None: in every one); its
    losses stay finite, so only the gradient check can see it."""
    seen = []

    def hook(grad):
        seen.append(1)
        return grad * math.nan if calls is None or len(seen) <= calls else grad

    sweep.trials[B].value_head.summary.weight.register_hook(hook)


def _finite(sweep, name) -> bool:
    trial = sweep.trials[name]
    return all(bool(p.isfinite().all()) for p in trial.params)


@pytest.mark.usefixtures("single_thread")
def test_a_non_finite_window_is_skipped_and_the_trial_goes_on(tokenizer, tmp_path):
    alone = make_sweep(tokenizer, tmp_path / "alone", {A: TRIALS[A]})
    alone.train()
    sweep = make_sweep(tokenizer, tmp_path / "two", TWO)
    _nan_gradients_of_b(sweep, calls=1)  # the first micro-batch of B's first window
    results = sweep.train()
    assert results[B].status == "finished" and results[B].global_step == 3
    assert _finite(sweep, B)
    assert [h["rapidfire/skipped_steps"] for h in results[B].log_history] == [1, 1, 1]
    assert [h["rapidfire/skipped_steps"] for h in results[A].log_history] == [0, 0, 0]
    assert curves(results[A]) == curves(alone.trials[A].state.log_history)
    assert max_abs_diff(sweep.adapter_state_dict(A), alone.adapter_state_dict(A)) == 0.0


@pytest.mark.usefixtures("single_thread")
def test_too_many_skipped_windows_in_a_row_make_the_trial_diverge(tokenizer, tmp_path):
    sweep = make_sweep(tokenizer, tmp_path, TWO, max_consecutive_skips=3)
    before = [p.detach().clone() for p in sweep.trials[B].params]
    _nan_gradients_of_b(sweep, calls=None)
    results = sweep.train()
    b = sweep.trials[B]
    assert results[B].status == "diverged" and results[B].global_step == 0
    assert b.reason.startswith("update 1: ") and "skipped 3 optimizer steps in a row" in b.reason, b.reason
    assert all(torch.equal(p, q) for p, q in zip(b.params, before))  # no skipped window reached them
    assert results[A].status == "finished" and results[A].global_step == 3
