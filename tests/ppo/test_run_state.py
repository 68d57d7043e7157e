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
    assert before.decode_mode_ran is None and before.decode_fallbacks == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.oom_splits = 3  # read-only: a copy, never the trainer's own state
    trainer.train()
    after = trainer.run_state
    assert after.rollout_backend == trainer.roller.engine.backend
    assert after.fused_copy_bytes == trainer.roller.engine.copy_bytes()
    assert after.oom_splits == trainer.stepper.oom_splits
    # the CPU rollout: model.generate under "auto", the static engine's eager step under "static"
    expected = {"hf": "generate", "static": "eager"}[after.rollout_backend]
    assert after.decode_mode_ran == expected and after.decode_fallbacks == ()


def test_run_state_says_the_decode_step_fell_back(tmp_path, tokenizer, single_thread, monkeypatch):
    """A decode step that cannot be compiled runs one mode down (warned once): the run's view records the mode
    that ran and the fall back, so a benchmark row or a user's script sees the run left its fast path."""
    from rapidfire_hf.rollout.static_engine import StaticEngine

    real = StaticEngine._run_step

    def run_step(self, params, mode, t):
        if mode == "compile":
            raise RuntimeError("no compiler here")
        return real(self, params, mode, t)

    monkeypatch.setattr(StaticEngine, "_mode", lambda self, device: "compile")
    monkeypatch.setattr(StaticEngine, "_run_step", run_step)
    trainer = tiny_trainer(tmp_path, tokenizer, max_steps=1, rollout_backend="static")
    with pytest.warns(UserWarning, match="of the decode step failed|recording the decode step failed"):
        trainer.train()
    state = trainer.run_state
    # on the CPU recording a CUDA graph fails too: one more mode down, to eager
    assert state.rollout_backend == "static" and state.decode_mode_ran == "eager"
    first, second = state.decode_fallbacks
    assert first.startswith("compile -> cuda_graph: RuntimeError('no compiler here')")
    assert second.startswith("cuda_graph -> eager: ")


def test_one_update_outside_train_plans_and_reports(tmp_path, tokenizer, single_thread):
    trainer = tiny_trainer(tmp_path, tokenizer, max_steps=2)
    metrics = trainer.one_update(0)
    assert trainer.plan is not None
    assert metrics["tokens_per_second"] > 0 and "loss/policy_avg" in metrics
