"""Spike rules with robust statistics: caught from the first steps, not poisoned by an earlier spike,
and no false alarm on a clean run. Each skipped run equals the inner optimizer alone without the bad
batches (bit-exact on CPU fp32)."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.optim.health import HealthMonitor, RobustStat
from tests.helpers.faults_train import add_to_loss_at
from tests.optim.helpers import assert_same_params, make_model, train

STEPS = 24


def spikes_at(steps, factor=1000.0):
    chosen = set(steps)

    def inject(step, loss, model):
        return loss * factor if step in chosen else loss

    return inject


def reference_without(skipped, steps=STEPS):
    model = make_model()
    train(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
        [i for i in range(steps) if i not in skipped],
    )
    return model


def run(inject, pipeline=True, **kw):
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=pipeline, **kw)
    train(model, opt, list(range(STEPS)), inject=inject)
    return model, opt


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_a_1000x_spike_in_the_first_steps_is_caught(k):
    model, opt = run(spikes_at([k]))
    (event,) = opt.events
    assert event.step == k and {"grad_norm_zscore", "loss_spike"} <= set(event.reasons)
    assert_same_params(model, reference_without({k}))


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_spike_does_not_hide_the_next_one(pipeline):
    model, opt = run(spikes_at([5, 14]), pipeline=pipeline)
    assert [e.step for e in opt.events] == [5, 14]
    assert_same_params(model, reference_without({5, 14}))


def test_loss_jump_with_clean_gradients_is_caught_early():
    model, opt = run(add_to_loss_at([2, 12], 1000.0))
    assert [(e.step, e.reasons) for e in opt.events] == [(2, ["loss_spike"]), (12, ["loss_spike"])]
    assert_same_params(model, reference_without({2, 12}))


def test_clean_run_has_no_false_alarm():
    model, opt = run(None)
    assert opt.events == [] and opt.stats()["skipped"] == 0
    assert_same_params(model, reference_without(set()))


def test_robust_stat_ignores_one_outlier():
    stat = RobustStat(window=8)
    for x in [1.0, 1.1, 0.9, 1.0]:
        stat.update(torch.tensor(x), threshold=6.0, floor=1e-3)
    before = stat.center_scale(1e-3)
    stat.update(torch.tensor(1000.0), threshold=6.0, floor=1e-3)  # clipped before it enters the window
    center, scale = stat.center_scale(1e-3)
    assert center == before[0] and float(stat.values[4]) == pytest.approx(float(before[0] + 6 * before[1]))
    assert float(scale) < 0.2
    assert float(stat.zscore(torch.tensor(1000.0), 1e-3)) > 1000


def test_warmup_judges_against_the_magnitude():
    """With one sample the spread is unknown: the floor is the typical magnitude, so 2x passes and 1000x fails."""
    monitor = HealthMonitor(grad_z_threshold=6.0, loss_z_threshold=6.0, warmup_steps=10)
    monitor.update_stats({"grad_norm": torch.tensor(2.0)})
    for value, healthy in [(4.0, True), (2000.0, False)]:
        flags = monitor.flags(monitor.metrics(torch.tensor(value)))
        assert bool(flags["grad_norm_zscore"]) is healthy


def test_a_lasting_shift_is_followed():
    """Values of failed windows enter the window clipped: a lasting new level (3x, from a history with 10%
    noise) fails for a while, then passes again instead of failing forever."""
    monitor = HealthMonitor(grad_z_threshold=6.0, loss_z_threshold=6.0, warmup_steps=2)
    for i in range(20):
        monitor.update_stats({"grad_norm": torch.tensor(1.0 + 0.1 * (i % 3 - 1))})
    verdicts = []
    for _ in range(40):
        metrics = monitor.metrics(torch.tensor(3.0))
        failed = [n for n, ok in monitor.flags(metrics).items() if not bool(ok)]
        verdicts.append(bool(failed))
        monitor.update_stats(metrics, failed)
    assert verdicts[0] and not verdicts[-1] and 1 < sum(verdicts) < 30


def test_old_state_dict_starts_afresh():
    stat = RobustStat()
    stat.load_state_dict({"count": 5, "mean": torch.tensor(1.0), "var": torch.tensor(0.1)})
    assert stat.count == 0 and stat.values is None


def test_a_near_zero_signed_loss_is_judged_on_its_own_scale():
    """PPO's loss hovers near zero: 0.003 then 0.033 is no spike on a scale of 1, a jump of 1000 is."""
    from rapidfire_hf.optim.health import HealthMonitor

    def second_step_healthy(scale, second):
        monitor = HealthMonitor(grad_z_threshold=6.0, loss_z_threshold=6.0, warmup_steps=10)
        if scale is not None:
            monitor.set_loss_scale(scale)
        monitor.update_stats({"loss": torch.tensor(0.003)})
        monitor.observe_loss(torch.tensor(second))
        return bool(monitor.flags(monitor.metrics(None))["loss_spike"])

    assert not second_step_healthy(None, 0.0326)  # relative floor alone: a false spike
    assert second_step_healthy(1.0, 0.0326)
    assert not second_step_healthy(1.0, 1000.0)
    with pytest.raises(ValueError, match="loss scale"):
        second_step_healthy(-1.0, 0.0)
