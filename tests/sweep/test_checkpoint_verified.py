"""A sweep resumes only the run it saved, from the bytes it saved (issue 43, item 2).

One flipped byte in any file of a trial's checkpoint is refused by name and that trial falls back to its
previous checkpoint (ending bit-exactly where it would have); another LoRA alpha, another base of the same
shape, a same-size tokenizer with other ids and another response_length refuse the resume by name; a
changed shared learning rate is said (the checkpoint's kept); a diverged trial cannot be cloned; a stopped
trial whose folder vanished keeps its summary.json record. Tiny Llama, two trials, CPU.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from rapidfire_hf.checkpoint.errors import CheckpointError
from rapidfire_hf.checkpoint.manifest import MANIFEST
from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOConfig
from rapidfire_hf.sweep import PPOSweep
from rapidfire_hf.sweep.checkpoint import SweepCheckpointError

from .helpers import COMMON, TRIALS, max_abs_diff

A, B = "kl0.01", "kl0.2-lr3"
TWO = {A: TRIALS[A], B: TRIALS[B]}


def sweep_of(tokenizer, out, trials=None, model_seed=0, alpha=8, callbacks=(), **shared) -> PPOSweep:
    args = PPOConfig(output_dir=str(out), **{**COMMON, "max_steps": 2, "save_strategy": "steps",
                                             "save_steps": 1, **shared})  # fmt: skip
    sweep = PPOSweep(
        args=args,
        trials=dict(trials or TWO),
        model=build_tiny_llama(tokenizer, seed=model_seed),
        processing_class=tokenizer,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(48),
        peft_config=LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj", "v_proj"]),
        progress=False,
    )
    sweep.callbacks += list(callbacks)
    return sweep


@pytest.fixture(scope="module")
def saved(tokenizer, tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("sweep")
    sweep_of(tokenizer, out).train()
    return out


def copy_of(saved: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(saved, out)
    return out


FILES = [
    "adapter_model.safetensors", "adapter_config.json", "value_head.pt", "optimizer.pt", "scheduler.pt",
    "rng_state.pt", "trainer_state.json", "trial.json", MANIFEST,
]  # fmt: skip


def test_every_file_is_listed(saved):
    folder = saved / "trials" / B / "checkpoint-2"
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES)


@pytest.mark.parametrize("name", FILES)
@pytest.mark.usefixtures("single_thread")
def test_one_flipped_byte_in_any_file_is_refused_by_name(tokenizer, saved, tmp_path, name, caplog):
    out = copy_of(saved, tmp_path)
    f = out / "trials" / B / "checkpoint-2" / name
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    sweep = sweep_of(tokenizer, out)
    with caplog.at_level(logging.WARNING):
        sweep.train(resume_from_checkpoint=True)
    # a flip in the manifest breaks its JSON or its checksum, depending on the byte
    words = (
        ("its own checksum", "cannot be read as a checkpoint manifest")
        if name == MANIFEST
        else ("does not match its SHA-256 in the manifest",)
    )
    lines = [r.getMessage() for r in caplog.records if "resumes from checkpoint-1" in r.getMessage()]
    assert len(lines) == 1 and str(f) in lines[0] and any(w in lines[0] for w in words), caplog.text
    # B redid update 2 from checkpoint-1 and ended where the undamaged run ended; A ran nothing
    expected = load_file(str(saved / "trials" / B / "checkpoint-2" / "adapter_model.safetensors"))
    assert max_abs_diff(sweep.adapter_state_dict(B), expected) == 0.0
    assert sweep.trials[A].state.global_step == sweep.trials[B].state.global_step == 2


def swapped_tokenizer():
    from tokenizers import decoders, pre_tokenizers

    from rapidfire_hf.demo import build_char_tokenizer
    from rapidfire_hf.demo.task import wordlevel_tokenizer

    vocab = dict(build_char_tokenizer().get_vocab())
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    return wordlevel_tokenizer(vocab, pre_tokenizers.Split(pattern="", behavior="isolated"), decoders.Fuse())


CHANGES = [
    ("lora_alpha", dict(alpha=32), "LoRA adapter trials.lora_alpha: saved 8, this run 32 (peft_config)"),
    ("base", dict(model_seed=7), "base model: parameter model.embed_tokens.weight holds other values"),
    (
        "tokenizer",
        dict(tokenizer="swapped"),
        "tokenizer (processing_class): the same size but other token ids",
    ),
    ("response_length", dict(response_length=9), "response_length: saved 8, this run 9"),
    ("temperature shared", dict(temperature=0.7), "temperature: saved 1.0, this run 0.7"),
]


@pytest.mark.parametrize(("what", "change", "words"), CHANGES, ids=[c[0] for c in CHANGES])
def test_another_run_is_refused_by_name(tokenizer, saved, tmp_path, what, change, words):
    out = copy_of(saved, tmp_path)
    change = dict(change)
    tok = swapped_tokenizer() if change.pop("tokenizer", None) else tokenizer
    sweep = sweep_of(tok, out, **change)
    before = {n: sweep.adapter_state_dict(n) for n in sweep.trials}
    with pytest.raises(SweepCheckpointError) as err:
        sweep.train(resume_from_checkpoint=True)
    assert words in str(err.value) and "nothing was restored" in str(err.value), str(err.value)
    assert all(max_abs_diff(before[n], sweep.adapter_state_dict(n)) == 0.0 for n in before)
    assert all(t.state.global_step == 0 for t in sweep.trials.values())


def test_a_changed_shared_learning_rate_is_said_and_the_saved_one_kept(tokenizer, saved, tmp_path, caplog):
    out = copy_of(saved, tmp_path)
    sweep = sweep_of(tokenizer, out, trials={A: TRIALS[A]}, max_steps=3, learning_rate=2e-3)
    with caplog.at_level(logging.WARNING):
        sweep.train(resume_from_checkpoint=True)
    assert (
        f"trial {A}, resuming from {out / 'trials' / A / 'checkpoint-2'}: learning_rate: this run sets 0.002, the "
        "checkpoint was saved with 0.001; the checkpoint's 0.001 is kept"
    ) in caplog.text
    assert sweep.trials[A].scheduler.base_lrs == [1e-3]


def test_a_diverged_trial_cannot_be_cloned(tokenizer, tmp_path):
    """Its NaN weights would be checkpointed, and that folder used to block every trial's resume."""
    sweep = sweep_of(tokenizer, tmp_path, max_steps=1)
    sweep.train()
    with torch.no_grad():
        sweep.trials[B].params[0].view(-1)[0] = float("nan")
    sweep.trials[B].status = "diverged"
    with pytest.raises(CheckpointError) as err:
        sweep.clone(B, "rescue", learning_rate=1e-4)
    message = str(err.value)
    assert "trial 'rescue' (a clone of 'kl0.2-lr3', copied from it): its LoRA adapter tensor" in message
    assert "holds NaN or infinite values" in message and "none was written" in message
    assert "rescue" not in sweep.trials and not (tmp_path / "trials" / "rescue").exists()


