"""The bucketed gradient pipeline against the inner optimizer alone: bit-exact in fp32 on CPU.

The model of ``helpers.make_model`` has 6 parameters of 48 to 1024 bytes of gradient: ``TINY`` MiB gives
one parameter per bucket, ``MID`` a few per bucket, ``HUGE`` one bucket per param group.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.optim.pipeline import GradientPipeline
from rapidfire_hf.utils.imports import is_available
from tests.optim.helpers import assert_same_params, loss_of, make_model, train, two_groups
from tests.optim.test_rollback import STEPS as RB_STEPS
from tests.optim.test_rollback import grad_spike, inf_in_one_grad, nan_loss, reference_without_k

STEPS = 12
TINY, MID, HUGE = 1e-6, 1200 / 2**20, 1024.0
SIZES = [0, TINY, MID, HUGE]
IDS = ["per-param", "tiny", "mid", "huge"]


def three_groups(model: nn.Module) -> list[dict]:
    """One group per Linear, each with its own lr and weight decay."""
    return [
        {"params": list(model[0].parameters()), "lr": 1e-2, "weight_decay": 0.1},
        {"params": list(model[2].parameters()), "lr": 3e-3, "weight_decay": 0.0},
        {"params": list(model[4].parameters()), "lr": 2e-2, "weight_decay": 0.01},
    ]


def bucket_sizes(opt: RapidFireOptimizer) -> list[int]:
    return [len(b.params) for b in opt._pipeline.buckets]


@pytest.mark.parametrize("bucket_mb", SIZES, ids=IDS)
@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("groups", [two_groups, three_groups], ids=["two-groups", "three-groups"])
def test_buckets_match_inner_alone(bucket_mb, name, groups):
    extra = {"momentum": 0.9} if name == "sgd" else {}
    ref = make_model()
    if name == "adamw":
        ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, foreach=True)
    else:
        ref_opt = torch.optim.SGD(groups(ref), lr=1e-2, **extra)
    train(ref, ref_opt, list(range(STEPS)))
    model = make_model()
    opt = RapidFireOptimizer(
        groups(model), optimizer=name, lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=bucket_mb, **extra
    )
    train(model, opt, list(range(STEPS)))
    assert_same_params(model, ref)
    n_groups, n_params = len(opt.param_groups), len(opt._params)
    expected = {0: n_params, TINY: n_params, HUGE: n_groups}.get(bucket_mb)
    stats = opt.stats()
    if expected is not None:
        assert stats["pipeline_buckets"] == expected
    else:
        assert n_groups <= stats["pipeline_buckets"] < n_params
    # every bucket completed in the hooks, one inner call each: no leftovers
    assert stats["bucket_steps"] == STEPS * stats["pipeline_buckets"]
    assert stats["pipelined_steps"] == STEPS
    for bucket in opt._pipeline.buckets:  # a bucket never mixes param groups
        group = opt.param_groups[bucket.group_index]["params"]
        assert all(any(p is q for q in group) for p in bucket.params)


@pytest.mark.parametrize("bucket_mb", [TINY, MID, HUGE], ids=IDS[1:])
def test_explicit_accumulation(bucket_mb):
    ref = make_model()
    train(ref, torch.optim.AdamW(two_groups(ref), lr=1e-2, foreach=True), list(range(3 * STEPS)), 3)
    model = make_model()
    opt = RapidFireOptimizer(
        two_groups(model), lr=1e-2, gradient_pipeline=True, accumulation_steps=3, pipeline_bucket_mb=bucket_mb
    )
    train(model, opt, list(range(3 * STEPS)), 3)
    assert_same_params(model, ref)
    assert opt.stats()["pipelined_steps"] == STEPS


@pytest.mark.parametrize("bucket_mb", [TINY, MID, HUGE], ids=IDS[1:])
def test_gradient_accumulation_under_accelerate(bucket_mb):
    from accelerate import Accelerator

    def run(make_opt):
        model = make_model()
        acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
        model, opt = acc.prepare(model, make_opt(model))
        for i in range(2 * STEPS):
            with acc.accumulate(model):
                acc.backward(loss_of(model, i))
                opt.step()
                opt.zero_grad()
        return model, opt

    ref, _ = run(lambda m: torch.optim.AdamW(two_groups(m), lr=1e-2, foreach=True))
    model, opt = run(
        lambda m: RapidFireOptimizer(
            two_groups(m), lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=bucket_mb
        )
    )
    assert_same_params(model, ref)
    stats = opt.optimizer.stats()
    assert stats["pipelined_steps"] == STEPS
    assert stats["bucket_steps"] == STEPS * stats["pipeline_buckets"]


class WithUnused(nn.Module):
    """A model with a never-used parameter and one used only on even steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 16)
        self.unused = nn.Linear(16, 16)
        self.sometimes = nn.Linear(16, 16)
        self.b = nn.Linear(16, 3)
        self.use_sometimes = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.use_sometimes:
            h = torch.tanh(self.sometimes(h))
        return self.b(h)


