"""Saving and resuming a sweep, trial by trial.

``<output_dir>/trials/<name>/checkpoint-<update>/`` holds the trial's LoRA adapter as peft saves one
(``adapter_model.safetensors`` + ``adapter_config.json``: loadable with ``PeftModel.from_pretrained``
on the base model), ``value_head.pt``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pt`` (the epoch
permutation generator) and ``trainer_state.json``. ``<output_dir>/sweep_checkpoint.json`` lists the trials
(clones included) with their overrides, parent and status, so resuming rebuilds the same set.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rapidfire_hf.ppo.checkpoint import latest_checkpoint
from rapidfire_hf.ppo.trainer import PPOTrainerState

INDEX = "sweep_checkpoint.json"


def save_trial(sweep, trial) -> Path:
    """Write a checkpoint of ``trial`` at its current update; returns the folder."""
    from safetensors.torch import save_file

    path = Path(trial.args.output_dir) / f"checkpoint-{trial.state.global_step}"
    path.mkdir(parents=True, exist_ok=True)
    save_file(sweep.bank.state_dict(trial.slot), str(path / "adapter_model.safetensors"))
    sweep.bank.peft_config.save_pretrained(str(path))
    torch.save(trial.value_head.state_dict(), path / "value_head.pt")
    torch.save(trial.optimizer.state_dict(), path / "optimizer.pt")
    torch.save(trial.scheduler.state_dict(), path / "scheduler.pt")
    torch.save({"permutation": trial.perm_generator.get_state()}, path / "rng_state.pt")
    trial.state.save_to_json(str(path / "trainer_state.json"))
    write_index(sweep)
    return path


def write_index(sweep) -> None:
    """The list of trials (clones included) a resumed sweep rebuilds, with overrides, parent and status."""
    index = {
        name: {"overrides": t.overrides, "parent": t.parent, "status": t.status}
        for name, t in sweep.trials.items()
    }
    out = Path(sweep.args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).write_text(json.dumps(index, indent=1))


def save_sweep(sweep) -> None:
    """Checkpoint every trial that has run an update, and write the index of trials."""
    for trial in sweep.trials.values():
        if trial.state.global_step > 0:
            save_trial(sweep, trial)
    write_index(sweep)


def load_trial(sweep, trial, path: Path) -> None:
    from safetensors.torch import load_file

    sweep.bank.load_state_dict(trial.slot, load_file(str(path / "adapter_model.safetensors")))
    trial.value_head.load_state_dict(torch.load(path / "value_head.pt", sweep.device, weights_only=True))
    trial.optimizer.load_state_dict(torch.load(path / "optimizer.pt", sweep.device, weights_only=True))
    trial.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    trial.perm_generator.set_state(torch.load(path / "rng_state.pt", weights_only=True)["permutation"])
    trial.state = PPOTrainerState.load_from_json(str(path / "trainer_state.json"))


def load_sweep(sweep, resume_from_checkpoint) -> None:
    """Restore every trial from its latest checkpoint (``True``: under ``args.output_dir``, or a folder)."""
    out = Path(sweep.args.output_dir if resume_from_checkpoint is True else resume_from_checkpoint)
    index_file = out / INDEX
    if not index_file.is_file():
        raise FileNotFoundError(f"{out} holds no {INDEX}: not the output folder of a PPOSweep run")
    index = json.loads(index_file.read_text())
    for name, entry in index.items():
        if name not in sweep.trials:  # a clone made during the run: rebuilt, then loaded
            sweep._add(name, entry["overrides"])
            sweep.trials[name].parent = entry["parent"]
        trial = sweep.trials[name]
        found = latest_checkpoint(out / "trials" / name)
        if found is not None:
            load_trial(sweep, trial, found)
        trial.status = "running" if entry["status"] == "finished" else entry["status"]
