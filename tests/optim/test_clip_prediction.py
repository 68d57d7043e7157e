"""clip_prediction="scale": windows where clipping binds are stepped in the hooks with a predicted coefficient.

The reference is the inner optimizer alone on the same gradients multiplied by the coefficient the
optimizer reports as predicted (bit-exact on CPU fp32); the first window (no norm history) is clipped
exactly, as ``clip_grad_norm_`` does. A prediction outside ``clip_tolerance`` is rolled back exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rapidfire_hf.optim import RapidFireOptimizer
from tests.optim.helpers import assert_same_params, loss_of, make_model

MAX_NORM = 0.05  # far below this model's gradient norms (~1): clipping binds at every step
STEPS = 6


def _scaled_run(tolerance: float, scale_of_step=lambda step: 1.0, backoff: int = 0):
    model = make_model()
    opt = RapidFireOptimizer(
        model.parameters(),
        lr=1e-2,
        gradient_pipeline=True,
        pipeline_bucket_mb=0.0005,  # several buckets
        max_grad_norm=MAX_NORM,
        rollback="auto",
        clip_prediction="scale",
        clip_tolerance=tolerance,
        clip_backoff=backoff,
    )
    records = []
    for step in range(STEPS):
        before = copy.deepcopy(model)
        loss = loss_of(model, step) * scale_of_step(step)
        opt.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = opt.stats()
        records.append((before, stats["clip_coef_predicted"], stats["clip_coef_true"], opt.last_step_skipped))
    return model, opt, records


def test_predicted_coefficient_is_applied_in_the_hooks():
    model, opt, records = _scaled_run(tolerance=0.5)
    stats = opt.stats()
    assert stats["pipelined_steps"] == STEPS - 1  # all but the first window (no norm history yet)
    accepted = sum(1 for r in records[1:] if not r[3])
    assert accepted >= 3 and stats["rollbacks"] == stats["clip_misses"] == STEPS - 1 - accepted

    ref = make_model()
    inner = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    true_norms = []
    for step, (_, predicted, true, skipped) in enumerate(records):
        loss_of(ref, step).backward()
        grads = [p.grad for p in ref.parameters()]
        norm = torch.nn.utils.get_total_norm(grads)
        true_norms.append(float(norm))
        if step == 0:
            assert predicted is None  # deferred: exact clipping in step()
            torch.nn.utils.clip_grads_with_norm_(list(ref.parameters()), MAX_NORM, norm)
        else:
            # predicted from the previous window's true norm
            assert predicted == pytest.approx(MAX_NORM / (true_norms[step - 1] + 1e-6), rel=1e-6)
            assert true == pytest.approx(MAX_NORM / (true_norms[step] + 1e-6), rel=1e-6)
            assert skipped == (abs(predicted - true) > 0.5 * true)
            torch._foreach_mul_(grads, predicted)
        if not skipped:  # a missed window is undone: no update, the next prediction uses its norm
            inner.step()
        inner.zero_grad()
    assert_same_params(model, ref)


def test_after_a_miss_windows_back_off_to_exact_steps():
    """The loss grows 3x per step: every prediction from the last norm misses. With the back-off the
    window after a miss is stepped exactly (deferred), then 2, 4, ... windows: fewer rollbacks, and the
    parameters equal the no-back-off run's up to what the deferred windows clip exactly."""
    grow = lambda step: 3.0**step  # noqa: E731
    _, plain, _ = _scaled_run(tolerance=0.01, scale_of_step=grow)
    _, backed, _ = _scaled_run(tolerance=0.01, scale_of_step=grow, backoff=16)
    p, b = plain.stats(), backed.stats()
    assert p["clip_misses"] == STEPS - 1  # without back-off every predicted window missed
    assert b["clip_misses"] < p["clip_misses"] and b["deferred_steps"].get("recent_clip_miss", 0) >= 1
    assert b["rollbacks"] == b["clip_misses"]


def test_prediction_outside_tolerance_is_rolled_back_exactly():
    # the loss grows 3x per step, so the gradient norm (and the true coefficient) jumps each window
    model, opt, records = _scaled_run(tolerance=0.01, scale_of_step=lambda step: 3.0**step)
    stats = opt.stats()
    assert stats["clip_misses"] >= 1 and stats["rollbacks"] == stats["clip_misses"]
    for step, (before, predicted, true, skipped) in enumerate(records):
        if skipped:  # the window's update was undone: parameters as before it, bit for bit
            assert abs(predicted - true) > 0.01 * true
            after = records[step + 1][0] if step + 1 < len(records) else model
            assert_same_params(after, before)
    assert any(event.kind == "rollback" and "clip_prediction" in event.reasons for event in opt.events)