class StopBAtUpdate1:
    def on_step_end(self, args, state, control, sweep=None, trial=None, **kwargs):
        if trial == B and state.global_step == 1:
            control.should_training_stop = True


@pytest.mark.usefixtures("single_thread")
def test_a_stopped_trial_whose_folder_vanished_keeps_its_record(tokenizer, tmp_path, caplog):
    sweep_of(tokenizer, tmp_path, callbacks=[StopBAtUpdate1()]).train()
    before = json.loads((tmp_path / "summary.json").read_text())["trials"][B]
    assert before["state"] == "stopped" and before["updates"] == 1
    shutil.rmtree(tmp_path / "trials" / B)
    resumed = sweep_of(tokenizer, tmp_path, max_steps=3)
    with caplog.at_level(logging.WARNING):
        results = resumed.train(resume_from_checkpoint=True)
    after = json.loads((tmp_path / "summary.json").read_text())["trials"][B]
    assert {k: after[k] for k in before} == before and after["kept_from_previous_summary"] is True
    assert f"trial {B} is stopped and {tmp_path / 'trials' / B} holds no checkpoint of it" in caplog.text
    assert results[B].status == "stopped" and results[A].global_step == 3


def test_a_300_character_trial_name_in_the_index_is_refused_by_name(tmp_path):
    from rapidfire_hf.sweep.checkpoint import INDEX, read_index

    name = "n" * 300
    entry = {"overrides": {}, "parent": None, "branch_step": None, "status": "running", "reason": ""}
    (tmp_path / INDEX).write_text(json.dumps({"format": 1, "sweep_id": "x", "trials": {name: entry}}))
    with pytest.raises(SweepCheckpointError) as err:
        read_index(tmp_path)
    assert str(tmp_path / INDEX) in str(err.value) and "300 characters" in str(err.value)


def test_a_sweep_saved_before_manifests_is_refused_saying_why(tokenizer, saved, tmp_path):
    from rapidfire_hf.checkpoint.manifest import OLD_MARKER

    out = copy_of(saved, tmp_path)
    for folder in (out / "trials").glob("*/checkpoint-*"):
        (folder / MANIFEST).unlink()
        (folder / OLD_MARKER).write_text('{"format": 1, "files": {}}')
    sweep = sweep_of(tokenizer, out)
    with pytest.raises(SweepCheckpointError) as err:
        sweep.train(resume_from_checkpoint=True)
    assert "written by an older rapidfire_hf" in str(err.value) and OLD_MARKER in str(err.value)
    assert all(t.state.global_step == 0 for t in sweep.trials.values())
