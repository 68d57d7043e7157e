"""``PPOTrainer.run_state``: the read-only view benchmark scripts and ``rapidfire demo`` read (issue 44), and
``one_update`` called outside ``train()`` (a profiler's warm-up)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.ppo.helpers import tiny_trainer


def test_run_state_reads_the_components(tmp_path, tokenizer, single_thread):
    trainer = tiny_trainer(tmp_path, tokenizer, max_steps=1)
    before = trainer.run_state
    trained = [p for p in trainer.accelerator.unwrap_model(trainer.model).parameters() if p.requires_grad]
    assert before.trainable_parameters == sum(p.numel() for p in trained) > 0
    assert before.trainable_dtypes == ("float32",)
    assert before.rollout_backend is None and before.fused_copy_bytes is None  # no engine before a rollout
    assert before.oom_splits == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.oom_splits = 3  # read-only: a copy, never the trainer's own state
    trainer.train()
    after = trainer.run_state
    assert after.rollout_backend == trainer.roller.engine.backend
    assert after.fused_copy_bytes == trainer.roller.engine.copy_bytes()
    assert after.oom_splits == trainer.stepper.oom_splits


def test_one_update_outside_train_plans_and_reports(tmp_path, tokenizer, single_thread):
    trainer = tiny_trainer(tmp_path, tokenizer, max_steps=2)
    metrics = trainer.one_update(0)
    assert trainer.plan is not None
    assert metrics["tokens_per_second"] > 0 and "loss/policy_avg" in metrics
