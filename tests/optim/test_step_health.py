"""StepHealth: one interface in front of every optimizer's step health. The adapter is chosen by type
(RapidFireOptimizer, also under accelerate's wrapper; a plain optimizer guarded or not), and each adapter
behaves as the mechanism behind it: a guarded NaN step leaves the weights as they were and is counted,
a RapidFireOptimizer's calls reach the optimizer as it is at call time."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.optim.step_health import (
    ClosedWindow,
    GuardedHealth,
    RapidFireHealth,
    StepHealth,
    UncheckedHealth,
    close_window,
    rapidfire_optimizer,
    step_health,
)
from tests.optim.helpers import loss_of, make_model


def _rapidfire(model):
    return RapidFireOptimizer(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("guard", [True, False])
def test_the_adapter_follows_the_optimizer_type(guard):
    model = make_model()
    rf = _rapidfire(model)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    health = step_health(rf, guard=guard)
    assert isinstance(health, RapidFireHealth) and health.rapidfire is rf  # verifies itself: no guard
    expected = GuardedHealth if guard else UncheckedHealth
    assert type(step_health(plain, guard=guard)) is expected
    assert step_health(plain, guard=guard).rapidfire is None
    for h in (health, step_health(plain, guard=True), step_health(plain, guard=False)):
        assert isinstance(h, StepHealth)


def test_rapidfire_optimizer_is_found_under_accelerates_wrapper():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = make_model()
    rf = _rapidfire(model)
    wrapped = acc.prepare_optimizer(rf)
    assert wrapped is not rf and rapidfire_optimizer(wrapped) is rf
    assert isinstance(step_health(wrapped, guard=True), RapidFireHealth)
    assert rapidfire_optimizer(acc.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))) is None


def _window(model, health, optimizer, i, nan=False):
    loss = loss_of(model, i)
    if nan:
        loss = loss * float("nan")
    health.observe_loss(loss.detach())
    loss.backward()
    health.step(optimizer, list(model.parameters()))
    optimizer.zero_grad(set_to_none=True)


def test_guarded_health_skips_and_counts_a_nan_step():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    health = step_health(opt, guard=True, max_consecutive_skips=5)
    _window(model, health, opt, 0)
    before = [p.detach().clone() for p in model.parameters()]
    _window(model, health, opt, 1, nan=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert health.skipped() == 1
    assert health.stats() == {"steps": 2, "skipped": 1}
    assert health.verify_now() is None and health.last_rollback() is None


def test_unchecked_health_always_steps():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    health = step_health(opt, guard=False)
    before = [p.detach().clone() for p in model.parameters()]
    _window(model, health, opt, 0)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert health.skipped() == 0 and health.stats()["steps"] == 1


def test_rapidfire_health_reaches_the_optimizer_as_it_is_at_call_time():
    model = make_model()
    rf = _rapidfire(model)
    health = step_health(rf, guard=True)
    seen = []
    observe = rf.observe_loss
    rf.observe_loss = lambda loss: (seen.append(loss), observe(loss))  # a test's patch of the instance
    _window(model, health, rf, 0)
    _window(model, health, rf, 1, nan=True)  # the optimizer's own check skips it
    assert len(seen) == 2
    stats = rf.stats()
    assert health.stats() == stats and stats["steps"] == 2
    assert health.skipped() == stats["skipped"] - stats["clip_misses"] == 1
    assert health.verify_now() is None and health.last_rollback() is rf.last_rollback


@pytest.mark.parametrize("kind", ["rapidfire", "guarded", "unchecked"])
def test_steps_is_the_step_counter_of_stats_skipped_steps_included(kind):
    """``steps()`` (what PPOEpochs keys its windows by) equals ``stats()["steps"]`` after every window."""
    model = make_model()
    opt = _rapidfire(model) if kind == "rapidfire" else torch.optim.AdamW(model.parameters(), lr=1e-2)
    health = step_health(opt, guard=kind == "guarded", max_consecutive_skips=5)
    assert health.steps() == health.stats()["steps"] == 0
    for i, nan in enumerate([False, kind != "unchecked", False]):  # a skipped step counts as a step
        _window(model, health, opt, i, nan=nan)
        health.verify_now()
        assert health.steps() == health.stats()["steps"] == i + 1


@pytest.mark.parametrize("kind", ["rapidfire", "guarded"])
def test_close_window_hands_over_the_loss_and_metrics_steps_and_says_what_the_step_left(kind):
    """One call closes a window: its loss and records reach the health before the step (a NaN loss skips
    it), and the result is the step counter and rollback the health gives right after."""
    model = make_model()
    opt = _rapidfire(model) if kind == "rapidfire" else torch.optim.AdamW(model.parameters(), lr=1e-2)
    health = step_health(opt, guard=True, max_consecutive_skips=5)
    recorded = []
    record = health.record
    health.record = lambda name, value, reduce="mean": (
        recorded.append((name, reduce)),
        record(name, value, reduce),
    )
    params = list(model.parameters())
    loss_of(model, 0).backward()
    first = close_window(
        health, opt, params, loss=torch.tensor(1.0), records=(("approx_kl", torch.zeros(()), "max"),)
    )
    assert first == ClosedWindow(steps=1, rollback=health.last_rollback()) and recorded == [
        ("approx_kl", "max")
    ]
    opt.zero_grad(set_to_none=True)
    loss_of(model, 1).backward()  # finite gradients, a non-finite loss
    before = [p.detach().clone() for p in params]
    second = close_window(health, opt, params, loss=torch.tensor(float("nan")))
    health.verify_now()
    assert all(torch.equal(a, b) for a, b in zip(before, params)) and health.skipped() == 1
    assert second.steps == 2 == health.steps()
