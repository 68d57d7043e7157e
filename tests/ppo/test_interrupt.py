"""Ctrl-C (SIGINT) and SIGTERM in PPOTrainer.train and PPOSweep.train: the update in progress is finished, a
checkpoint is written and named, and resuming from it equals the run that was never interrupted (CPU fp32,
bit-exact). A second signal abandons the update and says what a resume would start from."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch
from transformers import TrainerCallback

from rapidfire_hf.checkpoint.manifest import MANIFEST as MARKER
from rapidfire_hf.sweep.checkpoint import SweepCheckpointError
from rapidfire_hf.utils.interrupt import TrainingInterrupted
from tests.ppo.helpers import tiny_trainer
from tests.sweep.helpers import TRIALS, curves, make_sweep, max_abs_diff


class SignalAt(TrainerCallback):
    """Sends this process ``signals`` (one after the other) at the end of update ``step``."""

    def __init__(self, step: int, *signals):
        self.step, self.signals = step, signals

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            for sig in self.signals:
                os.kill(os.getpid(), sig)


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.usefixtures("single_thread")
def test_trainer_signal_saves_the_update_and_resume_is_exact(tokenizer, tmp_path, sig):
    straight = tiny_trainer(tmp_path / "straight", tokenizer, max_steps=3)
    straight.train()
    before = signal.getsignal(sig)
    # no checkpoint is due before the end (save_steps 500): the signal's is the only one
    stopped = tiny_trainer(tmp_path / "run", tokenizer, max_steps=3, trainer_kwargs={"callbacks": [SignalAt(1, sig)]})
    with pytest.raises(TrainingInterrupted) as info:
        stopped.train()
    assert signal.getsignal(sig) is before  # the handlers are put back
    ckpt = tmp_path / "run" / "checkpoint-1"
    assert info.value.checkpoint == ckpt and (ckpt / MARKER).is_file()
    assert f"after update 1; checkpoint saved in {ckpt}" in str(info.value)
    resumed = tiny_trainer(tmp_path / "run", tokenizer, max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    want, got = _weights(straight), _weights(resumed)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert [h["objective/scores"] for h in resumed.state.log_history] == [
        h["objective/scores"] for h in straight.state.log_history
    ]


@pytest.mark.usefixtures("single_thread")
def test_trainer_second_signal_abandons_and_says_nothing_was_saved(tokenizer, tmp_path, caplog):
    trainer = tiny_trainer(
        tmp_path, tokenizer, max_steps=3, trainer_kwargs={"callbacks": [SignalAt(1, signal.SIGINT, signal.SIGINT)]}
    )
    with caplog.at_level(logging.WARNING), pytest.raises(KeyboardInterrupt) as info:
        trainer.train()
    assert not isinstance(info.value, TrainingInterrupted)
    assert f"no checkpoint was written in {tmp_path}: a resume has nothing to continue from" in caplog.text
    assert not list(tmp_path.glob("checkpoint-*"))
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        tiny_trainer(tmp_path, tokenizer, max_steps=3).train(resume_from_checkpoint=True)


class SweepSignalAt:
    def __init__(self, step: int, *signals):
        self.step, self.signals, self.sent = step, signals, False

    def on_step_end(self, args, state, control, sweep=None, trial=None, **kwargs):
        if state.global_step == self.step and not self.sent:
            self.sent = True
            for sig in self.signals:
                os.kill(os.getpid(), sig)


TWO = {"a": TRIALS["kl0.01"], "b": TRIALS["kl0.2-lr3"]}


@pytest.mark.usefixtures("single_thread")
def test_sweep_signal_saves_every_trial_and_resume_is_exact(tokenizer, tmp_path):
    whole = make_sweep(tokenizer, tmp_path / "whole", TWO, max_steps=3)
    whole.train()
    run = make_sweep(tokenizer, tmp_path / "run", TWO, max_steps=3)  # save_steps 500: none due
    run.callbacks.append(SweepSignalAt(1, signal.SIGTERM))
    with pytest.raises(TrainingInterrupted, match=r"checkpoints of 2 of 2 trials \(update 1\) are in"):
        run.train()
    for name in TWO:
        assert (tmp_path / "run" / "trials" / name / "checkpoint-1" / MARKER).is_file()
    resumed = make_sweep(tokenizer, tmp_path / "run", TWO, max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    for name in TWO:
        assert max_abs_diff(resumed.adapter_state_dict(name), whole.adapter_state_dict(name)) == 0.0
        assert max_abs_diff(resumed.trials[name].value_head.state_dict(), whole.trials[name].value_head.state_dict()) == 0.0
        assert curves(resumed.trials[name].state.log_history) == curves(whole.trials[name].state.log_history)


@pytest.mark.usefixtures("single_thread")
def test_sweep_abandoned_before_any_checkpoint_says_so_and_resume_says_so(tokenizer, tmp_path, caplog):
    run = make_sweep(tokenizer, tmp_path, TWO, max_steps=3)
    optimize = run.phases.optimize

    def interrupted_twice(*args, **kwargs):  # inside the first update's PPO epochs: nothing resumable yet
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return optimize(*args, **kwargs)

    run.phases.optimize = interrupted_twice
    with caplog.at_level(logging.WARNING), pytest.raises(KeyboardInterrupt) as info:
        run.train()
    assert not isinstance(info.value, TrainingInterrupted)
    assert "checkpoints of" not in caplog.text  # today's claim of saved checkpoints is gone
    assert "no trial checkpoint exists" in caplog.text and "a resume has nothing to continue from" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the journal holds the sweep's start: it starts again, and says so
        again = make_sweep(tokenizer, tmp_path, TWO, max_steps=3)
        again.train(resume_from_checkpoint=True)
    assert "no trial of" in caplog.text and "every trial starts again from update 1" in caplog.text
    (tmp_path / "decisions.jsonl").unlink()  # a sweep without a journal and without a checkpoint: refused
    for name in TWO:
        for folder in (tmp_path / "trials" / name).glob("checkpoint-*"):
            __import__("shutil").rmtree(folder)
    with pytest.raises(SweepCheckpointError, match="nothing to resume in .*no trial has a complete checkpoint"):
        make_sweep(tokenizer, tmp_path, TWO, max_steps=3).train(resume_from_checkpoint=True)
