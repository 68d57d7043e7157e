"""Saving and resuming a sweep, trial by trial.

``<output_dir>/trials/<name>/checkpoint-<update>/`` holds the trial's LoRA adapter as peft saves one
(``adapter_model.safetensors`` + ``adapter_config.json``: loadable with ``PeftModel.from_pretrained``
on the base model), ``value_head.pt``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pt`` (the epoch
permutation generator), ``trainer_state.json``, ``trial.json`` (the trial's name, overrides, parent,
branch point and the sweep's id) and, written last, ``checkpoint_manifest.json``
(:mod:`rapidfire_hf.checkpoint.manifest`: every file's SHA-256, the sweep's identity and the trial's
settings), the manifest ``PPOTrainer``'s checkpoints carry. ``<output_dir>/sweep_checkpoint.json`` lists
the trials (clones included) with their overrides, parent, status and reason, and the sweep's id, so
resuming rebuilds the same set.

Safety:

- A checkpoint is written by the shared atomic writer (:func:`rapidfire_hf.checkpoint.writer.write_checkpoint`):
  into ``tmp-checkpoint-<update>/``, every file fsynced, the manifest written last, then the folder renamed;
  the index is written to a temporary file and renamed. A kill at any moment leaves every trial's earlier
  complete checkpoints and the earlier index. Non-finite weights or optimizer state are never written:
  cloning a trial whose weights turned NaN is refused, naming the tensor.
- A clone is checkpointed the moment it is made, so a resume restores it from its own state, never from
  its seed; a clone whose checkpoint was written but not yet listed in the index (a kill in between) is
  found by its ``trial.json`` and resumed too.
- Checkpoints left in the folder by an earlier sweep (another id) are skipped with a warning, never
  resumed as this sweep's.
- Resuming checks every file of every trial against its manifest, reads it safely (``.pt`` files with
  ``torch.load(weights_only=True)``: they cannot run code) and refuses non-finite tensors by name. A trial
  whose newest checkpoint fails resumes from its newest one that passes (said); a trial with none is
  marked ``damaged`` (the reason names the file) and the other trials resume. Then every trial is compared
  with the run before any changes: the sweep's identity (base model, tokenizer, LoRA config, reward
  model), the adapter and value-head shapes, the optimizer state, and the settings an update depends on
  (refused, naming each); a changed optimizer setting (learning rate, ...) is said and the checkpoint's
  value kept.
- A trial that is not running and whose folder vanished keeps its record in ``summary.json`` (from the
  previous one), with a warning.
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from rapidfire_hf.checkpoint.errors import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointSaveError,
    OldCheckpointError,
)
from rapidfire_hf.checkpoint.identity import (
    adapter_identity,
    compare_identity,
    model_fingerprint,
    tokenizer_identity,
    value_head_identity,
)
from rapidfire_hf.checkpoint.manifest import Manifest, is_complete, verify
from rapidfire_hf.checkpoint.readers import (
    first_non_finite,
    read_json_object,
    read_pt,
    read_safetensors,
    require_finite,
    require_tensors,
)
from rapidfire_hf.checkpoint.writer import checkpoints, write_checkpoint
from rapidfire_hf.models.value_head import ValueHead
from rapidfire_hf.ppo.field_facts import compare_settings, update_settings
from rapidfire_hf.ppo.types import PPOTrainerState
from rapidfire_hf.sweep.fields import LENGTH_FIELDS, STATES, check_trial_name
from rapidfire_hf.sweep.files import SweepFileError, read_json, write_json

logger = logging.getLogger(__name__)

INDEX = "sweep_checkpoint.json"
INDEX_FORMAT = 1
TRIAL_FILE = "trial.json"
SUMMARY = "summary.json"
DAMAGED = "damaged"  # the status of a trial none of whose checkpoints can be resumed


class SweepCheckpointError(CheckpointError):
    """A sweep checkpoint or index that cannot be resumed from; the message names the file."""


# ---------------------------------------------------------------------------------------------- saving
def run_settings(a, num_prompts: int) -> dict:
    """What a resume of a trial with PPOConfig ``a`` is checked against: its prompt order and updates
    depend on these (and on :func:`rapidfire_hf.checkpoint.identity.update_settings`)."""
    return {
        **update_settings(a),
        "rollout_batch_size": a.local_batch_size,
        "num_mini_batches": a.num_mini_batches,
        "seed": a.seed,
        "num_train_prompts": num_prompts,
    }


# a sweep's identity, computed at its first save: its base, tokenizer and LoRA config never change, and
# hashing a 150k-token vocabulary for every trial's every save would cost about a second each
_SAVED_IDENTITY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sweep_identity(sweep) -> dict:
    """The run every trial's checkpoint belongs to: the frozen base and reward model, the tokenizer, the
    shared LoRA config and the value head."""
    frozen = {
        "base model": model_fingerprint(sweep.model),
        "reward model": model_fingerprint(sweep.phases.reward_model),
    }
    return {
        "frozen_models": {k: v for k, v in frozen.items() if v is not None},
        "tokenizer": tokenizer_identity(sweep.tok),
        "adapters": {"trials": adapter_identity(sweep.bank.peft_config)},
        "value_head": value_head_identity("fused", ValueHead(sweep.hidden_size).state_dict()),
    }


def save_trial(sweep, trial) -> Path:
    """Write a checkpoint of ``trial`` at its current update with the shared atomic writer
    (:func:`rapidfire_hf.checkpoint.writer.write_checkpoint`); returns the folder.

    Raises:
        CheckpointError: the trial's weights or optimizer state hold NaN or infinities (named); nothing is
            written: a checkpoint is a state to resume from. A clone of a diverged trial ends here.
        CheckpointSaveError: a write failed (disk full, a name the file system refuses); the unfinished
            ``tmp-`` folder is removed and the trial's earlier checkpoints are untouched.
    """
    step = trial.state.global_step
    for what, state in (
        ("LoRA adapter", sweep.bank.state_dict(trial.slot)),
        ("value head", trial.value_head.state_dict()),
        ("optimizer state", trial.optimizer.state_dict()["state"]),
    ):
        bad = first_non_finite(state)
        if bad is not None:
            source = f" (a clone of {trial.parent!r}, copied from it)" if trial.parent is not None else ""
            raise CheckpointError(
                f"trial {trial.name!r}{source}: its {what} tensor {bad} holds NaN or infinite values at update "
                f"{step}; a checkpoint never holds them, so none was written. A diverged trial cannot be cloned: "
                "clone a trial that is still finite, or restart this one from its last checkpoint."
            )
    if sweep not in _SAVED_IDENTITY:
        _SAVED_IDENTITY[sweep] = sweep_identity(sweep)
    try:
        final = write_checkpoint(
            Path(trial.args.output_dir),
            step,
            lambda tmp, writing: _write_files(sweep, trial, tmp, writing),
            identity=_SAVED_IDENTITY[sweep],
            settings=run_settings(trial.args, len(sweep.train_dataset)),
            save_total_limit=trial.args.save_total_limit,
        )
    except CheckpointSaveError as err:
        error = CheckpointSaveError(f"saving trial {trial.name!r} at update {step}: {err}")
        error.errno = err.errno
        raise error from err
    trial.saved_step = step
    return final


def _write_files(sweep, trial, folder: Path, writing) -> None:
    from safetensors.torch import save_file

    with writing(folder / "adapter_model.safetensors"):
        save_file(sweep.bank.state_dict(trial.slot), str(folder / "adapter_model.safetensors"))
    with writing(folder / "adapter_config.json"):
        sweep.bank.peft_config.save_pretrained(str(folder))
    for name, state in (
        ("value_head.pt", trial.value_head.state_dict()),
        ("optimizer.pt", trial.optimizer.state_dict()),
        ("scheduler.pt", trial.scheduler.state_dict()),
        ("rng_state.pt", {"permutation": trial.perm_generator.get_state()}),
    ):
        with writing(folder / name):
            torch.save(state, folder / name)
    with writing(folder / "trainer_state.json"):
        trial.state.save_to_json(str(folder / "trainer_state.json"))
    meta = {"sweep_id": sweep.sweep_id, "name": trial.name, "overrides": trial.overrides,
            "parent": trial.parent, "branch_step": trial.branch_step}  # fmt: skip
    with writing(folder / TRIAL_FILE):
        (folder / TRIAL_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")


def write_index(sweep) -> None:
    """The trials (clones included) a resumed sweep rebuilds, with overrides, parent, status and reason."""
    trials = {
        name: {
            "overrides": t.overrides,
            "parent": t.parent,
            "branch_step": t.branch_step,
            "status": t.status,
            "reason": t.reason,
        }
        for name, t in sweep.trials.items()
    }
    index = {"format": INDEX_FORMAT, "sweep_id": sweep.sweep_id, "trials": trials}
    write_json(Path(sweep.args.output_dir) / INDEX, index)


def save_sweep(sweep) -> None:
    """Checkpoint every trial not saved at its current update (never a diverged or damaged one), then the
    index."""
    for trial in sweep.trials.values():
        if trial.status not in ("diverged", DAMAGED) and trial.saved_step != trial.state.global_step:
            if trial.state.global_step > 0 or trial.parent is not None:
                save_trial(sweep, trial)
    write_index(sweep)


# -------------------------------------------------------------------------------------------- reading
@dataclass
class SavedTrial:
    """One trial's checkpoint, verified against its manifest, read into memory and checked."""

    path: Path
    adapter: dict
    value_head: dict
    optimizer: dict
    scheduler: dict
    permutation: torch.Tensor
    state: PPOTrainerState
    manifest: Manifest
    meta: dict