@pytest.mark.parametrize("bucket_mb", [0, MID, HUGE], ids=["per-param", "mid", "huge"])
@pytest.mark.parametrize("rollback", ["off", "auto"])
def test_unused_and_intermittent_parameters(bucket_mb, rollback):
    """Unused parameters are never stepped; a bucket left incomplete (its intermittent member did not
    fire) is stepped in step(); both exactly as the inner optimizer alone does."""

    def run(model, opt):
        for i in range(STEPS):
            model.use_sometimes = i % 2 == 0
            x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(i)), torch.zeros(8, 3)
            loss = (model(x) - y).pow(2).mean()
            if isinstance(opt, RapidFireOptimizer):
                opt.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return opt

    ref = WithUnused()
    run(ref, torch.optim.AdamW(two_groups(ref), lr=1e-2, foreach=True))
    model = WithUnused()
    opt = run(
        model,
        RapidFireOptimizer(
            two_groups(model),
            lr=1e-2,
            gradient_pipeline=True,
            pipeline_bucket_mb=bucket_mb,
            rollback=rollback,
            warmup_steps=3,
        ),
    )
    assert_same_params(model, ref)
    assert torch.equal(model.unused.weight, WithUnused().unused.weight)  # never stepped
    assert opt.stats()["pipelined_steps"] == STEPS and opt.stats()["skipped"] == 0
    # the never-used parameters were not seen in the first window: they sit in buckets of their own
    unused = {model.unused.weight, model.unused.bias}
    for bucket in opt._pipeline.buckets:
        members = set(bucket.params)
        assert members <= unused or not members & unused


@pytest.mark.parametrize("bucket_mb", [TINY, HUGE], ids=["tiny", "huge"])
def test_lr_scheduler_acts_on_buckets(bucket_mb):
    def linear(step):
        return 1.0 - step / STEPS

    ref = make_model()
    ref_opt = torch.optim.AdamW(three_groups(ref), lr=1e-2, foreach=True)
    train(ref, ref_opt, list(range(STEPS)), sched=torch.optim.lr_scheduler.LambdaLR(ref_opt, linear))
    model = make_model()
    opt = RapidFireOptimizer(
        three_groups(model), lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=bucket_mb
    )
    train(model, opt, list(range(STEPS)), sched=torch.optim.lr_scheduler.LambdaLR(opt, linear))
    assert_same_params(model, ref)


def test_scheduler_on_inner_instance_does_not_redirect_bucket_steps():
    """A scheduler built on the inner instance patches its ``step``; bucket views must not call it."""
    ref, model = make_model(), make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True), list(range(STEPS)))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0)
    opt = RapidFireOptimizer(optimizer=inner, gradient_pipeline=True, pipeline_bucket_mb=MID)
    train(model, opt, list(range(STEPS)))
    assert_same_params(model, ref)


@pytest.mark.parametrize("bucket_mb", [TINY, MID, HUGE], ids=IDS[1:])
@pytest.mark.parametrize(
    "inject,reason",
    [(nan_loss, "finite_loss"), (inf_in_one_grad, "finite_grads"), (grad_spike, "grad_norm_zscore")],
    ids=["nan-loss", "inf-grad", "1000x-grad"],
)
def test_rollback_with_buckets_is_exact(bucket_mb, inject, reason):
    model = make_model()
    opt = RapidFireOptimizer(
        model.parameters(),
        lr=1e-2,
        gradient_pipeline=True,
        rollback="auto",
        warmup_steps=5,
        pipeline_bucket_mb=bucket_mb,
    )
    train(model, opt, list(range(RB_STEPS)), inject=inject)
    assert_same_params(model, reference_without_k())
    (event,) = opt.events
    assert event.kind == "rollback" and reason in event.reasons
    assert opt.stats()["rollbacks"] == 1


