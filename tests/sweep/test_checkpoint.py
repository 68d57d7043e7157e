"""A sweep's checkpoints are written by the shared atomic writer (``checkpoint/writer.write_checkpoint``,
issue 28 item 4): a failed write (a full disk) raises ``CheckpointSaveError`` with the file, the errno and
the complete checkpoints left untouched, the unfinished ``tmp-`` folder removed, and the trial's earlier
checkpoint still the one a resume finds."""

from __future__ import annotations

import errno

import pytest
import torch

from rapidfire_hf.checkpoint.errors import CheckpointSaveError
from rapidfire_hf.checkpoint.manifest import MANIFEST
from rapidfire_hf.checkpoint.writer import latest_checkpoint
from rapidfire_hf.sweep.checkpoint import save_trial

from .helpers import TRIALS, make_sweep

A = "kl0.01"


@pytest.mark.usefixtures("single_thread")
def test_a_full_disk_leaves_the_earlier_checkpoint_and_names_the_file(tokenizer, tmp_path, monkeypatch):
    sweep = make_sweep(tokenizer, tmp_path, {A: TRIALS[A]}, max_steps=1, save_strategy="steps", save_steps=1)
    sweep.train()
    trial = sweep.trials[A]
    folder = tmp_path / "trials" / A
    assert latest_checkpoint(folder) == folder / "checkpoint-1"
    files = sorted(p.name for p in (folder / "checkpoint-1").iterdir())

    save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    trial.state.global_step = 2  # as after one more update
    with pytest.raises(CheckpointSaveError) as err:
        save_trial(sweep, trial)
    message = str(err.value)
    assert err.value.errno == errno.ENOSPC
    assert f"saving trial {A!r} at update 2" in message
    assert "while writing optimizer.pt" in message
    assert "Complete checkpoints on disk, untouched: checkpoint-1." in message
    assert not (folder / "tmp-checkpoint-2").exists() and not (folder / "checkpoint-2").exists()
    assert sorted(p.name for p in (folder / "checkpoint-1").iterdir()) == files and MANIFEST in files
    assert latest_checkpoint(folder) == folder / "checkpoint-1"