def read_trial(path: Path) -> SavedTrial:
    """Every file of a checkpoint, verified against the manifest, read and checked for type and finiteness.

    Raises:
        CheckpointDamagedError: naming the file (and the tensor for a non-finite value).
        OldCheckpointError: a checkpoint from before manifests.
    """
    manifest = verify(path)
    meta = read_meta(path)
    f = path / "adapter_model.safetensors"
    adapter = require_tensors(f, read_safetensors(f), "LoRA adapter")
    require_finite(f, adapter, "the LoRA adapter:")
    f = path / "value_head.pt"
    head = require_tensors(f, read_pt(f, "value head"), "value head")
    require_finite(f, head, "the value head:")
    f = path / "optimizer.pt"
    optimizer = read_pt(f, "optimizer state")
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
            and isinstance(optimizer.get("param_groups"), list)):  # fmt: skip
        raise CheckpointDamagedError(f, "does not hold an optimizer state dict")
    require_finite(f, optimizer, "the optimizer state:")
    scheduler = read_pt(path / "scheduler.pt", "scheduler state")
    if not isinstance(scheduler, dict) or not isinstance(scheduler.get("last_epoch"), int):
        raise CheckpointDamagedError(path / "scheduler.pt", "does not hold an LR scheduler state dict")
    rng = read_pt(path / "rng_state.pt", "random state")
    perm = rng.get("permutation") if isinstance(rng, dict) else None
    try:
        torch.Generator().set_state(perm)
    except (TypeError, RuntimeError) as err:
        raise CheckpointDamagedError(
            path / "rng_state.pt", "does not hold the permutation generator's state", err
        ) from None
    state_file = path / "trainer_state.json"
    try:
        state = PPOTrainerState.load_from_json(str(state_file))
        if not isinstance(state.log_history, list) or not all(isinstance(h, dict) for h in state.log_history):
            raise TypeError("log_history is not a list of objects")
        if state.global_step != int(path.name.rpartition("-")[2]):
            raise ValueError(f"global_step {state.global_step!r} is not the update {path.name} was saved at")
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointDamagedError(state_file, "cannot be read as a trainer state", err) from None
    return SavedTrial(path, adapter, head, optimizer, scheduler, perm, state, manifest, meta)


