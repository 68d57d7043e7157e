"""Skipped steps under enable_rapidfire: NaN loss when a logging window trained nothing, counted per window,
each skip logged with its reason; and the short console line."""

from __future__ import annotations

import logging
import math
import types

import pytest
import torch
from rf_trainers import PARITY_CONFIG, train_log

from rapidfire_hf.integrations import enable_rapidfire
from rapidfire_hf.integrations.skips import SkippedStepsCallback
from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.optim.health import OptimizerEvent


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    yield


def nan_at(trainer, bad_calls: set[int]) -> list[float]:
    """Make ``compute_loss`` return NaN on the given calls (1-based); returns the finite losses, in order."""
    original = type(trainer).compute_loss
    calls, finite = [0], []

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = original(self, model, inputs, return_outputs=return_outputs, **kwargs)
        calls[0] += 1
        loss = out[0] if return_outputs else out
        if calls[0] in bad_calls:
            loss = loss * float("nan")
        else:
            finite.append(float(loss.detach()))
        return (loss, out[1]) if return_outputs else loss

    trainer.compute_loss = types.MethodType(compute_loss, trainer)
    return finite


def test_a_window_of_skipped_steps_logs_nan_loss_not_zero(build):
    trainer = enable_rapidfire(build("sft", max_steps=5, logging_steps=1), config=PARITY_CONFIG)
    finite = nan_at(trainer, {3})
    trainer.train()
    losses = train_log(trainer)
    assert math.isnan(losses[2])  # stock transformers logs 0.0 here (its NaN filter's running average)
    assert losses[:2] + losses[3:] == pytest.approx(finite, rel=1e-6)
    assert train_log(trainer, "rapidfire/steps_skipped") == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert train_log(trainer, "rapidfire/optim/skipped") == [0.0, 0.0, 1.0, 1.0, 1.0]
    step3 = next(h for h in trainer.state.log_history if h.get("step") == 3)
    assert step3["rapidfire/steps_skipped/finite_loss"] == 1.0


def test_a_partly_skipped_window_logs_the_mean_of_the_applied_steps(build):
    trainer = enable_rapidfire(build("sft", max_steps=6, logging_steps=3), config=PARITY_CONFIG)
    finite = nan_at(trainer, {3, 4, 5})
    trainer.train()
    losses = train_log(trainer)
    # window 1: steps 1, 2 applied, step 3 skipped -> their mean (stock: (l1 + l2 + (l1 + l2) / 3) / 3);
    # window 2: steps 4, 5 skipped, step 6 applied -> its loss alone
    assert losses == pytest.approx([(finite[0] + finite[1]) / 2, finite[2]], rel=1e-6)
    assert train_log(trainer, "rapidfire/steps_skipped") == [1.0, 2.0]


def test_an_applied_step_keeps_the_trainers_own_loss(build):
    stock = build("sft", max_steps=3, logging_steps=1)
    stock.train()
    ours = enable_rapidfire(build("sft", max_steps=3, logging_steps=1), config=PARITY_CONFIG)
    ours.train()
    assert train_log(ours) == pytest.approx(train_log(stock), rel=1e-5)


def _callback_on_stub(opt):
    """A SkippedStepsCallback on a stand-in trainer whose optimizer is ``opt``."""
    trainer = types.SimpleNamespace(
        optimizer=opt,
        accelerator=types.SimpleNamespace(optimizer_step_was_skipped=False),
        args=types.SimpleNamespace(world_size=1, logging_nan_inf_filter=True),
        training_step=lambda model, inputs: torch.tensor(1.0),
        log=lambda logs: None,
    )
    return trainer, SkippedStepsCallback(trainer)


def test_an_unreplayed_clip_miss_and_an_fp16_overflow_are_logged_and_counted(caplog):
    opt = RapidFireOptimizer(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    trainer, callback = _callback_on_stub(opt)
    state = types.SimpleNamespace(global_step=7)
    opt.last_step_skipped = True
    opt.events.append(OptimizerEvent(6, "rollback", ["clip_prediction"], {}))
    with caplog.at_level(logging.WARNING, logger="rapidfire_hf"):
        callback.on_step_end(None, state, None)
        trainer.accelerator.optimizer_step_was_skipped = True
        state.global_step = 8
        callback.on_step_end(None, state, None)
    text = caplog.text
    assert "step 7 skipped" in text and "clip coefficient" in text
    assert "step 8 skipped" in text and "fp16 loss scaling" in text
    counts = callback.take_counts()
    assert counts == {
        "steps_skipped": 2.0,
        "steps_skipped/clip_prediction": 1.0,
        "steps_skipped/fp16_overflow": 1.0,
    }


def test_console_line_is_short_and_the_loggers_get_every_metric(build, capsys):
    trainer = enable_rapidfire(build("grpo", max_steps=2, disable_tqdm=True), config=PARITY_CONFIG)
    capsys.readouterr()
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{'loss'")]
    assert len(printed) == 2
    for line in printed:
        assert line.count("rapidfire/") <= 4, line
        assert "'rapidfire/tokens_per_sec'" in line and "'rapidfire/steps_skipped'" in line
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    assert sum(k.startswith("rapidfire/") for k in logged) > 20


def test_the_count_follows_log_every_and_the_loss_every_log(build):
    config = {**PARITY_CONFIG, "logging": {"log_every": 2}}
    trainer = enable_rapidfire(build("sft", max_steps=4, logging_steps=1), config=config)
    nan_at(trainer, {1})
    trainer.train()
    assert math.isnan(train_log(trainer)[0])  # the loss of step 1's own log
    assert train_log(trainer, "rapidfire/steps_skipped") == [1.0, 0.0]  # steps 1-2, then 3-4
