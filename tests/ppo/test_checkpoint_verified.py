"""PPOTrainer resumes only the run it saved, from the bytes it saved (issue 43, item 2).

One flipped byte in any file of a checkpoint is refused naming the file; another LoRA alpha, another base
model of the same shape, a tokenizer of the same size with other ids, another response_length, and NaN in
one tensor are refused naming what differs, before anything is restored. Tiny Llama, LoRA policy with the
fused value head (the adapter-only checkpoint, where these used to pass silently) and the full policy with
a separate value model; CPU.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from rapidfire_hf.checkpoint.errors import CheckpointError, CheckpointMismatchError
from rapidfire_hf.checkpoint.manifest import MANIFEST
from rapidfire_hf.demo import build_char_tokenizer, build_tiny_llama, make_prompt_dataset, vowel_reward
from rapidfire_hf.demo.task import wordlevel_tokenizer
from rapidfire_hf.ppo import PPOTrainer
from tests.helpers.faults_io import forge_manifest, reseal
from tests.ppo.helpers import ppo_args
from tests.ppo.test_checkpoint import StepCounter, assert_identical, make_trainer, parameters


def lora(alpha: int = 8):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def lora_trainer(
    out, tok=None, model_seed: int = 0, alpha: int = 8, callbacks=None, **overrides
) -> PPOTrainer:
    """A LoRA policy with the fused value head, one checkpoint after every update."""
    tok = tok if tok is not None else build_char_tokenizer()
    args = ppo_args(
        out, save_strategy="steps", save_steps=1, value_mode="fused", **{"max_steps": 1, **overrides}
    )
    return PPOTrainer(
        args=args,
        processing_class=tok,
        model=build_tiny_llama(tok, seed=model_seed),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(32),
        peft_config=lora(alpha),
        callbacks=callbacks,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    out = {}
    root = tmp_path_factory.mktemp("lora")
    lora_trainer(root).train()
    out["lora"] = root / "checkpoint-1"
    root = tmp_path_factory.mktemp("full")
    make_trainer(root, max_steps=1).train()
    out["full"] = root / "checkpoint-1"
    return out


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy" / checkpoint.name
    shutil.copytree(checkpoint, dst)
    return dst


def refused(trainer: PPOTrainer, checkpoint: Path, error=CheckpointError) -> str:
    """Resume must raise ``error`` before any update and leave the trainer's weights as they were."""
    counter = StepCounter()
    trainer.add_callback(counter)
    before = parameters(trainer)
    with pytest.raises(error) as info:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert counter.steps == 0 and trainer.state.global_step == 0
    assert_identical(before, parameters(trainer))
    return str(info.value)


# Every file each layout writes: a new file without a row fails test_every_file_is_listed.
FILES = {
    "lora": [
        "checkpoint_manifest.json", "optimizer.pt", "scheduler.pt", "rng_state_0.pt", "trainer_state.json",
        "value_head.pt", "policy/adapter_model.safetensors", "policy/adapter_config.json", "policy/README.md",
        "policy/tokenizer.json", "policy/tokenizer_config.json",
    ],
    "full": [
        "checkpoint_manifest.json", "optimizer.pt", "scheduler.pt", "rng_state_0.pt", "trainer_state.json",
        "policy/model.safetensors", "policy/config.json", "policy/generation_config.json",
        "policy/tokenizer.json", "policy/tokenizer_config.json",
        "value_model/model.safetensors", "value_model/config.json",
    ],
}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(FILES))
def test_every_file_is_listed(saved, layout):
    written = sorted(p.relative_to(saved[layout]).as_posix() for p in saved[layout].rglob("*") if p.is_file())
    assert written == sorted(FILES[layout])