def read_meta(path: Path) -> dict:
    """A checkpoint's ``trial.json``, checked: sweep id, name, overrides, parent, branch point."""
    f = path / TRIAL_FILE
    meta = read_json_object(f, "the trial's description")
    ok = (
        isinstance(meta.get("sweep_id"), str)
        and meta.get("name") == path.parent.name
        and isinstance(meta.get("overrides"), dict)
        and (meta.get("parent") is None or isinstance(meta.get("parent"), str))
        and (meta.get("branch_step") is None or isinstance(meta.get("branch_step"), int))
    )
    if not ok:
        raise CheckpointDamagedError(
            f,
            "cannot be read as the trial's description (needs sweep_id, name (the trial's folder), overrides, "
            "parent and branch_step)",
        )
    return meta


@dataclass
class Found:
    """What :func:`find_trial` found in a trial's folder: the newest checkpoint of this sweep that reads
    back intact (or None), and one line per newer checkpoint that was refused."""

    saved: SavedTrial | None
    refused: list[str]


def find_trial(folder: Path, sweep_id: str) -> Found:
    """The newest complete checkpoint of ``folder`` that this sweep wrote and that verifies; incomplete
    ones and those of an earlier sweep in the same output folder are skipped with a warning, damaged ones
    (a file changed, unreadable, non-finite) are listed in ``refused``.

    Raises:
        SweepCheckpointError: the newest checkpoint is from before manifests: the whole sweep was saved by
            an older release (refused, saying so), not one damaged folder.
    """
    refused = []
    for _, path in checkpoints(folder):
        if not is_complete(path):
            logger.warning("PPOSweep: skipping %s: its save did not finish (no manifest)", path)
            continue
        try:
            saved = read_trial(path)
        except OldCheckpointError as err:  # the sweep was saved by an older release, not one bad folder
            raise SweepCheckpointError(f"cannot resume the sweep: {' '.join(str(err).split())}") from None
        except CheckpointDamagedError as err:
            refused.append(" ".join(str(err).split()))
            continue
        if saved.meta["sweep_id"] == sweep_id:
            return Found(saved, refused)
        logger.warning("PPOSweep: skipping %s: an earlier sweep in this output folder wrote it", path)
    return Found(None, refused)


