"""The gradient pipeline against the inner optimizer alone: bit-exact in fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.optim import RapidFireOptimizer
from tests.optim.helpers import assert_same_params, loss_of, make_model, train, two_groups

STEPS = 20
INNER = {
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, foreach=True, **kw),
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, momentum=0.9, **kw),
}
EXTRA = {"adamw": {}, "sgd": {"momentum": 0.9}}


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_matches_inner_alone(name, pipeline, accumulation):
    ref_model = make_model()
    train(
        ref_model,
        INNER[name](two_groups(ref_model), lr=1e-2),
        list(range(STEPS * accumulation)),
        accumulation,
    )
    model = make_model()
    opt = RapidFireOptimizer(
        two_groups(model),
        optimizer=name,
        lr=1e-2,
        gradient_pipeline=pipeline,
        accumulation_steps=accumulation if pipeline else None,
        **EXTRA[name],
    )
    train(model, opt, list(range(STEPS * accumulation)), accumulation)
    assert_same_params(model, ref_model)
    assert opt.stats()["pipelined_steps"] == (STEPS if pipeline else 0)
    assert opt.stats()["steps"] == STEPS


@pytest.mark.parametrize("pipeline", [True, False])
def test_lr_scheduler_acts_on_what_steps(pipeline):
    def linear(step):
        return 1.0 - step / STEPS

    ref_model, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(two_groups(ref_model), lr=1e-2, foreach=True)
    train(ref_model, ref_opt, list(range(STEPS)), sched=torch.optim.lr_scheduler.LambdaLR(ref_opt, linear))
    opt = RapidFireOptimizer(two_groups(model), lr=1e-2, gradient_pipeline=pipeline)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear)
    train(model, opt, list(range(STEPS)), sched=sched)
    assert_same_params(model, ref_model)
    assert sched.get_last_lr()[0] == pytest.approx(0.0)
    # a schedule that did not reach the pipelined steps would leave the result equal to constant lr
    const = make_model()
    train(const, torch.optim.AdamW(two_groups(const), lr=1e-2, foreach=True), list(range(STEPS)))
    assert not torch.equal(next(const.parameters()), next(model.parameters()))


@pytest.mark.parametrize("max_norm", [100.0, 0.05], ids=["never-binds", "binds"])
def test_clipping_matches_clip_grad_norm(max_norm):
    ref_model, model = make_model(), make_model()
    train(
        ref_model,
        torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=True),
        list(range(STEPS)),
        clip=max_norm,
    )
    opt = RapidFireOptimizer(
        model.parameters(), lr=1e-2, gradient_pipeline=True, max_grad_norm=max_norm, clip_prediction="exact"
    )
    train(model, opt, list(range(STEPS)))
    assert_same_params(model, ref_model)  # bit-exact: same norm and coefficient as clip_grad_norm_
    stats = opt.stats()
    if max_norm > 1:  # the first window has no norm history; the others are predicted safe
        assert stats["pipelined_steps"] == STEPS - 1 and stats["clip_misses"] == 0
    else:  # clipping binds every time: those windows step in step() with the exact coefficient
        assert stats["pipelined_steps"] == 0 and stats["deferred_steps"]["clip_may_bind"] == STEPS
        assert stats["clip_coef_true"] < 1


def test_clip_miss_rolls_back_and_replay_clips_exactly():
    """A batch whose norm jumps past max_grad_norm after a calm history: the pipelined (unclipped) update
    is undone, and replaying the batch applies it clipped, as clip_grad_norm_ + AdamW would."""
    k, max_norm = 8, 5.0

    def big(step, loss, model):
        return loss * 30 if step == k else loss

    ref_model, model = make_model(), make_model()
    ref_scaled = [30.0 if s == k else 1.0 for s in range(STEPS)]
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=True)
    train(
        ref_model, ref_opt, list(range(STEPS)), clip=max_norm, inject=lambda s, loss, m: loss * ref_scaled[s]
    )
    opt = RapidFireOptimizer(
        model.parameters(),
        lr=1e-2,
        gradient_pipeline=True,
        max_grad_norm=max_norm,
        rollback="auto",
        clip_prediction="exact",
        grad_z_threshold=1e9,  # a 30x jump is a spike too: here only the clip prediction is tested
        loss_z_threshold=1e9,
    )
    train(model, opt, list(range(STEPS)), inject=big, replay=True)
    events = [e for e in opt.events if e.kind == "rollback"]
    assert len(events) == 1 and events[0].reasons == ["clip_prediction"] and events[0].step == k
    assert opt.stats()["clip_misses"] == 1
    assert_same_params(model, ref_model)


def test_gradient_accumulation_under_accelerate():
    from accelerate import Accelerator

    def run(make_opt):
        model = make_model()
        acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
        model, opt = acc.prepare(model, make_opt(model))
        for i in range(2 * STEPS):
            with acc.accumulate(model):
                acc.backward(((model(torch.ones(1, 6) * i / 10) - 1) ** 2).mean() + 0 * i)
                opt.step()
                opt.zero_grad()
        return model, opt

    ref, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True))
    model, opt = run(lambda m: RapidFireOptimizer(m.parameters(), lr=1e-2, gradient_pipeline=True))
    assert_same_params(model, ref)
    assert opt.optimizer.stats()["pipelined_steps"] == STEPS  # the window closes on sync_gradients


def test_disable_enable_mid_run():
    ref_model, model = make_model(), make_model()
    train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=True), list(range(15)))
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, rollback="auto")
    train(model, opt, list(range(5)))
    opt.disable_pipeline()
    assert not opt.pipeline_enabled
    train(model, opt, list(range(5, 10)))
    opt.enable_pipeline()
    train(model, opt, list(range(10, 15)))
    assert_same_params(model, ref_model)
    assert opt.stats()["pipelined_steps"] == 10


@pytest.mark.parametrize("bucket_mb", [0.0, 0.0005, 256.0], ids=["per-param", "several", "one-bucket"])
@pytest.mark.parametrize("rollback", ["off", "auto"])
def test_hooks_apply_the_update_inside_backward(bucket_mb, rollback):
    """When backward returns, every parameter already holds the inner optimizer's update (bit-exact) and
    its gradient is freed: the step happened in the hooks, not later in step()."""
    ref_model, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(two_groups(ref_model), lr=1e-2, foreach=True)
    opt = RapidFireOptimizer(
        two_groups(model), lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=bucket_mb, rollback=rollback
    )
    for step in range(6):
        loss_of(ref_model, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_of(model, step)
        opt.observe_loss(loss)
        loss.backward()
        assert all(p.grad is None for p in model.parameters()), step
        assert_same_params(model, ref_model)  # before opt.step()
        opt.step()
        opt.zero_grad()
        assert_same_params(model, ref_model)
    assert opt.stats()["pipelined_steps"] == 6 and opt.stats()["bucket_steps"] >= 6