@pytest.mark.parametrize("bucket_mb", [TINY, MID, HUGE], ids=IDS[1:])
def test_bucket_norms_give_the_total_norm(bucket_mb):
    """The per-bucket _foreach_norm feeds the same total norm as get_total_norm (what clipping uses)."""
    ref, model = make_model(), make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True), list(range(STEPS)), clip=100.0)
    opt = RapidFireOptimizer(
        model.parameters(), lr=1e-2, gradient_pipeline=True, max_grad_norm=100.0, pipeline_bucket_mb=bucket_mb
    )
    train(model, opt, list(range(STEPS)))
    assert_same_params(model, ref)
    probe = copy.deepcopy(model)
    loss_of(probe, STEPS).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in probe.parameters()])
    train(model, opt, [STEPS])
    assert opt.stats()["pipelined_steps"] == STEPS  # the first window had no norm history
    assert opt.stats()["last_grad_norm"] == pytest.approx(float(expected), rel=1e-6)


class Scrambled(nn.Module):
    """Registration order c, a, b; forward a -> b -> c, so gradients complete c, b, a."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c = nn.Linear(16, 3)
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_buckets_are_recut_in_the_observed_order():
    model = Scrambled()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=0)
    flat = [p for b in opt._pipeline.buckets for p in b.params]
    assert flat == list(reversed(list(model.parameters())))  # the proxy before any backward
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    loss = model(torch.randn(4, 6)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    flat = [p for b in opt._pipeline.buckets for p in b.params]
    assert len(flat) == 6 and all(p is q for p, q in zip(flat, fired))
    ref, again = Scrambled(), Scrambled()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    opt = RapidFireOptimizer(again.parameters(), lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=MID)
    for m, o in ((ref, ref_opt), (again, opt)):
        for i in range(STEPS):
            m(torch.randn(4, 6, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    assert_same_params(again, ref)


def test_second_backward_after_bucket_stepped_matches_per_param():
    """Two closing backwards before step() (misuse: nothing says they accumulate): a gradient that
    arrives after its bucket was stepped is stepped alone, as the per-parameter pipeline does."""
    results = []
    for bucket_mb in (0, HUGE):
        model = make_model()
        opt = RapidFireOptimizer(
            model.parameters(), lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=bucket_mb
        )
        for step in range(4):
            loss_of(model, 2 * step).backward()
            loss_of(model, 2 * step + 1).backward()
            opt.step()
            opt.zero_grad()
        results.append(model)
    assert_same_params(results[1], results[0])


class LoopAdam(torch.optim.Optimizer):
    """A Python-loop optimizer in the style of bitsandbytes (per-parameter state, one tensor at a time)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        self.initialized = False  # like bitsandbytes: an attribute set in __init__ and read in step()

    @torch.no_grad()
    def step(self, closure=None):
        if not self.initialized:
            self.initialized = True
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = state["m"] / (1 - b1 ** state["step"])
                v_hat = state["v"] / (1 - b2 ** state["step"])
                p.sub_(group["lr"] * m_hat / (v_hat.sqrt() + group["eps"]))


@pytest.mark.parametrize("form", ["class", "instance"])
def test_python_loop_inner_optimizer(form):
    """Nothing in the buckets assumes torch's fused/foreach AdamW internals."""
    ref = make_model()
    train(ref, LoopAdam(ref.parameters()), list(range(STEPS)))
    model = make_model()
    if form == "class":
        opt = RapidFireOptimizer(
            model.parameters(), optimizer=LoopAdam, lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=MID
        )
    else:
        opt = RapidFireOptimizer(
            optimizer=LoopAdam(model.parameters()), gradient_pipeline=True, pipeline_bucket_mb=MID
        )
    train(model, opt, list(range(STEPS)))
    assert_same_params(model, ref)
    assert 1 < opt.stats()["pipeline_buckets"] < 6


