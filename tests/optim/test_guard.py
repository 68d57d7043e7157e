"""Non-finite steps never reach the weights: NonFiniteGuard around a plain optimizer, and
RapidFireOptimizer's defaults, against the inner optimizer alone skipping the bad batch (bit-exact)."""

from __future__ import annotations

import logging

import pytest
import torch

from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.optim.guard import NonFiniteGuard
from rapidfire_hf.optim.skips import ConsecutiveSkipsError
from tests.helpers.faults_train import add_to_loss_at, inf_in_grad_at, scale_loss_at
from tests.optim.helpers import assert_same_params, loss_of, make_model, train

STEPS, K = 12, 5
KERNELS = {"foreach": {"foreach": True}, "fused": {"fused": True}}  # host read / found_inf in the kernel


def reference_without(skipped, kernel="foreach", steps=STEPS):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **KERNELS[kernel])
    train(model, opt, [i for i in range(steps) if i not in skipped])
    return model


def guarded_run(kernel, inject, steps=STEPS, limit=10):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **KERNELS[kernel])
    guard = NonFiniteGuard(limit)
    for step in range(steps):
        loss = inject(step, loss_of(model, step), model)
        guard.observe_loss(loss)
        loss.backward()
        guard.step(opt, list(model.parameters()))
        opt.zero_grad()
    return model, opt, guard


@pytest.mark.parametrize("kernel", ["foreach", "fused"])
@pytest.mark.parametrize(
    "fault, reasons",
    [
        ("nan_loss", ["finite_loss", "finite_grads"]),
        ("nan_loss_finite_grads", ["finite_loss"]),
        ("inf_grad", ["finite_grads"]),
    ],
)
def test_guard_skips_exactly(kernel, fault, reasons, caplog):
    inject = {
        "nan_loss": scale_loss_at(K, float("nan")),
        "nan_loss_finite_grads": add_to_loss_at(K, float("nan")),
        "inf_grad": lambda step, loss, m: inf_in_grad_at(K, m[2].weight)(step, loss, m),
    }[fault]
    with caplog.at_level(logging.WARNING, logger="rapidfire_hf.optim"):
        model, opt, guard = guarded_run(kernel, inject)
        assert guard.drain() == 1
    assert_same_params(model, reference_without({K}, kernel))
    assert guard.skipped == 1 and guard.steps == STEPS
    (record,) = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert f"step {K} skipped" in record.getMessage()
    assert all(r in record.getMessage() for r in reasons)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_guard_without_the_guard_the_weights_go_nan():
    """The fault is real: the same run without the guard ends with NaN weights."""
    model = make_model()
    train(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
        list(range(STEPS)),
        inject=scale_loss_at(K, float("nan")),
    )
    assert torch.isnan(next(model.parameters())).all()


@pytest.mark.parametrize("kernel", ["foreach", "fused"])
def test_guard_stops_after_consecutive_skips(kernel, caplog):
    nan_from_3 = lambda step, loss, m: loss * float("nan") if step >= 3 else loss  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="rapidfire_hf.optim"):
        _, _, guard = guarded_run(kernel, nan_from_3, steps=8, limit=4)
        with pytest.raises(ConsecutiveSkipsError) as err:
            guard.drain()
    message = str(err.value)
    assert "4 optimizer steps in a row (steps 3-6)" in message
    assert "finite_loss" in message and "kl_coef" in message and "max_consecutive_skips" in message
    assert [f"step {s} skipped" in r.getMessage() for s, r in zip(range(3, 7), caplog.records)] == [True] * 4


def test_guard_limit_is_checked():
    with pytest.raises(ValueError, match="max_consecutive_skips=0: must be an int >= 1"):
        NonFiniteGuard(0)
    with pytest.raises(ValueError, match="max_consecutive_skips=0"):
        RapidFireOptimizer(make_model().parameters(), lr=1e-2, max_consecutive_skips=0)


@pytest.mark.parametrize("pipeline", [False, True])
def test_rapidfire_optimizer_protects_by_default(pipeline):
    """No rollback argument: a NaN loss at step K leaves the run equal to one that skipped batch K."""
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=pipeline)
    train(model, opt, list(range(STEPS)), inject=scale_loss_at(K, float("nan")))
    assert_same_params(model, reference_without({K}))
    assert opt.stats()["skipped"] == 1


@pytest.mark.parametrize("pipeline", [False, True])
def test_rapidfire_optimizer_stops_after_consecutive_skips(pipeline, caplog):
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=pipeline, max_consecutive_skips=3)
    nan_from_2 = lambda step, loss, m: loss * float("nan") if step >= 2 else loss  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="rapidfire_hf.optim"):
        with pytest.raises(ConsecutiveSkipsError, match=r"3 optimizer steps in a row \(steps 2-4\)"):
            train(model, opt, list(range(STEPS)), inject=nan_from_2)
    assert [r.getMessage().split(" skipped")[0] for r in caplog.records] == [
        "RapidFireOptimizer: step 2",
        "RapidFireOptimizer: step 3",
        "RapidFireOptimizer: step 4",
    ]
    assert_same_params(model, reference_without(set(range(2, STEPS))))  # nothing after step 1 applied


def test_a_healthy_step_resets_the_streak():
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, max_consecutive_skips=3)
    every_other = lambda step, loss, m: loss * float("nan") if step % 2 else loss  # noqa: E731
    train(model, opt, list(range(STEPS)), inject=every_other)
    assert opt.stats()["skipped"] == STEPS // 2
    assert_same_params(model, reference_without(set(range(1, STEPS, 2))))