def flip_one_byte(path: Path) -> None:
    """XOR one bit of the byte in the middle of ``path`` (a bit flipped on disk or in transit)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def resumers(tmp_path_factory) -> dict[str, PPOTrainer]:
    """One fresh trainer per layout; a refused resume changes nothing, so they are shared."""
    return {
        "lora": lora_trainer(tmp_path_factory.mktemp("r_lora")),
        "full": make_trainer(tmp_path_factory.mktemp("r_full"), max_steps=1),
    }


@pytest.mark.parametrize(("layout", "name"), [(k, n) for k in sorted(FILES) for n in FILES[k]])
def test_one_flipped_byte_in_any_file_is_refused_by_name(saved, resumers, tmp_path, layout, name):
    ckpt = copy_of(saved[layout], tmp_path)
    flip_one_byte(ckpt / name)
    message = refused(resumers[layout], ckpt)
    assert str(ckpt / name) in message, message
    # a flip in the manifest breaks its JSON or its checksum, depending on the byte
    expected = (
        ("its own checksum", "cannot be read as a checkpoint manifest")
        if name == MANIFEST
        else ("does not match its SHA-256 in the manifest",)
    )
    assert any(w in message for w in expected) and "resume from another checkpoint" in message


def test_a_changed_lora_alpha_is_refused(saved, tmp_path):
    message = refused(lora_trainer(tmp_path, alpha=32), saved["lora"], CheckpointMismatchError)
    assert "LoRA adapter policy.lora_alpha: saved 8, this run 32 (peft_config)" in message
    assert "nothing was restored" in message


def test_another_base_model_of_the_same_shape_is_refused(saved, tmp_path):
    message = refused(lora_trainer(tmp_path, model_seed=7), saved["lora"], CheckpointMismatchError)
    assert (
        "base model (the policy's frozen weights): parameter model.embed_tokens.weight holds other values"
        in message
    )


def test_another_reference_model_of_the_same_shape_is_refused(saved, tmp_path):
    """A full policy: the checkpoint holds the policy itself, but the frozen reference (a copy of the model
    the run started from) would be another model."""
    tok = build_char_tokenizer()
    trainer = make_trainer(tmp_path, max_steps=1)
    other = build_tiny_llama(tok, seed=7).requires_grad_(False)
    trainer.ref_model.load_state_dict(other.state_dict())
    message = refused(trainer, saved["full"], CheckpointMismatchError)
    assert "reference model: parameter model.embed_tokens.weight holds other values" in message


def swapped_tokenizer():
    """The demo tokenizer with the ids of 'a' and 'b' swapped: same size, same tokens, other ids."""
    from tokenizers import decoders, pre_tokenizers

    vocab = dict(build_char_tokenizer().get_vocab())
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    return wordlevel_tokenizer(vocab, pre_tokenizers.Split(pattern="", behavior="isolated"), decoders.Fuse())


def test_a_same_size_tokenizer_with_other_ids_is_refused(saved, tmp_path):
    tok = swapped_tokenizer()
    assert len(tok) == len(build_char_tokenizer())
    message = refused(lora_trainer(tmp_path, tok=tok), saved["lora"], CheckpointMismatchError)
    assert "tokenizer (processing_class): the same size but other token ids" in message


def test_a_changed_response_length_is_refused(saved, tmp_path):
    message = refused(lora_trainer(tmp_path, response_length=9), saved["lora"], CheckpointMismatchError)
    assert "response_length: saved 6, this run 9" in message and "Resume with response_length=6" in message


def test_a_changed_weight_decay_is_said_and_the_saved_one_kept(saved, tmp_path, caplog):
    import logging

    root = tmp_path / "run"
    shutil.copytree(saved["lora"], root / saved["lora"].name)
    trainer = lora_trainer(root, max_steps=2, weight_decay=0.5)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert (
        "weight_decay: this run sets 0.5, the checkpoint was saved with 0.0; the checkpoint's 0.0 is kept"
        in (caplog.text)
    )
    assert all(g["weight_decay"] == 0.0 for g in trainer.optimizer.param_groups)


NAN = [
    ("lora", "policy/adapter_model.safetensors", "the policy's weights"),
    ("lora", "value_head.pt", "the value weights"),
    ("lora", "optimizer.pt", "the optimizer state"),
    ("full", "policy/model.safetensors", "the policy's weights"),
    ("full", "value_model/model.safetensors", "the value weights"),
]


@pytest.mark.parametrize(("layout", "name", "what"), NAN)
def test_nan_in_one_tensor_is_refused_naming_it(saved, resumers, tmp_path, layout, name, what):
    """Even with a forged manifest (valid hashes): NaN weights used to be restored and die in the rollout."""
    from safetensors.torch import load_file, save_file

    ckpt = copy_of(saved[layout], tmp_path)
    f = ckpt / name
    if name.endswith(".safetensors"):
        state = load_file(str(f))
        key = sorted(state)[-1]
        state[key].view(-1)[-1] = float("nan")
        save_file(state, str(f), metadata={"format": "pt"})
    else:
        state = torch.load(f, weights_only=True)
        if name == "optimizer.pt":
            key = "state/0/exp_avg"
            state["state"][0]["exp_avg"].view(-1)[0] = float("nan")
        else:
            key = sorted(state)[0]
            state[key].view(-1)[0] = float("inf")
        torch.save(state, f)
    reseal(f)
    message = refused(resumers[layout], ckpt)
    assert f"{f} holds NaN or infinite values in {what}: tensor {key}" in message, message


ATTACKS = [
    "truncated",
    "manifest deleted",
    "manifest garbage",
    "path traversal",
    "extra file",
    "symlinked file",
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_attacks_on_the_folder_are_refused_by_name(saved, resumers, tmp_path, attack):
    ckpt = copy_of(saved["lora"], tmp_path)
    manifest = ckpt / MANIFEST
    if attack == "truncated":
        f = ckpt / "optimizer.pt"
        f.write_bytes(f.read_bytes()[:50])
        words = [str(f), "bytes instead of"]
    elif attack == "manifest deleted":
        manifest.unlink()
        words = [str(manifest), "is missing, so the save of this folder did not finish"]
    elif attack == "manifest garbage":
        manifest.write_text("{not json")
        words = [str(manifest), "cannot be read as a checkpoint manifest"]
    elif attack == "path traversal":  # a forged manifest that points at a file outside the folder
        (tmp_path / "secret").write_text("x")
        forge_manifest(
            ckpt, lambda info: info["files"].update({"../../secret": {"bytes": 1, "sha256": "0" * 64}})
        )
        words = [str(manifest), "'../../secret', a path outside the checkpoint folder"]
    elif attack == "extra file":
        extra = ckpt / "policy" / "model-extra.safetensors"
        shutil.copy(ckpt / "policy" / "adapter_model.safetensors", extra)
        words = [str(extra), "is not listed in checkpoint_manifest.json"]
    else:  # a listed file replaced by a link to an identical copy elsewhere
        target = tmp_path / "elsewhere.pt"
        shutil.copy(ckpt / "optimizer.pt", target)
        (ckpt / "optimizer.pt").unlink()
        os.symlink(target, ckpt / "optimizer.pt")
        words = [str(ckpt / "optimizer.pt"), "is a symbolic link"]
    message = refused(resumers["lora"], ckpt)
    assert all(w in message for w in words), message
    assert "\n" not in message and "Traceback" not in message


@pytest.mark.usefixtures("single_thread")
def test_a_checkpoint_copied_to_another_folder_and_cwd_resumes_exactly(tmp_path, monkeypatch):
    """Paths in the manifest are relative: the folder moves (and the process runs elsewhere) and the resumed
    run still equals the uninterrupted one."""
    from tests.ppo.test_checkpoint import StopAt

    straight = lora_trainer(tmp_path / "a", max_steps=2)
    straight.train()
    lora_trainer(tmp_path / "b", max_steps=2, callbacks=[StopAt(1)]).train()
    moved = tmp_path / "elsewhere" / "deep" / "checkpoint-1"
    shutil.copytree(tmp_path / "b" / "checkpoint-1", moved)
    shutil.rmtree(tmp_path / "b")
    monkeypatch.chdir(tmp_path / "elsewhere")
    resumed = lora_trainer(tmp_path / "c", max_steps=2)
    resumed.train(resume_from_checkpoint=os.path.relpath(moved))
    assert resumed.state.global_step == 2
    assert_identical(parameters(straight), parameters(resumed))
