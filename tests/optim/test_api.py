"""Construction forms, misuse errors, state_dict round trip."""

from __future__ import annotations

import copy

import pytest
import torch

from rapidfire_hf.optim import RapidFireOptimizer
from tests.optim.helpers import assert_same_params, make_model, train


def test_deferred_bind_then_train():
    opt = RapidFireOptimizer(lr=1e-2, gradient_pipeline=True, rollback="auto")
    assert not opt.is_bound
    for use in (
        lambda: opt.step(),
        lambda: opt.param_groups,
        lambda: opt.state_dict(),
        lambda: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    ):
        with pytest.raises(RuntimeError, match="give the optimizer to a trainer"):
            use()
    model, ref = make_model(), make_model()
    assert opt.bind(model.parameters()) is opt and opt.is_bound
    with pytest.raises(RuntimeError, match="bind\\(\\) may be called once"):
        opt.bind(model.parameters())
    train(model, opt, list(range(10)))
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True), list(range(10)))
    assert_same_params(model, ref)
    assert opt.stats()["pipelined_steps"] == 10


def test_defaults_come_from_the_inner_optimizer():
    opt = RapidFireOptimizer(make_model().parameters(), lr=3e-4, weight_decay=0.05)
    ref = torch.optim.AdamW(make_model().parameters(), lr=3e-4, weight_decay=0.05)
    assert opt.defaults["betas"] == ref.defaults["betas"] and opt.param_groups[0]["weight_decay"] == 0.05
    assert isinstance(opt, torch.optim.Optimizer) and opt.defaults["foreach"] is True


def test_instance_and_class_forms():
    model, ref = make_model(), make_model()
    opt = RapidFireOptimizer(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), gradient_pipeline=True)
    train(model, opt, list(range(5)))
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), list(range(5)))
    assert_same_params(model, ref)
    by_class = RapidFireOptimizer(make_model().parameters(), optimizer=torch.optim.Adagrad, lr=0.1)
    assert isinstance(by_class.inner, torch.optim.Adagrad)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"lr": 1e-3, "gradient_pipline": True}, TypeError, "gradient_pipline"),
        ({"optimizer": "sgd", "lr": 0.1, "betas": (0.9, 0.99)}, TypeError, "betas"),
        ({"optimizer": "lion"}, ValueError, "adamw8bit"),
        ({"precision": "fp8"}, ValueError, "choose .bf16., .fp16."),
        ({"rollback": "sometimes"}, ValueError, "auto"),
        ({"snapshot": "disk"}, ValueError, "host"),
        ({"accumulation_steps": 0}, ValueError, "accumulation_steps"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
        ({"optimizer": torch.optim.SGD, "enable_fused_kernels": True, "lr": 0.1}, None, None),
    ],
)
def test_bad_arguments_fail_before_any_weight_changes(kwargs, error, match):
    if error is None:  # SGD has a fused kernel: accepted
        RapidFireOptimizer(make_model().parameters(), **kwargs)
        return
    with pytest.raises(error, match=match):
        RapidFireOptimizer(**kwargs)  # deferred form: errors before params exist


def test_fused_kernels_flag_is_real():
    class NoFused(torch.optim.SGD):
        def __init__(self, params, lr=0.1):
            super().__init__(params, lr=lr)

    with pytest.raises(ValueError, match="no fused implementation"):
        RapidFireOptimizer(make_model().parameters(), optimizer=NoFused, enable_fused_kernels=True)
    opt = RapidFireOptimizer(make_model().parameters(), lr=1e-3, enable_fused_kernels=False)
    assert opt.defaults["foreach"] is False and opt.defaults["fused"] is False


def test_closure_and_instance_misuse():
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="does not support closures"):
        opt.step(lambda: 0.0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="already holds its parameters"):
        RapidFireOptimizer(model.parameters(), optimizer=inner)
    with pytest.raises(TypeError, match="hyper-parameters"):
        RapidFireOptimizer(optimizer=inner, lr=0.2)


def _hide_bitsandbytes(monkeypatch):
    """Make bitsandbytes look absent to rapidfire_hf's dependency checks (it may well be installed)."""
    from rapidfire_hf.utils import imports

    original = imports.is_available
    monkeypatch.setattr(imports, "is_available", lambda name: name != "bitsandbytes" and original(name))


def test_missing_bitsandbytes_names_the_extra(monkeypatch):
    _hide_bitsandbytes(monkeypatch)
    with pytest.raises(ImportError, match=r"rapidfire_hf\[bnb\]"):
        RapidFireOptimizer(optimizer="adamw8bit", lr=1e-3)


@pytest.mark.parametrize("pipeline", [True, False])
def test_state_dict_round_trip_resumes_identically(pipeline):
    def make(model):
        opt = RapidFireOptimizer(
            model.parameters(),
            lr=1e-2,
            gradient_pipeline=pipeline,
            rollback="auto",
            max_grad_norm=50.0,
            warmup_steps=3,
        )
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))

    whole = make_model()
    opt, sched = make(whole)
    train(whole, opt, list(range(12)), sched=sched)

    first = make_model()
    opt, sched = make(first)
    train(first, opt, list(range(6)), sched=sched)
    saved = copy.deepcopy((first.state_dict(), opt.state_dict(), sched.state_dict()))
    resumed = make_model(seed=1)
    resumed.load_state_dict(saved[0])
    opt2, sched2 = make(resumed)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    train(resumed, opt2, list(range(6, 12)), sched=sched2)
    assert_same_params(resumed, whole)
    assert opt2.stats()["steps"] == 12  # the counters travel with the state dict


def test_parameters_swapped_into_the_groups_are_the_ones_checked():
    """accelerate.prepare under FSDP2 puts new (sharded) tensors into the optimizer's groups after the
    optimizer was bound: verification and clipping must see those, not the tensors from binding."""
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, rollback="auto", max_grad_norm=1.0)
    new = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt.param_groups[0]["params"] = new  # what a sharding prepare does to the groups
    for p in new:
        p.grad = torch.full_like(p, 1e-3)
    new[0].grad[0] = float("nan")
    before = [p.detach().clone() for p in new]
    opt.step()
    assert opt.last_step_skipped and opt.events[-1].reasons == ["finite_grads"]
    assert all(torch.equal(a, b) for a, b in zip(before, new))  # nothing applied
    for p in new:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    assert not opt.last_step_skipped and not torch.equal(before[1], new[1])
