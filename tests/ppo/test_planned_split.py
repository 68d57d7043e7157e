"""A plan that splits the user's micro-batch (it cannot fit whole) runs the pieces in the micro-batch's
accumulation window: the same optimizer steps and update as the whole micro-batch, no OOM counted; OOM
recovery stays the safety net beyond the plan's pieces and counts only its own splits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import rapidfire_hf.ppo.recipe.planning as planning
from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.memory.oom import OOMRecovery
from rapidfire_hf.ppo import PPOTrainer
from rapidfire_hf.ppo.modeling import causal_lm_parts
from tests.helpers.faults_train import oom_above_rows
from tests.ppo.helpers import ppo_args

ATOL = 1e-6  # fp32 on CPU with SGD: only the summation order of the accumulated gradient differs
CFG = {"memory": {"prefetch_window": 0, "checkpointing": "off"},
       "precision": {"mode": "static"}}  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Single-threaded: the tiny models are faster that way on the shared cores."""


def _train(tmp_path, tokenizer, monkeypatch, splits: int, max_rows: int | None = None):
    make_plan = planning.make_plan

    def planned(*a, **k):  # the plan the budget would give, with `splits` halvings of the micro-batch of 4
        return replace(make_plan(*a, **k), merge=1, train_rows=4, splits=splits)

    monkeypatch.setattr(planning, "make_plan", planned)
    torch.manual_seed(0)
    policy, value = build_tiny_llama(tokenizer), build_tiny_value_model(tokenizer)
    sgd = torch.optim.SGD([p for m in (policy, value) for p in m.parameters()], lr=0.1)
    args = ppo_args(tmp_path, num_ppo_epochs=1, num_mini_batches=1, seed=5, rapidfire_config=CFG)
    trainer = PPOTrainer(
        args=args, processing_class=tokenizer, model=policy, value_model=value, reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(32), optimizers=(sgd, None),
    )  # fmt: skip
    decoder = causal_lm_parts(trainer.policy)[0]
    rows = []
    hook = decoder.register_forward_pre_hook(
        lambda m, a, kw: (
            rows.append(next(t for t in (*a, *kw.values()) if torch.is_tensor(t)).shape[0])
            if torch.is_grad_enabled() and trainer.plan is not None  # not the plan's one-row probe
            else None
        ),
        with_kwargs=True,
    )
    oom = oom_above_rows(decoder, max_rows, grad=True) if max_rows else None
    trainer.train()
    hook.remove()
    params = [p.detach().clone() for p in trainer.model.parameters()]
    return trainer, params, rows, (oom.raised if oom else 0)


def test_planned_pieces_train_the_same_update_without_an_oom(tmp_path, tokenizer, monkeypatch):
    whole, reference, whole_rows, _ = _train(tmp_path / "whole", tokenizer, monkeypatch, splits=0)
    split, params, split_rows, _ = _train(tmp_path / "split", tokenizer, monkeypatch, splits=1)
    assert split.plan.splits == 1 and split.plan.forward_rows == 2
    assert set(whole_rows) == {4} and set(split_rows) == {2}  # every training forward ran in pieces
    assert len(split_rows) == 2 * len(whole_rows)
    assert split.stepper.oom_splits == 0 and split.state.log_history[-1]["rapidfire/oom_splits"] == 0
    assert split.state.log_history[0]["rapidfire/plan/splits"] == 1
    # the same optimizer steps: accelerate's window closed as often as with whole micro-batches
    assert split.state.global_step == whole.state.global_step
    for a, b in zip(reference, params, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL)


def test_oom_recovery_beyond_the_planned_pieces_is_counted(tmp_path, tokenizer, monkeypatch):
    _, reference, _, _ = _train(tmp_path / "whole", tokenizer, monkeypatch, splits=0)
    trainer, params, rows, ooms = _train(tmp_path / "oom", tokenizer, monkeypatch, splits=1, max_rows=1)
    assert ooms >= 1 and trainer.stepper.oom_splits == ooms  # only the OOM's halvings are counted
    assert set(rows) == {1, 2}  # pieces of 2 planned (tried: the OOM), of 1 after it; never the whole 4
    for a, b in zip(reference, params, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL)


def test_recovery_keeps_the_planned_halvings_across_resets_and_counts_max_splits_beyond_them():
    seen = []

    def step(chunk, weight):
        if len(chunk) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        seen.append(len(chunk))
        return torch.tensor(float(sum(chunk))) / weight if weight else torch.tensor(0.0)

    recovery = OOMRecovery(max_splits=1, weight_fn=lambda chunk, total: 1.0, combine=lambda a, b: a + b)
    recovery.plan_splits(1)  # pieces of 2 planned; one OOM halving allowed beyond them
    recovery(step, [1, 2, 3, 4])
    assert seen == [1, 1, 1, 1] and len(recovery.events) == 1  # the planned halving is not an OOM event
    recovery.reset()
    assert recovery.splits == 1  # back to the plan, not to whole micro-batches
    recovery.plan_splits(0)
    recovery.reset()
    with pytest.raises(Exception, match="max_splits=1"):
        recovery(step, [1, 2, 3, 4])  # whole: 4 -> 2 is its one allowed halving, 2 still OOMs
