"""The Stepper alone: one optimizer step per accumulation window, with the trainer's events around it in
order, clipping unless the optimizer clips itself, the step health chosen when the optimizer is set, and
a non-finite window kept from the weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin

from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.optim.step_health import ClosedWindow, GuardedHealth, RapidFireHealth
from rapidfire_hf.ppo.stepper import StepEvents, Stepper


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _stepper(max_grad_norm=None, accumulate=2):
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accumulate))
    seen = []
    model = torch.nn.Linear(4, 1)
    events = StepEvents(
        before_step=lambda: seen.append("before"),
        gradients_ready=lambda: seen.append(
            ("ready", float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()))
        ),
        after_step=lambda: seen.append("after"),
    )
    stepper = Stepper(
        acc, max_grad_norm=max_grad_norm, max_oom_splits=0, max_consecutive_skips=5, events=events
    )
    torch.manual_seed(0)
    stepper.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, stepper.optimizer = acc.prepare(model, stepper.optimizer)
    stepper.attach(model)
    return stepper, model, seen


def _micro(stepper, model, scale=1.0, reported_loss=None):
    x = torch.arange(8.0).reshape(2, 4) * scale

    def forward_backward(chunk, weight):
        loss = model(chunk["x"]).pow(2).mean()
        stepper.accelerator.backward(loss)
        told = loss.detach() if reported_loss is None else torch.tensor(reported_loss)
        return SimpleNamespace(loss=told, approx_kl=torch.zeros(())), torch.zeros(2)

    return stepper.micro_step(forward_backward, {"x": x, "idx": torch.arange(2), "offset": 0})


def test_one_step_per_window_with_the_events_in_order():
    stepper, model, seen = _stepper()
    start = [p.detach().clone() for p in model.parameters()]
    _micro(stepper, model)
    assert seen == [] and all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    _micro(stepper, model)
    assert [e if isinstance(e, str) else e[0] for e in seen] == ["before", "ready", "after"]
    assert not all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # zeroed after the step
    _micro(stepper, model)
    _micro(stepper, model)
    assert len(seen) == 6 and stepper.health.stats()["steps"] == 2


def test_gradients_are_clipped_before_the_step():
    stepper, model, seen = _stepper(max_grad_norm=0.5)
    _micro(stepper, model)
    _micro(stepper, model)
    (norm,) = [e[1] for e in seen if isinstance(e, tuple)]
    assert norm == pytest.approx(0.5, rel=1e-5)


def test_an_optimizer_that_clips_itself_is_not_clipped_again():
    stepper, model, seen = _stepper(max_grad_norm=0.5)
    rf = RapidFireOptimizer(model.parameters(), lr=0.1, max_grad_norm=100.0)
    stepper.optimizer = stepper.accelerator.prepare_optimizer(rf)
    assert stepper.clips_itself and isinstance(stepper.health, RapidFireHealth)
    _micro(stepper, model)
    _micro(stepper, model)
    (norm,) = [e[1] for e in seen if isinstance(e, tuple)]
    assert norm > 0.5


def test_the_health_follows_the_optimizer_set():
    stepper, model, _ = _stepper()
    assert isinstance(stepper.health, GuardedHealth) and stepper.health.rapidfire is None
    rf = RapidFireOptimizer(model.parameters(), lr=0.1)
    stepper.optimizer = rf
    assert stepper.health.rapidfire is rf


def test_a_non_finite_window_never_reaches_the_weights():
    stepper, model, _ = _stepper()
    start = [p.detach().clone() for p in model.parameters()]
    _micro(stepper, model, scale=float("nan"))
    _micro(stepper, model)
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    assert stepper.health.skipped() == 1


@pytest.mark.parametrize("nan_at", [0, 1])
def test_every_micro_batchs_loss_reaches_the_health(nan_at):
    """A non-finite loss (finite gradients) of either micro-batch of a window skips its step: the first
    one's is observed at once, the closing one's with the step, in the one close call (``close_window``)."""
    stepper, model, _ = _stepper()
    start = [p.detach().clone() for p in model.parameters()]
    for i in range(2):
        _micro(stepper, model, reported_loss=float("nan") if i == nan_at else None)
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    assert stepper.health.skipped() == 1


def test_a_closed_window_keys_the_next_without_asking_the_health_again():
    """The close leaves the step count (skipped steps included) and the rollback; the next window's key is
    read from it within an update, and asked of the health again after a new update or a verification."""
    stepper, model, _ = _stepper()
    assert stepper.closed is None and stepper.window_key() == 0
    _micro(stepper, model)
    assert stepper.closed is None  # inside the window: nothing closed yet
    _micro(stepper, model, reported_loss=float("nan"))
    assert stepper.closed == ClosedWindow(steps=1, rollback=None)
    asked = []
    stepper.health.steps = lambda: asked.append(1) or 7  # the instance's counter, patched
    assert stepper.window_key() == 1 and asked == []
    assert stepper.verify_now() is None and stepper.closed is None
    assert stepper.window_key() == 7 and asked == [1]
    _micro(stepper, model)
    _micro(stepper, model)
    stepper.new_update()
    assert stepper.closed is None and stepper.window_key() == 7
