"""Resuming compares the checkpoint with the run first (issue 30); a failed save names its file.

Refused resumes must leave the trainer exactly as it was: its parameters, optimizer and scheduler state,
RNG and trainer state. The trainer under test has run one update of its own first, so its optimizer state
is not empty. Tiny Llama policy and value model, vowel reward, CPU.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from rapidfire_hf.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    OldCheckpointError,
)
from rapidfire_hf.checkpoint.manifest import MANIFEST, OLD_MARKER, verify
from rapidfire_hf.checkpoint.writer import latest_checkpoint
from rapidfire_hf.demo import (
    build_char_tokenizer,
    build_tiny_llama,
    build_tiny_value_model,
    make_prompt_dataset,
    vowel_reward,
)
from rapidfire_hf.ppo import PPOTrainer
from tests.ppo.helpers import ppo_args

LOGGER = "rapidfire_hf.ppo.checkpoint"


def build(out, hidden: int = 64, prompts: int = 32, **overrides) -> PPOTrainer:
    """Batch 4 x accumulation 2 (8 prompts an update), 2 mini-batches, seed 3, lr 1e-3; a checkpoint after
    every update; ``overrides`` go to :func:`ppo_args`."""
    tok = build_char_tokenizer()
    args = ppo_args(out, save_strategy="steps", save_steps=1, **{"max_steps": 1, **overrides})
    return PPOTrainer(
        args=args,
        processing_class=tok,
        model=build_tiny_llama(tok, hidden=hidden),
        value_model=build_tiny_value_model(tok, hidden=hidden),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(prompts),
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """checkpoint-1 of the base run (32 prompts, 8 per update)."""
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    build(root).train()
    return root / "checkpoint-1"


def snapshot(trainer) -> dict:
    module = trainer.accelerator.unwrap_model(trainer.model)
    return {
        "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "scheduler": copy.deepcopy(trainer.lr_scheduler.state_dict()),
        "torch_rng": torch.get_rng_state(),
        "perm_rng": trainer._perm_generator.get_state(),
        "global_step": trainer.state.global_step,
    }


def assert_same(a, b, where="") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and torch.equal(a, b), f"{where} changed"
    else:
        assert a == b, f"{where} changed: {a!r} -> {b!r}"


def refused(saved: Path, tmp_path: Path, **run) -> str:
    """A trainer with ``run`` (``hidden``, ``prompts`` or PPOConfig fields) trains one update of its own,
    then resumes from ``saved``: it must raise CheckpointMismatchError and change nothing."""
    trainer = build(tmp_path / "other", **run)
    trainer.train()
    assert trainer.optimizer.state_dict()["state"], "the optimizer should hold state before the resume"
    before = snapshot(trainer)
    with pytest.raises(CheckpointMismatchError) as info:
        trainer.train(resume_from_checkpoint=str(saved))
    assert_same(before, snapshot(trainer))
    message = str(info.value)
    assert str(saved) in message and "start a new run" in message and "nothing was restored" in message
    return message


def test_changed_rollout_batch_is_refused(saved, tmp_path):
    message = refused(saved, tmp_path, per_device_train_batch_size=8)
    assert "rollout batch size" in message
    assert "saved 8 (per_device_train_batch_size=4 x gradient_accumulation_steps=2)" in message
    assert "this run 16 (per_device_train_batch_size=8 x gradient_accumulation_steps=2)" in message
    assert "Resume with per_device_train_batch_size x gradient_accumulation_steps = 8" in message


def test_changed_num_mini_batches_is_refused(saved, tmp_path):
    message = refused(saved, tmp_path, num_mini_batches=4)
    assert "num_mini_batches: saved 2, this run 4" in message and "num_mini_batches=2" in message


def test_changed_seed_is_refused(saved, tmp_path):
    message = refused(saved, tmp_path, seed=4)
    assert "seed: saved 3, this run 4" in message and "Resume with seed=3" in message
    assert "prompt order" in message


def test_changed_dataset_size_is_refused(saved, tmp_path):
    message = refused(saved, tmp_path, prompts=40)
    assert "train_dataset size: saved 32 prompts, this run 40" in message and "prompt order" in message


def test_changed_hidden_size_is_refused_before_anything_loads(saved, tmp_path):
    message = refused(saved, tmp_path, hidden=32)
    # the first parameter in the model's order, with both shapes
    assert "policy" in message and "parameter model.embed_tokens.weight" in message
    vocab = len(build_char_tokenizer())
    assert f"shape ({vocab}, 64) in the checkpoint and ({vocab}, 32) in this run's model" in message


def test_same_rollout_batch_split_differently_resumes(saved, tmp_path):
    """4 x 2 -> 2 x 4 (a smaller micro-batch against an out-of-memory) keeps the prompt order: accepted."""
    root = tmp_path / "run"
    shutil.copytree(saved, root / saved.name)
    trainer = build(root, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 2


def test_changed_learning_rate_warns_and_uses_the_saved_one(saved, tmp_path, caplog):
    root = tmp_path / "run"
    shutil.copytree(saved, root / saved.name)
    trainer = build(root, max_steps=2, learning_rate=2e-3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train(resume_from_checkpoint=True)
    warnings = [
        r.getMessage() for r in caplog.records if r.name == LOGGER and "learning_rate" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert "this run sets learning_rate 0.002, the checkpoint was saved with 0.001" in warnings[0]
    assert "The checkpoint's learning_rate 0.001 is used" in warnings[0]
    assert trainer.lr_scheduler.base_lrs == [1e-3] * len(trainer.lr_scheduler.base_lrs)
    assert trainer.state.global_step == 2


def test_old_checkpoint_without_manifest_is_refused_saying_why(saved, tmp_path):
    """A checkpoint from before manifests (sizes only): refused, naming what is missing, nothing restored."""
    old = tmp_path / "run" / saved.name
    shutil.copytree(saved, old)
    (old / MANIFEST).unlink()
    (old / OLD_MARKER).write_text(
        json.dumps({"format": 1, "global_step": 1, "num_processes": 1, "files": {}})
    )
    assert latest_checkpoint(old.parent) == old  # found (not skipped for an even older one), then refused
    trainer = build(old.parent, max_steps=2)
    before = snapshot(trainer)
    with pytest.raises(OldCheckpointError) as info:
        trainer.train(resume_from_checkpoint=True)
    message = str(info.value)
    assert f"it has {OLD_MARKER} (file sizes only) and no {MANIFEST}" in message and str(old) in message
    assert "older rapidfire_hf" in message and "start a new run" in message
    assert_same(before, snapshot(trainer))


# ------------------------------------------------------------------------------------------ failed saves
def _run_until_second_save_fails(out: Path) -> CheckpointSaveError:
    trainer = build(out, max_steps=2)
    with pytest.raises(CheckpointSaveError) as info:
        trainer.train()
    return info.value


def _previous_checkpoint_intact(out: Path) -> None:
    assert latest_checkpoint(out) == out / "checkpoint-1"
    verify(out / "checkpoint-1")  # every file there, with its saved hash
    assert not (out / "checkpoint-2").exists() and not list(out.glob("tmp-*"))
    resumed = build(out / "again", max_steps=2)  # and it still resumes
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert resumed.state.global_step == 2


def test_disk_full_writing_weights_names_the_file(tmp_path, monkeypatch):
    import transformers.modeling_utils as modeling_utils
    from safetensors import SafetensorError

    real = modeling_utils.safe_save_file

    def full_disk(tensors, filename, metadata=None):
        if "tmp-checkpoint-2" not in str(filename):
            return real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"\0" * 100)  # a partly written file, as a full disk leaves it
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)
    out = tmp_path / "out"
    error = _run_until_second_save_fails(out)
    message = str(error)
    assert str(out / "checkpoint-2") in message
    assert "writing policy/model.safetensors" in message and "SafetensorError" in message
    assert "checkpoint-1" in message and isinstance(error, OSError)
    monkeypatch.setattr(modeling_utils, "safe_save_file", real)
    _previous_checkpoint_intact(out)


def test_disk_full_writing_optimizer_names_the_file(tmp_path, monkeypatch):
    real = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("tmp-checkpoint-2/optimizer.pt"):
            raise OSError(28, "No space left on device")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "out"
    error = _run_until_second_save_fails(out)
    message = str(error)
    assert str(out / "checkpoint-2") in message and "writing optimizer.pt" in message
    assert "No space left on device" in message and error.errno == 28
    assert isinstance(error, CheckpointError)
    monkeypatch.setattr(torch, "save", real)
    _previous_checkpoint_intact(out)
