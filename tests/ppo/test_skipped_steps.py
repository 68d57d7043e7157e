"""Non-finite values never reach PPOTrainer's weights: each skipped step is logged and counted, and a run
of skipped steps stops training with an error that says why."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from rapidfire_hf.demo import (
    build_char_tokenizer,
    build_tiny_llama,
    build_tiny_value_model,
    make_prompt_dataset,
    vowel_reward,
)
from rapidfire_hf.optim.skips import ConsecutiveSkipsError
from rapidfire_hf.ppo import PPOTrainer
from tests.helpers.faults_train import nan_observed_loss, nan_reward
from tests.ppo.helpers import ppo_args

STEPS_PER_UPDATE = 4  # ppo_args: 2 epochs x 2 mini-batches


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _train(tmp_path, tok, reward, **kw):
    args = ppo_args(tmp_path, lr_scheduler_type="constant", **kw)
    torch.manual_seed(0)
    policy = build_tiny_llama(tok)
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        value_model=build_tiny_value_model(tok),
        reward_funcs=reward,
        train_dataset=make_prompt_dataset(32),
    )
    return trainer, policy


def test_nan_score_with_the_default_optimizer_is_skipped(tmp_path, tok, caplog):
    """Update 2 of 2 gets NaN scores: its 4 steps are skipped and the weights equal those after update 1."""
    trainer, policy = _train(tmp_path / "nan", tok, nan_reward(vowel_reward, calls=[2]))
    assert isinstance(trainer.optimizer.optimizer, torch.optim.AdamW)  # the plain default
    with caplog.at_level(logging.WARNING, logger="rapidfire_hf.optim"):
        trainer.train()
    ref_trainer, ref_policy = _train(tmp_path / "ref", tok, vowel_reward, max_steps=1)
    ref_trainer.train()
    for a, b in zip(policy.parameters(), ref_policy.parameters()):
        assert torch.equal(a, b)
    logs = trainer.state.log_history
    assert [entry["rapidfire/skipped_steps"] for entry in logs] == [0, STEPS_PER_UPDATE]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert [m.split(" skipped")[0] for m in skipped] == [f"PPOTrainer: step {s}" for s in range(4, 8)]
    trainer.save_model(str(tmp_path / "saved"))
    files = sorted((tmp_path / "saved").rglob("*.safetensors"))
    assert files
    for file in files:
        assert all(torch.isfinite(t).all() for t in load_file(file).values()), file


@pytest.mark.parametrize("optimizer", ["default", "rapidfire"])
def test_endless_skipping_stops_with_a_clear_error(tmp_path, tok, optimizer, caplog):
    kw = {"rapidfire_config": "balanced"} if optimizer == "rapidfire" else {}
    trainer, policy = _train(
        tmp_path, tok, nan_reward(vowel_reward), max_consecutive_skips=3, max_steps=3, **kw
    )
    before = [p.detach().clone() for p in policy.parameters()]
    with caplog.at_level(logging.WARNING, logger="rapidfire_hf.optim"):
        with pytest.raises(ConsecutiveSkipsError) as err:
            trainer.train()
    message = str(err.value)
    assert "3 optimizer steps in a row (steps 0-2)" in message
    assert "finite_loss" in message and "max_consecutive_skips" in message
    assert sum("skipped" in r.getMessage() for r in caplog.records) == 3
    for a, b in zip(policy.parameters(), before):
        assert torch.equal(a, b)


def test_pipeline_runs_under_the_default_clipping(tmp_path, tok):
    """max_grad_norm=1.0 (TrainingArguments' default) with clip_prediction 'scale': windows are pipelined
    with a predicted clip coefficient, checked after backward; the miss rate is logged."""
    cfg = {"preset": "balanced", "gradient": {"clip_prediction": "scale"}}
    trainer, policy = _train(tmp_path, tok, vowel_reward, rapidfire_config=cfg, max_steps=3)
    assert trainer.args.max_grad_norm == 1.0 and trainer.rapidfire_optimizer.clip_prediction == "scale"
    trainer.train()
    last = trainer.state.log_history[-1]
    stats = trainer.rapidfire_optimizer.stats()
    assert last["rapidfire/pipelined_steps"] > 0 and stats["clip_checks"] == stats["pipelined_steps"]
    assert 0.0 <= last["rapidfire/clip_miss_rate"] <= 1.0
    assert last["rapidfire/clip_miss_rate"] == stats["clip_misses"] / stats["clip_checks"]
    assert all(torch.isfinite(p).all() for p in policy.parameters())


def test_an_update_reads_the_optimizers_counters_once(tmp_path, tok):
    """The update's metrics (rollbacks, skips, clip misses and miss rate, pipelined steps) come from one
    ``StepHealth.stats()`` per update."""
    trainer, _ = _train(tmp_path, tok, vowel_reward, rapidfire_config="balanced", max_steps=3)
    health, calls = trainer.stepper.health, []
    read = health.stats
    health.stats = lambda: calls.append(1) or read()
    trainer.train()
    assert len(calls) == 3
    last, stats = trainer.state.log_history[-1], trainer.rapidfire_optimizer.stats()
    assert last["rapidfire/clip_miss_rate"] == stats["clip_misses"] / max(1, stats["clip_checks"])


def test_sync_interval_equals_verifying_every_step(tmp_path, tok):
    """gradient.sync_interval=2 verifies two optimizer steps with one read and undoes a failed pair; the
    trainer replays the healthy windows, so with NaN scores in update 2 of 3 the weights equal those of
    sync_interval=1 (bit-exact), and both skipped update 2's steps."""
    results = []
    for interval in (1, 2):
        cfg = {"gradient": {"pipeline": True, "sync_interval": interval}}
        trainer, policy = _train(
            tmp_path / str(interval),
            tok,
            nan_reward(vowel_reward, calls=[2]),
            rapidfire_config=cfg,
            max_steps=3,
            max_grad_norm=0.0,  # the predicted clip coefficient depends on when norms are read
        )
        assert trainer.rapidfire_optimizer.sync_interval == interval
        trainer.train()
        results.append(([p.detach().clone() for p in policy.parameters()], trainer.rapidfire_optimizer))
    (ref, ref_opt), (got, opt) = results
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert ref_opt.stats()["skipped"] == STEPS_PER_UPDATE  # each window of update 2 skipped once
    assert opt.stats()["snapshots"] < ref_opt.stats()["snapshots"]  # one per span, not one per step
    assert opt.stats()["rollbacks"] >= 1 and opt.verify_now() is None


def test_sync_interval_replays_the_healthy_windows_of_a_failed_span(tmp_path, tok):
    """One window's health check fails (its observed loss is NaN, its gradients clean): with
    sync_interval=2 the span of two windows is undone and the healthy one replayed, so the weights equal
    sync_interval=1 skipping that window alone (bit-exact)."""
    results = []
    for interval in (1, 2):
        cfg = {"gradient": {"pipeline": True, "sync_interval": interval}}
        trainer, policy = _train(
            tmp_path / str(interval), tok, vowel_reward, rapidfire_config=cfg, max_steps=2, max_grad_norm=0.0
        )
        nan_observed_loss(trainer.rapidfire_optimizer, calls=[2])  # the second window of update 1 (one micro-batch each)
        trainer.train()
        assert trainer.rapidfire_optimizer.poisoned == 1 and trainer.rapidfire_optimizer.stats()["skipped"] == 1
        results.append([p.detach().clone() for p in policy.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
