"""PPO checkpoints on CPU: no code runs on resume, damaged files are named, a save survives kill -9 anywhere.

The runs are real (tiny Llama policy and value model, vowel reward); every fault is a real file or a real
SIGKILL of a child process (helpers in ``tests/helpers/faults_io.py``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from rapidfire_hf.checkpoint.errors import CheckpointError
from rapidfire_hf.checkpoint.manifest import MANIFEST, file_sha256
from rapidfire_hf.checkpoint.writer import latest_checkpoint
from rapidfire_hf.demo import (
    build_char_tokenizer,
    build_tiny_llama,
    build_tiny_value_model,
    make_prompt_dataset,
    vowel_reward,
)
from rapidfire_hf.ppo import PPOTrainer
from tests.helpers import faults_io
from tests.ppo.helpers import ppo_args

REPO = Path(__file__).resolve().parents[2]

# The I/O calls a save is made of; kill -9 lands just before each of them (and after the last).
SAVE_CALLS = (
    "torch.save",
    "os.replace",
    "os.rename",
    "os.fsync",
    "shutil.rmtree",
    "transformers.modeling_utils.safe_save_file",
    "transformers.trainer_callback.TrainerState.save_to_json",
)


class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps += 1


def make_trainer(out, value_mode="separate", callbacks=None, peft_config=None, **kw) -> PPOTrainer:
    """Batch 4 x accumulation 2, a checkpoint after every update, 3 updates."""
    tok = build_char_tokenizer()
    args = ppo_args(out, save_strategy="steps", save_steps=1, value_mode=value_mode, **{"max_steps": 3, **kw})
    value = build_tiny_value_model(tok) if value_mode == "separate" else None
    return PPOTrainer(
        args=args,
        processing_class=tok,
        model=build_tiny_llama(tok),
        value_model=value,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(32),
        callbacks=callbacks,
        peft_config=peft_config,
    )


def parameters(trainer) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()
    }


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs by {(a[k] - b[k]).abs().max().item():.3g}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint after one update, for each value mode."""
    out = {}
    for mode in ("separate", "fused"):
        root = tmp_path_factory.mktemp(f"saved_{mode}")
        torch.manual_seed(0)
        make_trainer(root, value_mode=mode, max_steps=1).train()
        out[mode] = root / "checkpoint-1"
    return out


def refuse(checkpoint: Path, tmp_path: Path, value_mode: str, witness: Path | None = None) -> str:
    """Resume from ``checkpoint``: it must raise CheckpointError before any update; returns the message."""
    counter = StepCounter()
    trainer = make_trainer(tmp_path / "resume", value_mode=value_mode, callbacks=[counter])
    before = parameters(trainer)
    with pytest.raises(CheckpointError) as info:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert witness is None or not witness.exists(), "unpickling ran the planted os.system call"
    assert counter.steps == 0 and trainer.state.global_step == 0
    assert_identical(before, parameters(trainer))  # nothing was restored half-way
    return str(info.value)


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy" / checkpoint.name
    shutil.copytree(checkpoint, dst)
    return dst


def test_layout_and_manifest(saved):
    path = saved["separate"]
    info = json.loads((path / MANIFEST).read_text())
    assert info["global_step"] == 1 and info["num_processes"] == 1
    written = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(info["files"]) == sorted(set(written) - {MANIFEST})  # every file but the manifest itself
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pt", "trainer_state.json"):
        assert info["files"][name] == {
            "bytes": (path / name).stat().st_size,
            "sha256": file_sha256(path / name),
        }
    assert info["settings"]["response_length"] == 6 and info["identity"]["tokenizer"]["size"] == 46
    assert "policy/model.safetensors" in info["files"] and "value_model/model.safetensors" in info["files"]
    assert not list(path.parent.glob("tmp-*"))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pt"):
        torch.load(path / name, weights_only=True)  # plain tensors and values only
    torch.load(saved["fused"] / "value_head.pt", weights_only=True)


HOSTILE = [
    ("separate", "optimizer.pt"),
    ("separate", "scheduler.pt"),
    ("separate", "rng_state_0.pt"),
    ("fused", "value_head.pt"),
]


@pytest.mark.parametrize(("value_mode", "name"), HOSTILE)
def test_hostile_pickle_is_refused_and_runs_nothing(saved, tmp_path, value_mode, name):
    ckpt = copy_of(saved[value_mode], tmp_path)
    witness = tmp_path / "code_ran"
    faults_io.write_hostile_pickle(ckpt / name, witness)
    message = refuse(ckpt, tmp_path, value_mode, witness)
    assert name in message and "refusing" in message


DAMAGE = [
    ("optimizer.pt", "truncate"),
    ("optimizer.pt", "scramble"),
    ("optimizer.pt", "delete"),
    ("scheduler.pt", "scramble"),
    ("rng_state_0.pt", "scramble"),
    ("rng_state_0.pt", "delete"),
    ("trainer_state.json", "scramble"),
    ("trainer_state.json", "truncate"),
    ("policy/model.safetensors", "scramble"),
    ("policy/model.safetensors", "truncate"),
    ("value_model/model.safetensors", "scramble"),
    (MANIFEST, "scramble"),
]


