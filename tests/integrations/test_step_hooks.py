"""The one ``training_step`` wrapper of ``rapidfire_hf.integrations.step_hooks`` and its observers.

``enable_rapidfire`` registers three observers (the optimizer's loss feed, the precision plugin, the
metrics' token count) on a single wrapper. The tests here check that wrapper's shape and call order, and,
on a real ``SFTTrainer`` over a tiny Llama, what each observer delivers: the loss that reaches
``RapidFireOptimizer.observe_loss``, the calibration batch and window loss of the precision plugin, and
the tokens the metrics count. Each delivery is checked once with every observer in place and once with
that observer removed from the list, where it must be missing.
"""

from __future__ import annotations

import pytest
import torch
from rf_trainers import STEPS

from rapidfire_hf.integrations import enable_rapidfire
from rapidfire_hf.integrations.callbacks import CALIBRATION_ROWS
from rapidfire_hf.integrations.step_hooks import add_step_observer, step_observers
from rapidfire_hf.optim import RapidFireOptimizer

ENABLED = ["optimizer.loss", "precision", "skips.loss", "metrics.tokens"]
# adaptive precision over the trainer's bf16 autocast with fp32 weights: the plugin calibrates
CONFIG = {"gradient": {"pipeline": True}, "precision": {"mode": "adaptive"}}


def test_enable_rapidfire_installs_one_wrapper_with_its_observers(build):
    from trl import SFTTrainer

    trainer = enable_rapidfire(build("sft"), config=CONFIG)
    step = trainer.training_step
    assert [o.name for o in step_observers(trainer)] == ENABLED
    original = step.__wrapped__  # the trainer's own bound method, one level down
    assert original.__func__ is SFTTrainer.training_step and original.__self__ is trainer
    assert not hasattr(original, "__wrapped__")
    add_step_observer(trainer, "another")
    assert trainer.training_step is step and step_observers(trainer) is step_observers(trainer)
    assert [o.name for o in step_observers(trainer)][-1] == "another"


def test_hooks_run_in_registration_order_around_the_step(build):
    trainer = build("sft", max_steps=2)
    events, returned, seen = [], [], []
    for name in ("a", "b"):
        add_step_observer(
            trainer,
            name,
            before=lambda model, inputs, name=name: events.append(f"{name}.before"),
            after=lambda loss, name=name: (events.append(f"{name}.after"), seen.append(loss)),
        )
    add_step_observer(trainer, "only-after", after=lambda loss: events.append("only-after.after"))
    trainer.model.register_forward_pre_hook(lambda *_: events.append("forward"))
    observed = trainer.training_step

    def outer(*args, **kwargs):
        returned.append(observed(*args, **kwargs))
        return returned[-1]

    trainer.training_step = outer
    trainer.train()
    per_step = ["a.before", "b.before", "forward", "a.after", "b.after", "only-after.after"]
    assert events == per_step * 2
    assert len(returned) == 2 and len(seen) == 4
    assert all(s is r for s, r in zip(seen, [r for r in returned for _ in "ab"], strict=True))


class _Trainer:
    """A stand-in with a ``training_step`` method, for the exception paths."""

    def __init__(self, events, fail=False):
        self.events, self.fail = events, fail

    def training_step(self, model, inputs):
        self.events.append("step")
        if self.fail:
            raise RuntimeError("step")
        return torch.tensor(1.0)


def _raise(message):
    raise RuntimeError(message)


@pytest.mark.parametrize(
    "failing, expected",
    [
        ("a.before", ["a.before"]),
        ("step", ["a.before", "b.before", "step"]),
        ("a.after", ["a.before", "b.before", "step", "a.after"]),
    ],
)
def test_an_exception_propagates_and_skips_what_follows(failing, expected):
    events = []
    trainer = _Trainer(events, fail=failing == "step")

    def hook(name):
        def run(*_):
            events.append(name)
            if name == failing:
                _raise(name)

        return run

    for name in ("a", "b"):
        add_step_observer(trainer, name, before=hook(f"{name}.before"), after=hook(f"{name}.after"))
    with pytest.raises(RuntimeError, match=failing):
        trainer.training_step(None, {})
    assert events == expected


def _run_recording(trainer, monkeypatch):
    """Train ``trainer``; what each observer delivered, and the steps' inputs and losses."""
    calls = {"inputs": [], "losses": [], "observed": [], "calibrated": [], "window_loss": [], "tokens": []}
    observe = RapidFireOptimizer.observe_loss

    def observe_loss(self, loss):
        calls["observed"].append(loss)
        return observe(self, loss)

    monkeypatch.setattr(RapidFireOptimizer, "observe_loss", observe_loss)
    parts = trainer._rapidfire.parts
    plugin, metrics = parts["precision"].plugin, parts["metrics"]
    calibrate, on_step_end, collect = plugin.calibrate, plugin.on_step_end, metrics.collect

    def calibrating(batch, *args, **kwargs):
        calls["calibrated"].append({k: v.clone() for k, v in batch.items()})
        return calibrate(batch, *args, **kwargs)

    def stepping(step, values):
        calls["window_loss"].append(values.get("loss"))
        return on_step_end(step, values)

    def collecting():
        calls["tokens"].append(metrics._tokens)
        return collect()

    plugin.calibrate, plugin.on_step_end, metrics.collect = calibrating, stepping, collecting
    observed_step = trainer.training_step

    def outer(model, inputs, *args, **kwargs):  # outside rapidfire's wrapper: what the trainer hands over
        calls["inputs"].append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        calls["losses"].append(observed_step(model, inputs, *args, **kwargs))
        return calls["losses"][-1]

    trainer.training_step = outer
    trainer.train()
    assert len(calls["inputs"]) == len(calls["losses"]) == STEPS  # one micro-batch per step
    return calls


@pytest.mark.parametrize("removed", [None, *ENABLED])
def test_each_observer_delivers_what_its_part_reads(build, monkeypatch, removed):
    trainer = enable_rapidfire(build("sft"), config=CONFIG)
    observers = step_observers(trainer)
    observers[:] = [o for o in observers if o.name != removed]
    calls = _run_recording(trainer, monkeypatch)
    losses = calls["losses"]

    # optimizer.loss: every micro-batch's loss reaches observe_loss, detached
    if removed == "optimizer.loss":
        assert calls["observed"] == []
    else:
        assert len(calls["observed"]) == STEPS
        for seen, loss in zip(calls["observed"], losses, strict=True):
            assert not seen.requires_grad and torch.equal(seen, loss)

    # precision: the first micro-batch's first rows are calibrated on; each step's loss reaches the plugin
    assert len(calls["window_loss"]) == STEPS
    if removed == "precision":
        assert calls["calibrated"] == [] and calls["window_loss"] == [None] * STEPS
    else:
        first = calls["inputs"][0]
        assert len(calls["calibrated"]) == 1
        assert calls["calibrated"][0].keys() == {"input_ids", "attention_mask"}
        for key, value in calls["calibrated"][0].items():
            assert torch.equal(value, first[key][:CALIBRATION_ROWS])
        for window, loss in zip(calls["window_loss"], losses, strict=True):
            assert torch.equal(window, loss)

    # metrics.tokens: the non-padding tokens of each step's micro-batch are counted before it is logged
    assert len(calls["tokens"]) == STEPS
    if removed == "metrics.tokens":
        assert calls["tokens"] == [0] * STEPS
    else:
        expected = [int(inputs["attention_mask"].sum()) for inputs in calls["inputs"]]
        assert calls["tokens"] == expected and all(t > 0 for t in expected)
