"""A CUDA out-of-memory error in a sweep's packed training forward: PPOTrainer's split-and-retry policy
(``ppo/recovery.py``, issue 28 item 4), with the update a run without the OOM makes; in a scoring forward:
PPOTrainer's no-grad policy (half the rows per forward from there on), with the run that scores that many
rows at a time.

The OOM is injected as in ``tests/ppo/test_oom_recovery.py``: a forward pre-hook on the shared decoder
raises a real ``torch.OutOfMemoryError`` on gradient-tracking forwards (training only: the rollout and
scoring run without gradients) of more than ``max_rows`` rows. Trial A trains micro-batches of 4 rows, C of
2, so every micro-step packs 6 rows: a split at 3 cuts A's micro-batch in two (a piece of it sits beside
C's rows), and each piece is normalised by its whole micro-batch. One update: 4 micro-steps (A: 2 epochs of 2
windows of one micro-batch; C: 1 epoch of 2 windows of 2 micro-batches).
"""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.memory.oom import OOMRecoveryError
from rapidfire_hf.models.plumbing import causal_lm_parts
from rapidfire_hf.optim.step_health import step_health
from rapidfire_hf.sweep import SweepError
from tests.helpers.faults_train import only_during, oom_above_rows

from .helpers import TRIALS, curves, make_sweep, max_abs_diff

A, C = "kl0.01", "clip0.1"

# fp32 on CPU; only the summation order of the accumulated gradient differs between a split pack and the
# whole one (as tests/ppo/test_oom_recovery.py measures for PPOTrainer: < 1e-7 with SGD)
ATOL = 1e-6


def _sweep(tokenizer, out_dir, **shared):
    sweep = make_sweep(tokenizer, out_dir, {A: TRIALS[A], C: TRIALS[C]}, max_steps=1, **shared)
    for trial in sweep.trials.values():
        # SGD, not AdamW: Adam divides by sqrt(v), which turns summation-order rounding in a near-zero
        # gradient into a visible parameter difference; SGD keeps the comparison at rounding level
        trial.optimizer = torch.optim.SGD(trial.params, lr=0.1)
        trial.health = step_health(trial.optimizer, guard=True, owner=f"test trial {trial.name}")
    return sweep


def _train(tokenizer, out_dir, max_rows=None, **shared):
    sweep = _sweep(tokenizer, out_dir, **shared)
    oom = None
    if max_rows is not None:
        # the PPO epochs' forwards only (not the throughput plan's one-row probe before the first update)
        oom = only_during(oom_above_rows(causal_lm_parts(sweep.model)[0], max_rows, grad=True), sweep.phases, "optimize")
    sweep.train()
    return sweep, oom


def _stats(sweep, name):
    keys = (
        "loss/policy_avg",
        "loss/value_avg",
        "policy/approxkl_avg",
        "policy/clipfrac_avg",
        "policy/entropy_avg",
    )
    return [sweep.trials[name].state.log_history[-1][k] for k in keys]


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize(
    ("max_rows", "raised", "rows"),
    [
        # the first pack of 6 rows OOMs and runs as 3 + 3; the 3 later packs of the update are split up front
        (3, 1, [6] + [3] * 8),
        # 6 -> 3 -> 2 fail (3 splits, max_oom_splits' default), then every pack runs as single rows
        (1, 3, [6, 3, 2] + [1] * 6 * 4),
    ],
    ids=["one-split", "three-splits"],
)
def test_split_packs_give_the_same_update(tokenizer, tmp_path, max_rows, raised, rows):
    reference, _ = _train(tokenizer, tmp_path / "ref")
    sweep, oom = _train(tokenizer, tmp_path / "oom", max_rows=max_rows)
    assert oom.raised == raised and sweep.phases.oom_splits == raised
    assert oom.rows == rows
    for name in (A, C):
        log = sweep.trials[name].state.log_history[-1]
        assert log["rapidfire/oom_splits"] == raised
        assert reference.trials[name].state.log_history[-1]["rapidfire/oom_splits"] == 0
        for a, b in zip(reference.trials[name].params, sweep.trials[name].params, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=ATOL)
        # the logged statistics are the pieces' sums: those of the whole micro-batches
        torch.testing.assert_close(_stats(sweep, name), _stats(reference, name), rtol=0, atol=ATOL)
    # the update moved the weights, so the comparison above compares something
    first = _sweep(tokenizer, tmp_path / "first")
    assert any(not torch.equal(a, b) for a, b in zip(first.trials[A].params, sweep.trials[A].params))


@pytest.mark.usefixtures("single_thread")
def test_gives_up_after_max_oom_splits_naming_the_settings_that_act(tokenizer, tmp_path):
    with pytest.raises(SweepError, match=r"in the PPO epochs: OOMRecoveryError: out of memory") as err:
        _train(tokenizer, tmp_path, max_rows=1, max_oom_splits=1)
    assert isinstance(err.value.__cause__, OOMRecoveryError)
    message = str(err.value.__cause__)
    assert "splitting the micro-batch 1 time" in message
    for setting in ("train_rows_per_forward", "per_device_train_batch_size", "max_oom_splits"):
        assert setting in message


@pytest.mark.usefixtures("single_thread")
def test_a_scoring_oom_scores_with_half_the_rows_per_forward(tokenizer, tmp_path):
    """Two trials of 8 rows, scored 8 rows per forward: the first forward of each update (no-grad, more than
    4 rows) runs out of memory, so that update's scoring runs 4 rows at a time: bit for bit the sweep that
    scores 4 rows at a time from the start (CPU fp32)."""
    two = {A: TRIALS[A], "B": TRIALS["kl0.2-lr3"]}
    reference = make_sweep(tokenizer, tmp_path / "ref", two, max_steps=2, local_rollout_forward_batch_size=4)
    reference.train()
    sweep = make_sweep(tokenizer, tmp_path / "oom", two, max_steps=2, local_rollout_forward_batch_size=8)
    decoder = causal_lm_parts(sweep.model)[0]
    oom = only_during(oom_above_rows(decoder, 4, grad=False), sweep.phases, "score")
    sweep.train()
    assert oom.raised == 2 and sweep.phases.scoring_chunks.oom_retries == 2  # once per update
    assert max(oom.rows) == 8 and oom.rows.count(8) == 2
    for name in two:
        assert curves(sweep.trials[name].state.log_history) == curves(
            reference.trials[name].state.log_history
        )
        assert max_abs_diff(sweep.adapter_state_dict(name), reference.adapter_state_dict(name)) == 0.0
