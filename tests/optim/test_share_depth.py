"""pipeline_share (config gradient.overlap_factor) and pipeline_depth (gradient.pipeline_depth): how many
buckets of the closing window are stepped inside backward, ahead of verification, and what the rollback
snapshot holds. Every setting gives the inner optimizer's result alone (bit-exact on CPU fp32)."""

from __future__ import annotations

import pytest

from rapidfire_hf.optim import RapidFireOptimizer
from tests.helpers.faults_train import scale_loss_at
from tests.optim.helpers import adamw_reference, assert_same_params, loss_of, make_model, train

STEPS = 8
N_PARAMS = 6  # make_model: three Linear layers; pipeline_bucket_mb=0 gives one bucket per parameter


def reference(skipped=()):
    return adamw_reference(STEPS, skipped)


def run(inject=None, **kw):
    model = make_model()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=0, **kw)
    freed = []  # parameters without a gradient when backward returned, per window
    for step in range(STEPS):
        loss = loss_of(model, step)
        if inject is not None:
            loss = inject(step, loss, model)
        opt.observe_loss(loss)
        loss.backward()
        freed.append(sum(p.grad is None for p in model.parameters()))
        opt.step()
        opt.zero_grad()
    return model, opt, freed


@pytest.mark.parametrize(
    "kw, early",
    [
        ({}, N_PARAMS),
        # gradient order: the last layer's bias (3 floats) and weight (48), then 16, 256, 16, 96: of 435
        # floats, the buckets that start within the first half are the first four, within 1% the first two
        ({"pipeline_share": 0.5}, 4),
        ({"pipeline_share": 0.01}, 2),
        ({"pipeline_depth": 2}, 2),
        ({"pipeline_share": 0.5, "pipeline_depth": 1}, 1),
    ],
    ids=["all", "share-0.5", "share-0.01", "depth-2", "share-and-depth"],
)
def test_early_buckets_are_stepped_in_backward_the_rest_in_step(kw, early):
    model, opt, freed = run(**kw)
    stats = opt.stats()
    assert stats["early_buckets"] == early
    # from the second window on (the first one has learned the gradient order) exactly the early
    # buckets were stepped, and their gradients freed, before backward returned
    assert freed[1:] == [early] * (STEPS - 1)
    assert stats["hook_bucket_steps"] >= early * (STEPS - 1)
    assert_same_params(model, reference())


def test_two_shares_give_two_measured_behaviours():
    _, half, freed_half = run(pipeline_share=0.5)
    _, full, freed_full = run(pipeline_share=1.0)
    assert freed_half[-1] < freed_full[-1]
    assert half.stats()["hook_bucket_steps"] < full.stats()["hook_bucket_steps"]
    # the snapshot holds only what the hooks may step
    assert 0 < half.stats()["snapshot_bytes"] < full.stats()["snapshot_bytes"]


def test_share_zero_pipelines_nothing():
    model, opt, freed = run(pipeline_share=0.0)
    stats = opt.stats()
    assert stats["pipelined_steps"] == 0 and stats["deferred_steps"] == {"no_early_bucket": STEPS}
    assert freed == [0] * STEPS and stats["snapshots"] == 0
    assert_same_params(model, reference())


@pytest.mark.parametrize("kw", [{"pipeline_share": 0.5}, {"pipeline_depth": 2}, {}])
def test_rollback_with_late_buckets_is_exact(kw):
    """A NaN at step 5: the early buckets are restored, the late ones were never stepped."""
    model, opt, _ = run(inject=scale_loss_at(5, float("nan")), **kw)
    assert [e.step for e in opt.events] == [5]
    assert_same_params(model, reference(skipped={5}))


def test_no_snapshot_when_no_window_is_pipelined():
    """Exact clipping that binds every window: each window is stepped in step() after its verdict, so no
    snapshot is ever needed, and none is taken."""
    model = make_model()
    opt = RapidFireOptimizer(
        model.parameters(), lr=1e-2, gradient_pipeline=True, max_grad_norm=0.05, clip_prediction="exact"
    )
    train(model, opt, list(range(STEPS)))
    stats = opt.stats()
    assert stats["pipelined_steps"] == 0 and stats["snapshots"] == 0


def test_one_snapshot_per_pipelined_window():
    model, opt, _ = run()
    stats = opt.stats()
    assert stats["pipelined_steps"] == STEPS and stats["snapshots"] == STEPS


@pytest.mark.parametrize(
    "kw, match",
    [({"pipeline_share": 1.5}, "pipeline_share=1.5"), ({"pipeline_depth": 0}, "pipeline_depth=0")],
)
def test_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        RapidFireOptimizer(make_model().parameters(), lr=1e-2, **kw)