def test_exact_mode_still_defers_binding_windows():
    model = make_model()
    opt = RapidFireOptimizer(
        model.parameters(),
        lr=1e-2,
        gradient_pipeline=True,
        max_grad_norm=MAX_NORM,
        rollback="auto",
        clip_prediction="exact",
    )
    for step in range(4):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    assert opt.stats()["pipelined_steps"] == 0
    assert opt.stats()["deferred_steps"]["clip_may_bind"] >= 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"clip_prediction": "guess", "max_grad_norm": 1.0, "rollback": "auto"}, "clip_prediction='guess'"),
        ({"clip_prediction": "scale", "rollback": "auto"}, "needs max_grad_norm"),
        ({"clip_prediction": "scale", "max_grad_norm": 1.0, "rollback": "off"}, "rollback='auto'"),
        ({"clip_tolerance": 0.0}, r"clip_tolerance=0.0: must be in \(0, 1\)"),
        ({"clip_tolerance": 1.5}, "clip_tolerance=1.5"),
    ],
)
def test_bad_clip_prediction_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RapidFireOptimizer(make_model().parameters(), lr=1e-2, gradient_pipeline=True, **kwargs)


@pytest.mark.parametrize(
    "kwargs, mode",
    [
        (
            {"max_grad_norm": MAX_NORM},
            "exact",
        ),  # a plain loop cannot replay a miss: never predicted by default
        ({"max_grad_norm": MAX_NORM, "rollback": "off"}, "exact"),
        ({}, "exact"),
    ],
)
def test_exact_clipping_is_the_default(kwargs, mode):
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, **kwargs)
    assert opt.clip_prediction == mode
    for step in range(STEPS):
        loss = loss_of(model, step)
        opt.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    stats = opt.stats()
    if mode == "scale":  # binding windows are pipelined too, every one checked
        assert stats["pipelined_steps"] >= STEPS - 1 - stats["clip_misses"] > 0
        assert stats["clip_checks"] == stats["pipelined_steps"]


def test_a_plain_loop_is_told_once_that_a_missed_window_was_skipped():
    grow = lambda step: 3.0**step  # noqa: E731 (every prediction misses)
    with pytest.warns(UserWarning, match="Nothing replays it in a plain loop") as record:
        _scaled_run(tolerance=0.01, scale_of_step=grow)
    assert sum("plain loop" in str(w.message) for w in record) == 1


def test_a_replaying_trainer_gets_no_warning():
    import warnings

    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, max_grad_norm=MAX_NORM,
                             rollback="auto", clip_prediction="scale", clip_tolerance=0.01, clip_backoff=0)  # fmt: skip
    opt.replays_missed_windows = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(STEPS):
            (loss_of(model, step) * 3.0**step).backward()
            opt.step()
            opt.zero_grad()
    assert opt.stats()["clip_misses"] >= 1


def test_a_clip_handed_over_later_clips_like_one_given_at_construction():
    """PPOTrainer hands PPOConfig's max_grad_norm to a pipelined optimizer built without one, also with
    rollback='off' (whose pipeline recorded no gradient norms until then)."""
    given, handed = make_model(), make_model()
    kw = dict(lr=1e-2, gradient_pipeline=True, rollback="off", pipeline_bucket_mb=0.0005)
    a = RapidFireOptimizer(given.parameters(), max_grad_norm=MAX_NORM, **kw)
    b = RapidFireOptimizer(handed.parameters(), **kw)
    b.set_max_grad_norm(MAX_NORM)
    scale = [1e-3] * (STEPS - 1) + [1e3]  # clipping cannot bind until the last step, which it must clip
    with pytest.warns(UserWarning, match="clipping would have bound"):
        for step in range(STEPS):
            for model, opt in ((given, a), (handed, b)):
                (loss_of(model, step) * scale[step]).backward()
                opt.step()
                opt.zero_grad()
    kinds = [[e.kind for e in opt.events] for opt in (a, b)]
    assert kinds[0] == kinds[1] and "clip_miss_unrecoverable" in kinds[0]
    assert_same_params(given, handed)
    with pytest.raises(ValueError, match="max_grad_norm=0"):
        b.set_max_grad_norm(0)