def latest_of(folder: Path, sweep_id: str) -> Path | None:
    """The newest checkpoint of ``folder`` this sweep wrote that verifies (:func:`find_trial`)."""
    found = find_trial(folder, sweep_id).saved
    return None if found is None else found.path


_NEW_SWEEP = "start a new sweep in a fresh output_dir"


def check_fits(sweep, args, saved: SavedTrial, identity: dict) -> list[str]:
    """Refuse a checkpoint that does not fit this run's trial ``args`` or the sweep's ``identity`` (before
    anything is restored); returns the warnings for the optimizer settings whose saved value is kept."""
    path = saved.path
    different = compare_identity(saved.manifest.identity, identity)
    if different:
        raise SweepCheckpointError(
            f"cannot resume the sweep from {path}: it was saved by another run ({'; '.join(different)}); "
            f"nothing was restored. Resume with the model, tokenizer and peft_config it was saved with, or "
            f"{_NEW_SWEEP}."
        )
    ref = sweep.bank.state_dict(sweep.bank.slots[0])
    _same_shapes(path / "adapter_model.safetensors", "LoRA adapter (LoraConfig r, target_modules)", ref,
                 saved.adapter)  # fmt: skip
    head = ValueHead(sweep.hidden_size).state_dict()
    _same_shapes(path / "value_head.pt", "value head (the model's hidden size)", head, saved.value_head)
    shapes = [v.shape for v in ref.values()] + [v.shape for v in head.values()]
    groups = saved.optimizer["param_groups"]
    ids = [i for g in groups if isinstance(g, dict) for i in g.get("params", [])]
    where = f"cannot resume the sweep: {path / 'optimizer.pt'}"
    if len(groups) != 1 or ids != list(range(len(shapes))):
        raise SweepCheckpointError(f"{where} does not hold one parameter group of {len(shapes)} parameters")
    for i, entry in saved.optimizer["state"].items():
        bad = not isinstance(entry, dict) or i not in ids
        bad = bad or any(
            not isinstance(v, torch.Tensor) or (v.ndim > 0 and v.shape != shapes[i]) for v in entry.values()
        )
        if bad:
            raise SweepCheckpointError(f"{where} holds an optimizer state that does not fit parameter {i}")
    settings, now = saved.manifest.settings, run_settings(args, len(sweep.train_dataset))
    problems = [
        f"{key} saved {settings.get(key)!r}, this run {now[key]!r}"
        for key in ("rollout_batch_size", "num_mini_batches", "seed", "num_train_prompts")
        if settings.get(key) != now[key]
    ]
    refused, kept = compare_settings(settings, now)
    if problems or refused:
        raise SweepCheckpointError(
            f"cannot resume the sweep from {path}: it was saved with other settings ({'; '.join(problems + refused)}): "
            f"the prompt order and the updates depend on them; nothing was restored. Resume with the settings "
            f"it was saved with, or {_NEW_SWEEP}."
        )
    return [f"PPOSweep: trial {path.parent.name}, resuming from {path}: {k}" for k in kept]


