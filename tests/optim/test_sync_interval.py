"""sync_interval: N steps applied unverified, verified with one read, a failed span undone and replayed by
the caller; the run equals the inner optimizer alone skipping only the bad batch (bit-exact, CPU fp32)."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from rapidfire_hf.optim import RapidFireOptimizer, spans
from tests.optim.helpers import adamw_reference, assert_same_params, loss_of, make_model, train

STEPS, K, N = 16, 9, 4


def reference(skipped=()):
    return adamw_reference(STEPS, skipped)


def train_with_replay(model, opt, batches, bad=(), rollbacks=None):
    """The caller's side: run each batch as one step; after a rollback, replay what ``last_rollback.replay``
    lists, in order, before new batches; ``verify_now()`` at the end. Batches in ``bad`` have a NaN loss
    the first time they are seen."""
    queue, batch_of, poisoned = deque(batches), {}, set()

    def replay(report):
        if report is not None:
            if rollbacks is not None:
                rollbacks.append(report)
            queue.extendleft(reversed([batch_of[s] for s in report.replay]))

    while queue:
        b = queue.popleft()
        batch_of[opt.stats()["steps"]] = b
        loss = loss_of(model, b)
        if b in bad and b not in poisoned:
            poisoned.add(b)
            loss = loss * float("nan")
        opt.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        replay(opt.last_rollback)
        if not queue:
            replay(opt.verify_now())
    return model


def make(pipeline=True, **kw):
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=pipeline, sync_interval=N, **kw)
    return model, opt


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("async_verify", [False, True], ids=["read-at-boundary", "read-next-window"])
def test_failed_span_is_undone_and_replayed_exactly(pipeline, async_verify):
    model, opt = make(pipeline, async_verify=async_verify)
    rollbacks = []
    train_with_replay(model, opt, list(range(STEPS)), bad={K}, rollbacks=rollbacks)
    assert_same_params(model, reference(skipped={K}))
    (report,) = rollbacks
    assert report.failed == {K: ["finite_loss", "finite_grads"]} or set(report.failed[K]) >= {"finite_loss"}
    # steps 8-11 form the span of K=9; read at the next window, step 12 is discarded and replayed too
    span = [8, 9, 10, 11] + ([12] if async_verify else [])
    assert report.steps == span and report.replay == [s for s in span if s != K]
    assert [e.step for e in opt.events] == [K] and opt.stats()["rollbacks"] == 1


def test_one_read_and_one_snapshot_per_span(monkeypatch):
    reads = []
    values = spans._Verdict.values
    monkeypatch.setattr(spans._Verdict, "values", lambda self: reads.append(1) or values(self))
    model, opt = make()
    train_with_replay(model, opt, list(range(STEPS)))
    assert_same_params(model, reference())
    assert len(reads) == STEPS // N  # one host read per N steps
    assert opt.stats()["snapshots"] == STEPS // N  # only at verified boundaries


def test_two_intervals_give_two_measured_behaviours(monkeypatch):
    counts = {}
    for interval in (1, N):
        model = make_model()
        opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, sync_interval=interval)
        train_with_replay(model, opt, list(range(STEPS)))
        assert_same_params(model, reference())
        counts[interval] = opt.stats()["snapshots"]
    assert counts == {1: STEPS, N: STEPS // N}


def test_verify_now_checks_the_last_partial_span():
    model, opt = make()
    rollbacks = []
    train_with_replay(model, opt, list(range(STEPS - 2)), bad={STEPS - 3}, rollbacks=rollbacks)
    assert [r.steps for r in rollbacks] == [[12, 13]] and rollbacks[0].replay == [12]
    ref = make_model()
    train(
        ref,
        torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True),
        [i for i in range(STEPS - 2) if i != STEPS - 3],
    )
    assert_same_params(model, ref)
    assert opt.verify_now() is None  # nothing left unverified


def test_sync_interval_one_reports_rollbacks_too():
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True)
    rollbacks = []
    train_with_replay(model, opt, list(range(STEPS)), bad={K}, rollbacks=rollbacks)
    assert [(r.steps, r.replay) for r in rollbacks] == [([K], [])]
    assert_same_params(model, reference(skipped={K}))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"sync_interval": 0}, "sync_interval=0"),
        ({"sync_interval": 2, "snapshot_interval": 2}, "leave snapshot_interval"),
    ],
)
def test_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        RapidFireOptimizer(make_model().parameters(), lr=1e-2, **kw)


@pytest.mark.parametrize("pipeline", [True, False])
def test_async_verify_with_sync_interval_one(pipeline):
    """Every step applied before its verdict, read at the next window: a NaN at step K undoes K and K+1
    (computed on K's weights) and K+1 is replayed; the run equals the one without batch K."""
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=pipeline, async_verify=True)
    rollbacks = []
    train_with_replay(model, opt, list(range(STEPS)), bad={K}, rollbacks=rollbacks)
    assert [(r.steps, r.replay) for r in rollbacks] == [([K, K + 1], [K + 1])]
    assert_same_params(model, reference(skipped={K}))