@pytest.mark.skipif(not is_available("bitsandbytes"), reason="bitsandbytes not installed")
@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_bitsandbytes_inner_builds_buckets(name):
    opt = RapidFireOptimizer(
        make_model().parameters(), optimizer=name, lr=1e-3, gradient_pipeline=True, pipeline_bucket_mb=MID
    )
    assert 1 < opt.stats()["pipeline_buckets"] < 6
    assert all(type(b.stepper._inner_view) is type(opt.inner) for b in opt._pipeline.buckets)


def test_state_dict_round_trip_with_buckets():
    def make(model):
        return RapidFireOptimizer(
            two_groups(model), lr=1e-2, gradient_pipeline=True, rollback="auto", pipeline_bucket_mb=MID
        )

    whole = make_model()
    train(whole, make(whole), list(range(10)))
    first = make_model()
    opt = make(first)
    train(first, opt, list(range(5)))
    saved = opt.state_dict()
    resumed = make_model(seed=1)
    resumed.load_state_dict(first.state_dict())
    opt2 = make(resumed)
    opt2.load_state_dict(saved)
    train(resumed, opt2, list(range(5, 10)))
    assert_same_params(resumed, whole)


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), float("inf"), "64", None, True])
def test_invalid_bucket_mb_is_a_clear_value_error(value):
    with pytest.raises(ValueError, match=r"pipeline_bucket_mb=.*must be a finite number of MiB >= 0"):
        RapidFireOptimizer(lr=1e-3, gradient_pipeline=True, pipeline_bucket_mb=value)  # before any bind
    with pytest.raises(ValueError, match="pipeline_bucket_mb"):
        GradientPipeline(lambda: True, None, False, bucket_mb=value)


def test_bucket_mb_is_kept_when_the_pipeline_is_enabled_later():
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, pipeline_bucket_mb=HUGE)
    assert opt.stats()["pipeline_buckets"] == 0
    opt.enable_pipeline()
    assert opt.stats()["pipeline_buckets"] == 1


@pytest.mark.parametrize("value", ["yes", 1.5, -0.1, None])
def test_invalid_pipeline_overlap_is_a_clear_value_error(value):
    with pytest.raises(ValueError, match=r"pipeline_overlap=.*must be a number from 0"):
        RapidFireOptimizer(lr=1e-3, gradient_pipeline=True, pipeline_overlap=value)


def test_pipeline_overlap_is_the_same_arithmetic_on_cpu():
    """Off CUDA there is no side stream: overlap=True steps exactly like the inner AdamW alone."""
    ref = make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True), list(range(STEPS)))
    model = make_model()
    opt = RapidFireOptimizer(
        model.parameters(), lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=TINY, pipeline_overlap=True
    )
    train(model, opt, list(range(STEPS)))
    assert_same_params(model, ref)
    assert all(b.side for b in opt._pipeline.buckets)
    assert not opt._pipeline._streams  # no stream was made for CPU tensors
    assert opt.stats()["pipelined_steps"] == STEPS


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_pipeline_overlap_share_picks_the_first_buckets_of_backward(share):
    model = make_model()
    opt = RapidFireOptimizer(
        model.parameters(), lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=TINY, pipeline_overlap=share
    )
    train(model, opt, [0])  # the first window teaches the bucket order
    buckets = opt._pipeline.buckets
    sizes = [sum(p.numel() * p.element_size() for p in b.params) for b in buckets]
    side = [b.side for b in buckets]
    assert side == sorted(side, reverse=True)  # a prefix of the gradient order
    on_side = sum(s for s, flag in zip(sizes, side) if flag)
    assert on_side <= share * sum(sizes) + 0.5
    if share == 1.0:
        assert all(side)
    if share == 0.0:
        assert not any(side)


@pytest.mark.parametrize("value", [0, -2, 1.5, "4", True])
def test_invalid_pipeline_depth_is_a_clear_value_error(value):
    with pytest.raises(ValueError, match=r"pipeline_depth=.*must be an int >= 1"):
        RapidFireOptimizer(lr=1e-3, gradient_pipeline=True, pipeline_depth=value)