def _same_shapes(path: Path, what: str, expected: dict, saved: dict) -> None:
    if set(expected) != set(saved):
        only_saved = sorted(set(saved) - set(expected))[:3]
        only_run = sorted(set(expected) - set(saved))[:3]
        raise SweepCheckpointError(
            f"cannot resume the sweep: {path} does not fit this run's {what}: only in the file {only_saved}, "
            f"only in this run {only_run}; nothing was restored"
        )
    for key, value in expected.items():
        if tuple(saved[key].shape) != tuple(value.shape):
            raise SweepCheckpointError(
                f"cannot resume the sweep: {path} does not fit this run's {what}: {key} has shape "
                f"{tuple(saved[key].shape)} in the file and {tuple(value.shape)} in this run; nothing was restored"
            )


def read_index(out: Path) -> dict[str, dict]:
    """``sweep_checkpoint.json`` of ``out``, checked entry by entry; the error names the file and entry."""
    path = out / INDEX
    if not path.is_file():
        raise FileNotFoundError(f"{out} holds no {INDEX}: not the output folder of a PPOSweep run")
    try:
        data = read_json(path, "a sweep index")
    except SweepFileError as err:
        raise SweepCheckpointError(f"cannot resume the sweep: {err}") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != INDEX_FORMAT
        or not isinstance(data.get("trials"), dict)
        or not isinstance(data.get("sweep_id"), str)
    ):
        raise SweepCheckpointError(
            f"cannot resume the sweep: {path} is not a sweep index of format {INDEX_FORMAT} "
            "(an older rapidfire_hf, or a damaged file)"
        )
    for name, entry in data["trials"].items():
        where = f"cannot resume the sweep: {path}, trial {str(name)[:60]!r}"
        try:
            check_trial_name(name)
        except ValueError as err:
            raise SweepCheckpointError(f"{where}: {err}") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("overrides"), dict):
            raise SweepCheckpointError(f"{where}: needs an object with 'overrides'")
        if entry.get("status") not in STATES:
            raise SweepCheckpointError(
                f"{where}: status {entry.get('status')!r} is none of {', '.join(STATES)}"
            )
        if not (entry.get("parent") is None or isinstance(entry.get("parent"), str)):
            raise SweepCheckpointError(f"{where}: parent must be a trial name or null")
        branch = entry.get("branch_step")
        if not (branch is None or (isinstance(branch, int) and not isinstance(branch, bool) and branch >= 0)):
            raise SweepCheckpointError(f"{where}: branch_step must be an update count or null")
        if not isinstance(entry.setdefault("reason", ""), str):
            raise SweepCheckpointError(f"{where}: reason must be a string")
    return data


