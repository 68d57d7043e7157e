"""A config-built RapidFireOptimizer verifies in spans of at most one update's optimizer steps: the trainer
verifies every update before the next rollout, so a longer span is never filled, and a span of one step
would only hold a snapshot of every parameter and its AdamW state that verifying before the step avoids."""

from __future__ import annotations

import pytest

from rapidfire_hf.optim import RapidFireOptimizer
from tests.ppo.helpers import tiny_trainer


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Single-threaded: the tiny models are faster that way on the shared cores."""


def _optimizer(trainer) -> RapidFireOptimizer:
    opt = trainer.optimizer
    inner = getattr(opt, "optimizer", opt)  # accelerate's wrapper once prepared
    assert isinstance(inner, RapidFireOptimizer)
    return inner


@pytest.mark.parametrize(
    ("epochs", "mini_batches", "accumulation", "span", "snapshots"),
    [(1, 1, 2, 1, False), (1, 2, 1, 2, True), (2, 2, 1, 4, True)],
)
def test_span_is_capped_at_the_steps_of_one_update(tmp_path, tokenizer, epochs, mini_batches, accumulation, span, snapshots):  # fmt: skip
    cfg = {"gradient": {"pipeline": False, "sync_interval": 4}}
    trainer = tiny_trainer(
        tmp_path,
        tokenizer,
        rapidfire_config=cfg,
        num_ppo_epochs=epochs,
        num_mini_batches=mini_batches,
        gradient_accumulation_steps=accumulation,
        max_steps=2,
    )
    opt = _optimizer(trainer)
    assert opt.sync_interval == span
    trainer.train()
    stats = opt.stats()
    assert stats["steps"] >= 2 * epochs * mini_batches  # (a failed span replays its windows)
    # one optimizer step per update: verified before it applies, so nothing to snapshot or undo
    assert (stats["snapshots"] > 0) is snapshots, stats
    assert (stats["snapshot_bytes"] > 0) is snapshots, stats