@pytest.mark.parametrize(("name", "damage"), DAMAGE)
def test_damaged_file_is_named_before_training(saved, tmp_path, name, damage):
    ckpt = copy_of(saved["separate"], tmp_path)
    target = ckpt / name
    if damage == "delete":
        target.unlink()
    else:
        getattr(faults_io, damage)(target)
    message = refuse(ckpt, tmp_path, "separate")
    assert Path(name).name in message and "resume from another checkpoint" in message
    for raw in ("EOFError", "UnpicklingError", "SafetensorError", "JSONDecodeError"):
        assert not message.startswith(raw)


def test_incomplete_checkpoint_is_refused_and_skipped(saved, tmp_path, caplog):
    root = tmp_path / "copy"
    older = copy_of(saved["separate"], tmp_path)
    newer = root / "checkpoint-7"
    shutil.copytree(older, newer)
    (newer / MANIFEST).unlink()  # a save killed before its manifest
    shutil.copytree(older, root / "tmp-checkpoint-8")
    assert f"{MANIFEST} is missing, so the save of this folder did not finish" in refuse(
        newer, tmp_path, "separate"
    )
    with caplog.at_level(logging.WARNING, logger="rapidfire_hf.checkpoint.writer"):
        assert latest_checkpoint(root) == older
    assert "checkpoint-7" in caplog.text and "tmp-checkpoint-8" in caplog.text


def test_save_total_limit_keeps_the_newest_complete(tmp_path, saved):
    make_trainer(tmp_path, max_steps=3, save_total_limit=2).train()
    assert sorted(p.name for p in tmp_path.iterdir() if "checkpoint" in p.name) == [
        "checkpoint-2",
        "checkpoint-3",
    ]
    assert all((tmp_path / n / MANIFEST).is_file() for n in ("checkpoint-2", "checkpoint-3"))
    # a later-numbered checkpoint of an earlier run never pushes out the one just saved
    shutil.copytree(saved["separate"], tmp_path / "checkpoint-9")
    (tmp_path / "checkpoint-8").mkdir()  # incomplete: not counted, not deleted
    make_trainer(tmp_path, max_steps=1, save_total_limit=1).train()
    assert sorted(p.name for p in tmp_path.iterdir() if "checkpoint" in p.name) == [
        "checkpoint-1",
        "checkpoint-8",
    ]


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def test_resume_with_lora_and_fused_value_is_bit_identical(tmp_path):
    from peft import LoraConfig

    def lora():
        return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    straight = make_trainer(tmp_path / "a", value_mode="fused", peft_config=lora())
    straight.train()
    make_trainer(tmp_path / "b", value_mode="fused", peft_config=lora(), callbacks=[StopAt(2)]).train()
    assert (tmp_path / "b" / "checkpoint-2" / "policy" / "adapter_model.safetensors").is_file()
    resumed = make_trainer(tmp_path / "b", value_mode="fused", peft_config=lora())
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert_identical(parameters(straight), parameters(resumed))


# ------------------------------------------------------------------------------------- kill -9 mid-save
def child_main(out: str, kill_at: int, log: str) -> None:
    """Body of the child: the 3-update run, SIGKILLed at call ``kill_at`` of the save at update 2."""
    switch = faults_io.KillSwitch(None if kill_at < 0 else kill_at, Path(log))
    for target in SAVE_CALLS:
        switch.watch(target)
    switch.arm_inside(
        "rapidfire_hf.ppo.recipe.checkpoint.save", when=lambda parts: parts.state.global_step == 2
    )
    torch.set_num_threads(1)
    make_trainer(out, save_total_limit=1).train()


def run_child(out: Path, kill_at: int, log: Path) -> int:
    code = (
        f"from tests.ppo.test_checkpoint import child_main; child_main({str(out)!r}, {kill_at}, {str(log)!r})"
    )
    # the repository root (for `tests.`) before the caller's own path (which may be where rapidfire_hf is)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode not in (0, -9):
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.returncode


@pytest.mark.slow
def test_kill_at_every_point_of_a_save_then_resume_is_exact(tmp_path, single_thread):
    straight = make_trainer(tmp_path / "straight", save_total_limit=1)
    straight.train()
    expected = parameters(straight)

    calls = tmp_path / "calls.txt"
    assert run_child(tmp_path / "record", -1, calls) == 0
    seq = calls.read_text().split()
    assert "torch.save" in seq and "transformers.modeling_utils.safe_save_file" in seq
    # one kill before each new kind of call (runs of fsyncs are one point) and one after the last call
    points = [k for k in range(1, len(seq) + 1) if k == 1 or seq[k - 1] != seq[k - 2]] + [len(seq) + 1]
    for k in points:
        out = tmp_path / f"kill{k}"
        assert run_child(out, k, tmp_path / f"calls{k}.txt") == -9, f"kill point {k} was not reached"
        where = f"killed before call {k} ({seq[k - 1] if k <= len(seq) else 'end of save'})"
        chosen = latest_checkpoint(out)
        assert chosen is not None and chosen.name in ("checkpoint-1", "checkpoint-2"), where
        if (out / "checkpoint-2").exists() and chosen.name == "checkpoint-1":
            # an unfinished checkpoint-2 under its final name must be refused, never half-used
            with pytest.raises(CheckpointError):
                make_trainer(out / "again").train(resume_from_checkpoint=str(out / "checkpoint-2"))
        resumed = make_trainer(out, save_total_limit=1)
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 3, where
        try:
            assert_identical(expected, parameters(resumed))
        except AssertionError as e:
            raise AssertionError(f"{where}, resumed from {chosen.name}: {e}") from None