# -------------------------------------------------------------------------------------------- resuming
def load_sweep(sweep, resume_from_checkpoint) -> dict[str, Path]:
    """Restore every trial from its latest checkpoint that verifies (``True``: under ``args.output_dir``,
    or a folder); returns ``{trial: checkpoint folder}`` of those restored.

    A trial whose checkpoints are all damaged (a file changed since it was saved, unreadable, non-finite)
    or, for a clone, missing, is marked ``damaged`` with the reason and never trained or saved; the others
    resume. Everything else is read and checked first; a problem raises before any trial changes.

    Raises:
        FileNotFoundError: the folder holds no sweep.
        SweepCheckpointError: a damaged index, a trial whose overrides changed, a checkpoint of another run
            (base model, tokenizer, LoRA config) or saved with other settings.
    """
    from rapidfire_hf.sweep.trial import trial_args

    out = Path(sweep.args.output_dir if resume_from_checkpoint is True else resume_from_checkpoint)
    data = read_index(out)
    index, sweep_id = data["trials"], data["sweep_id"]
    index.update(_unlisted_clones(out, index, sweep_id))
    identity = sweep_identity(sweep)
    previous = _previous_summary(out)
    plan, warnings = [], []
    for name, entry in index.items():
        trial = sweep.trials.get(name)
        if trial is not None:
            _check_same_overrides(out / INDEX, name, entry["overrides"], trial.overrides)
            args = trial.args
        else:
            if entry["parent"] is None:
                logger.warning(
                    "PPOSweep: trial %s is not among this run's trials but %s lists it: it is resumed too "
                    "(stop it with sweep.stop or `rapidfire sweep ctl ... stop %s`)",
                    name,
                    INDEX,
                    name,
                )
            try:
                args = trial_args(sweep.args, entry["overrides"], name)
            except ValueError as err:
                raise SweepCheckpointError(f"cannot resume the sweep: {out / INDEX}: {err}") from None
        found = find_trial(out / "trials" / name, sweep_id)
        damage = _damage(out, name, entry, found)
        if found.saved is not None:
            warnings += check_fits(sweep, args, found.saved, identity)
        plan.append((name, entry, found.saved, damage))
    sweep.sweep_id = sweep_id
    restored = {}
    for name, entry, saved, damage in plan:  # every check passed: now change the trials
        if name not in sweep.trials:
            sweep._add(name, entry["overrides"])
        trial = sweep.trials[name]
        if saved is not None:
            _restore(sweep, trial, saved)
            restored[name] = saved.path
        trial.parent, trial.reason, trial.branch_step = (
            entry["parent"],
            entry["reason"],
            entry.get("branch_step"),
        )
        status = entry["status"]
        if status == DAMAGED and saved is not None:  # its folder was repaired since
            status = "running"
        trial.status = "running" if status == "finished" and not trial.done else status
        if damage is not None:
            trial.status, trial.reason = DAMAGED, damage
            logger.warning("PPOSweep: trial %s is marked damaged and not resumed: %s", name, damage)
        elif saved is None and trial.status != "running":
            _keep_record(trial, out, previous.get(name))
    for message in warnings:
        logger.warning("%s", message)
    for name, path in restored.items():
        logger.info("PPOSweep: trial %s resumed from %s", name, path)
    return restored


def _damage(out: Path, name: str, entry: dict, found: Found) -> str | None:
    """Why trial ``name`` cannot be resumed (None: it can, maybe from an older checkpoint, said here)."""
    folder = out / "trials" / name
    if found.saved is not None:
        for line in found.refused:
            logger.warning(
                "PPOSweep: trial %s resumes from %s, an older checkpoint: a newer one was refused: %s",
                name,
                found.saved.path.name,
                line,
            )
        return None
    if found.refused:
        return f"no checkpoint of it can be resumed: {found.refused[0]}"
    if entry["parent"] is not None:
        return (
            f"it is a clone of {entry['parent']!r} and {folder} holds no complete checkpoint of it (a clone is "
            "checkpointed when it is made)"
        )
    return None


