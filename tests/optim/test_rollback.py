"""Verification and rollback: a corrupted step k leaves the same weights as a run that never saw batch k."""

from __future__ import annotations

import copy

import pytest
import torch

from rapidfire_hf.optim import RapidFireOptimizer
from tests.optim.helpers import assert_same_params, make_model, train

STEPS, K = 16, 9


def nan_loss(step, loss, model):
    return loss + float("nan") if step == K else loss


def inf_in_one_grad(step, loss, model):
    if step == K:  # corrupts one parameter's gradient only (once), before it is accumulated
        fired = []

        def corrupt(grad):
            if fired:
                return grad
            fired.append(True)
            return grad.index_fill(0, torch.tensor([0]), float("inf"))

        model[2].weight.register_hook(corrupt)
    return loss


def grad_spike(step, loss, model):
    return loss * 1000 if step == K else loss


def loss_spike(step, loss, model):
    return loss + 1000 if step == K else loss  # same gradients, the loss alone jumps


def reference_without_k(steps=STEPS, k=K):
    model = make_model()
    train(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
        [i for i in range(steps) if i != k],
    )
    return model


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize(
    "inject,reason",
    [
        (nan_loss, "finite_loss"),
        (inf_in_one_grad, "finite_grads"),
        (grad_spike, "grad_norm_zscore"),
        (loss_spike, "loss_spike"),
    ],
    ids=["nan-loss", "inf-grad", "1000x-grad", "loss-spike"],
)
def test_bad_batch_is_skipped_exactly(pipeline, inject, reason):
    model = make_model()
    opt = RapidFireOptimizer(
        model.parameters(), lr=1e-2, gradient_pipeline=pipeline, rollback="auto", warmup_steps=5
    )
    train(model, opt, list(range(STEPS)), inject=inject)
    assert_same_params(model, reference_without_k())
    (event,) = opt.events
    assert reason in event.reasons and event.step == K
    assert event.kind == ("rollback" if pipeline else "skip")
    stats = opt.stats()
    assert stats["skipped"] == 1 and stats["rollbacks"] == (1 if pipeline else 0) and stats["steps"] == STEPS


def test_rollback_restores_params_and_state_bit_exactly():
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, rollback="auto")
    train(model, opt, list(range(4)))
    params, state = copy.deepcopy(list(model.parameters())), copy.deepcopy(opt.state_dict()["state"])
    train(model, opt, [4], inject=lambda s, loss, m: loss * float("nan"))
    assert opt.last_step_skipped
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    for i, st in opt.state_dict()["state"].items():
        for key, value in st.items():
            assert torch.equal(value, state[i][key]), (i, key)
    train(model, opt, [5])
    assert not opt.last_step_skipped


def test_user_rule_on_recorded_metric():
    """A PPO-style approx-KL limit: the step whose recorded KL passes the limit is undone."""
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, rollback="auto")
    opt.add_rule("approx_kl", lambda m: m["approx_kl"] < 0.1)

    def record_kl(step, loss, model):
        opt.record("approx_kl", torch.tensor(0.5 if step == K else 0.01), reduce="max")
        return loss

    train(model, opt, list(range(STEPS)), inject=record_kl)
    assert_same_params(model, reference_without_k())
    assert [e.reasons for e in opt.events] == [["approx_kl"]]
    with pytest.raises(ValueError, match="already exists"):
        opt.add_rule("approx_kl", lambda m: True)


def test_host_snapshot_and_interval():
    """Host snapshots restore exactly too; with interval 3 the good steps since the snapshot are undone."""
    model = make_model()
    opt = RapidFireOptimizer(
        model.parameters(),
        lr=1e-2,
        gradient_pipeline=True,
        rollback="auto",
        snapshot="host",
        snapshot_interval=3,
    )
    train(model, opt, list(range(STEPS)), inject=nan_loss)
    (event,) = opt.events
    lost = event.details["steps_lost"]
    assert 0 <= lost < 3 and event.kind == "rollback"
    kept = [i for i in range(STEPS) if not (K - lost <= i <= K)]
    ref = make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True), kept)
    assert_same_params(model, ref)
    assert opt.stats()["snapshot_bytes"] > 0


def test_rollback_off_checks_nothing():
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, rollback="off")
    train(model, opt, list(range(3)), inject=lambda s, loss, m: loss * float("nan") if s == 1 else loss)
    assert opt.events == [] and torch.isnan(next(model.parameters())).all()
    with pytest.raises(ValueError, match="rollback='auto'"):
        opt.add_rule("x", lambda m: True)


def test_snapshot_bytes_estimate_matches_the_snapshot():
    """snapshot='auto' sizes the device snapshot before the first step (parameters + the two AdamW moments,
    counted twice: the snapshot's copy and the live state still to be allocated) and after it (what the
    snapshot really holds)."""
    from rapidfire_hf.optim import Snapshot
    from rapidfire_hf.optim.verification import snapshot_bytes

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    pbytes = sum(p.numel() * p.element_size() for p in params)
    assert snapshot_bytes(params, opt) == pbytes + 2 * 2 * pbytes
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    snap = Snapshot("device")
    snap.capture(params, opt, 1)
    assert snapshot_bytes(params, opt) == snap.nbytes
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert snapshot_bytes(params, sgd) == pbytes + 2 * pbytes
    assert snapshot_bytes(params, torch.optim.SGD(params, lr=0.1)) == pbytes


def test_interval_counts_the_steps_lost_from_the_restored_snapshot():
    """After a rollback the weights are the snapshot's again: a second failure two steps later undoes only
    the one good step applied since, and says so (snapshots every 3 steps: at steps 0, 3, 6, 9)."""
    model = make_model()
    opt = RapidFireOptimizer(
        model.parameters(), lr=1e-2, gradient_pipeline=True, rollback="auto", snapshot_interval=3
    )
    bad = (K + 1, K + 3)
    train(model, opt, list(range(STEPS)), inject=lambda s, loss, m: loss * float("nan") if s in bad else loss)
    assert [(e.step, e.details["steps_lost"]) for e in opt.events] == [(K + 1, 1), (K + 3, 1)]
    kept = [i for i in range(STEPS) if not (K <= i <= K + 3)]  # 9 and 11 undone, 10 and 12 skipped
    ref = make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True), kept)
    assert_same_params(model, ref)