def _previous_summary(out: Path) -> dict:
    """The trials of the ``summary.json`` an earlier run of this sweep wrote (empty if none is readable)."""
    try:
        trials = json.loads((out / SUMMARY).read_text(encoding="utf-8")).get("trials")
    except (OSError, ValueError, AttributeError):
        return {}
    return trials if isinstance(trials, dict) else {}


def _keep_record(trial, out: Path, record) -> None:
    """A stopped (or finished, early-stopped, diverged) trial without any checkpoint: its folder vanished,
    or it never saved one. Its record in ``summary.json`` is kept from the previous one, said once."""
    folder = out / "trials" / trial.name
    if isinstance(record, dict) and record.get("updates"):
        trial.kept_record = dict(record)
        logger.warning(
            "PPOSweep: trial %s is %s and %s holds no checkpoint of it (the folder vanished?): it stays %s, "
            "and its record in %s (%s updates) is kept from the previous one",
            trial.name, trial.status, folder, trial.status, SUMMARY, record.get("updates"),
        )  # fmt: skip
    else:
        logger.warning(
            "PPOSweep: trial %s is %s and %s holds no checkpoint of it; no earlier %s records it either",
            trial.name, trial.status, folder, SUMMARY,
        )  # fmt: skip


def _unlisted_clones(out: Path, index: dict, sweep_id: str) -> dict[str, dict]:
    """Index entries for the clones whose checkpoint this sweep wrote but whose index entry a kill
    prevented (the index is written just after a clone's checkpoint)."""
    found = {}
    trials_dir = out / "trials"
    for folder in sorted(trials_dir.iterdir()) if trials_dir.is_dir() else []:
        if folder.name in index or not folder.is_dir() or not _valid_name(folder.name):
            continue
        saved = find_trial(folder, sweep_id).saved
        if saved is None:
            continue
        meta, path = saved.meta, saved.path
        if meta["parent"] is None:  # a trial of this sweep is always in its first index
            logger.warning("PPOSweep: %s is not listed in %s: not resumed", folder, INDEX)
            continue
        found[folder.name] = {"overrides": meta["overrides"], "parent": meta["parent"],
                              "branch_step": meta["branch_step"], "status": "running", "reason": ""}  # fmt: skip
        logger.warning(
            "PPOSweep: clone %s was made just before the sweep stopped: resumed from %s", folder.name, path
        )
    return found


def _valid_name(name: str) -> bool:
    try:
        check_trial_name(name)
    except ValueError:
        return False
    return True


def _check_same_overrides(index: Path, name: str, saved: dict, now: dict) -> None:
    changed = sorted(
        k for k in set(saved) | set(now) if k not in LENGTH_FIELDS and saved.get(k) != now.get(k)
    )
    if changed:
        detail = "; ".join(f"{k}: saved {saved.get(k)!r}, this run {now.get(k)!r}" for k in changed)
        raise SweepCheckpointError(
            f"cannot resume the sweep: trial {name!r} was saved with other overrides ({detail}; see {index}); "
            "nothing was restored. Give it the saved overrides, or make the new setting a new trial (a clone)."
        )


def _restore(sweep, trial, saved: SavedTrial) -> None:
    trial.optimizer.load_state_dict(saved.optimizer)
    trial.scheduler.load_state_dict(saved.scheduler)
    sweep.bank.load_state_dict(trial.slot, saved.adapter)
    trial.value_head.load_state_dict(saved.value_head)
    trial.perm_generator.set_state(saved.permutation)
    trial.state = saved.state
    trial.saved_step = saved.state.global_step
