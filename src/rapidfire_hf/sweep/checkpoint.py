"""Saving and resuming a sweep, trial by trial.

``<output_dir>/trials/<name>/checkpoint-<update>/`` holds the trial's LoRA adapter as peft saves one
(``adapter_model.safetensors`` + ``adapter_config.json``: loadable with ``PeftModel.from_pretrained``
on the base model), ``value_head.pt``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pt`` (the epoch
permutation generator), ``trainer_state.json``, ``run_settings.json`` and, written last,
``checkpoint_complete.json`` (the size of every file; the marker ``PPOTrainer``'s checkpoints carry), and
``trial.json`` (the trial's name, overrides, parent, branch point and the sweep's id).
``<output_dir>/sweep_checkpoint.json`` lists the trials (clones included) with their overrides, parent,
status and reason, and the sweep's id, so resuming rebuilds the same set.

Safety:

- A checkpoint is written by PPOTrainer's writer (:func:`rapidfire_hf.ppo.checkpoint.write_checkpoint`): into
  ``tmp-checkpoint-<update>/``, every file fsynced, the marker written, then the folder renamed; the index
  is written to a temporary file and renamed. A kill at any moment leaves every trial's earlier complete
  checkpoints and the earlier index.
- A clone is checkpointed the moment it is made, so a resume restores it from its own state, never from
  its seed; a clone whose checkpoint was written but not yet listed in the index (a kill in between) is
  found by its ``trial.json`` and resumed too.
- Checkpoints left in the folder by an earlier sweep (another id) are skipped with a warning, never
  resumed as this sweep's.
- Resuming reads every file of every trial and checks it against the run (adapter and value-head shapes,
  optimizer state, rollout batch, seed, mini-batches, number of prompts) before any trial changes; a
  damaged, truncated or hostile file raises :class:`SweepCheckpointError` naming the file. ``.pt`` files
  are read with ``torch.load(weights_only=True)``: they cannot run code.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from rapidfire_hf.models.value_head import ValueHead
from rapidfire_hf.ppo.checkpoint import MARKER, CheckpointError, CheckpointSaveError, write_checkpoint
from rapidfire_hf.ppo.types import PPOTrainerState
from rapidfire_hf.sweep.fields import LENGTH_FIELDS, STATES, check_trial_name
from rapidfire_hf.sweep.files import SweepFileError, read_json, write_json

logger = logging.getLogger(__name__)

INDEX = "sweep_checkpoint.json"
INDEX_FORMAT = 1
SETTINGS = "run_settings.json"
TRIAL_FILE = "trial.json"
_FILES = ("adapter_model.safetensors", "value_head.pt", "optimizer.pt", "scheduler.pt", "rng_state.pt")
_CKPT = re.compile(r"^checkpoint-(\d+)$")


class SweepCheckpointError(CheckpointError):
    """A sweep checkpoint or index that cannot be resumed from; the message names the file."""


# ---------------------------------------------------------------------------------------------- saving
def run_settings(a, num_prompts: int) -> dict:
    """What a resume of a trial with PPOConfig ``a`` is checked against: its prompt order and updates
    depend on these."""
    return {
        "format": 1,
        "rollout_batch_size": a.local_batch_size,
        "num_mini_batches": a.num_mini_batches,
        "seed": a.seed,
        "num_train_prompts": num_prompts,
    }


def save_trial(sweep, trial) -> Path:
    """Write a checkpoint of ``trial`` at its current update with PPOTrainer's atomic writer
    (:func:`rapidfire_hf.ppo.checkpoint.write_checkpoint`); returns the folder.

    Raises:
        CheckpointSaveError: a write failed (disk full, a name the file system refuses); the unfinished
            ``tmp-`` folder is removed and the trial's earlier checkpoints are untouched.
    """
    step = trial.state.global_step
    try:
        final = write_checkpoint(
            Path(trial.args.output_dir),
            step,
            lambda tmp, writing: _write_files(sweep, trial, tmp, writing),
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
    settings = run_settings(trial.args, len(sweep.train_dataset))
    meta = {"sweep_id": sweep.sweep_id, "name": trial.name, "overrides": trial.overrides,
            "parent": trial.parent, "branch_step": trial.branch_step}  # fmt: skip
    for name, data in ((SETTINGS, settings), (TRIAL_FILE, meta)):
        with writing(folder / name):
            (folder / name).write_text(json.dumps(data, indent=1), encoding="utf-8")


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
    """Checkpoint every trial not saved at its current update (never a diverged one), then the index."""
    for trial in sweep.trials.values():
        if trial.status != "diverged" and trial.saved_step != trial.state.global_step:
            if trial.state.global_step > 0 or trial.parent is not None:
                save_trial(sweep, trial)
    write_index(sweep)


# -------------------------------------------------------------------------------------------- reading
@dataclass
class SavedTrial:
    """One trial's checkpoint, read into memory and checked."""

    path: Path
    adapter: dict
    value_head: dict
    optimizer: dict
    scheduler: dict
    permutation: torch.Tensor
    state: PPOTrainerState
    settings: dict
    meta: dict


def _damaged(path: Path, what: str, err: BaseException | None = None) -> SweepCheckpointError:
    detail = f" ({type(err).__name__}: {' '.join(str(err).split())[:300]})" if err is not None else ""
    return SweepCheckpointError(
        f"cannot resume the sweep: {path} {what}{detail}; nothing was restored. Delete that checkpoint "
        "folder to resume from the trial's previous one, or start a new sweep in a fresh output_dir."
    )


def _check_complete(path: Path) -> None:
    marker = path / MARKER
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
        files = {str(k): int(v) for k, v in info["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise _damaged(marker, "is not a valid completeness marker", err) from None
    for name in (*_FILES, "trainer_state.json", SETTINGS, TRIAL_FILE):
        if name not in files:
            raise _damaged(path / name, f"is not listed in {MARKER}")
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise _damaged(f, "is missing")
        if f.stat().st_size != size:
            raise _damaged(f, f"has {f.stat().st_size} bytes instead of the {size} that were saved")


def _read_pt(path: Path, what: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError (a pickled object: refused unread), EOFError, RuntimeError
        raise _damaged(
            path, f"cannot be read as a {what} (it may hold objects other than tensors)", err
        ) from None


def _tensors(path: Path, value, what: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(v, torch.Tensor) for v in value.values()):
        raise _damaged(path, f"does not hold a {what} (a mapping of tensors)")
    if not all(bool(v.isfinite().all()) for v in value.values() if v.is_floating_point()):
        raise _damaged(path, f"holds non-finite values in its {what}")
    return value


def read_trial(path: Path) -> SavedTrial:
    """Every file of a checkpoint, read and checked for completeness and type; names the bad file."""
    from safetensors.torch import load_file

    _check_complete(path)
    f = path / "adapter_model.safetensors"
    try:
        adapter = load_file(str(f))
    except Exception as err:  # SafetensorError, OSError
        raise _damaged(f, "cannot be read as safetensors weights", err) from None
    _tensors(f, adapter, "LoRA adapter")
    head = _tensors(path / "value_head.pt", _read_pt(path / "value_head.pt", "value head"), "value head")
    optimizer = _read_pt(path / "optimizer.pt", "optimizer state")
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
            and isinstance(optimizer.get("param_groups"), list)):  # fmt: skip
        raise _damaged(path / "optimizer.pt", "does not hold an optimizer state dict")
    scheduler = _read_pt(path / "scheduler.pt", "scheduler state")
    if not isinstance(scheduler, dict) or not isinstance(scheduler.get("last_epoch"), int):
        raise _damaged(path / "scheduler.pt", "does not hold an LR scheduler state dict")
    rng = _read_pt(path / "rng_state.pt", "random state")
    perm = rng.get("permutation") if isinstance(rng, dict) else None
    try:
        torch.Generator().set_state(perm)
    except (TypeError, RuntimeError) as err:
        raise _damaged(
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
        raise _damaged(state_file, "cannot be read as a trainer state", err) from None
    try:
        settings = read_json(path / SETTINGS, "run settings")
        if not isinstance(settings, dict):
            raise TypeError(f"a JSON {type(settings).__name__}, not an object")
    except (SweepFileError, TypeError) as err:
        raise _damaged(path / SETTINGS, "cannot be read as run settings", err) from None
    return SavedTrial(path, adapter, head, optimizer, scheduler, perm, state, settings, read_meta(path))


def read_meta(path: Path) -> dict:
    """A checkpoint's ``trial.json``, checked: sweep id, name, overrides, parent, branch point."""
    f = path / TRIAL_FILE
    try:
        meta = read_json(f, "a trial's description")
        ok = (
            isinstance(meta, dict)
            and isinstance(meta.get("sweep_id"), str)
            and meta.get("name") == path.parent.name
            and isinstance(meta.get("overrides"), dict)
            and (meta.get("parent") is None or isinstance(meta.get("parent"), str))
            and (meta.get("branch_step") is None or isinstance(meta.get("branch_step"), int))
        )
        if not ok:
            raise TypeError("needs sweep_id, name (the trial's folder), overrides, parent and branch_step")
    except (SweepFileError, TypeError) as err:
        raise _damaged(f, "cannot be read as the trial's description", err) from None
    return meta


def latest_of(folder: Path, sweep_id: str) -> Path | None:
    """The newest complete checkpoint of ``folder`` that this sweep wrote; incomplete ones and those of an
    earlier sweep in the same output folder are skipped with a warning."""
    found = sorted(
        (
            (int(m.group(1)), p)
            for p in folder.glob("checkpoint-*")
            if (m := _CKPT.match(p.name)) and p.is_dir()
        ),
        reverse=True,
    )
    for _, path in found:
        if not (path / MARKER).is_file():
            logger.warning("PPOSweep: skipping %s: its save did not finish (no %s)", path, MARKER)
            continue
        if read_meta(path)["sweep_id"] == sweep_id:
            return path
        logger.warning("PPOSweep: skipping %s: an earlier sweep in this output folder wrote it", path)
    return None


def check_fits(sweep, args, saved: SavedTrial) -> None:
    """Refuse a checkpoint that does not fit this run's trial ``args`` (before anything is restored)."""
    path = saved.path
    ref = sweep.bank.state_dict(sweep.bank.slots[0])
    _same_shapes(path / "adapter_model.safetensors", "LoRA adapter (LoraConfig r, target_modules)", ref,
                 saved.adapter)  # fmt: skip
    head = ValueHead(sweep.hidden_size).state_dict()
    _same_shapes(path / "value_head.pt", "value head (the model's hidden size)", head, saved.value_head)
    shapes = [v.shape for v in ref.values()] + [v.shape for v in head.values()]
    groups = saved.optimizer["param_groups"]
    ids = [i for g in groups if isinstance(g, dict) for i in g.get("params", [])]
    if len(groups) != 1 or ids != list(range(len(shapes))):
        raise _damaged(
            path / "optimizer.pt", f"does not hold one parameter group of {len(shapes)} parameters"
        )
    for i, entry in saved.optimizer["state"].items():
        bad = not isinstance(entry, dict) or i not in ids
        bad = bad or any(
            not isinstance(v, torch.Tensor) or (v.ndim > 0 and v.shape != shapes[i]) for v in entry.values()
        )
        if bad:
            raise _damaged(path / "optimizer.pt", f"holds an optimizer state that does not fit parameter {i}")
    now = run_settings(args, len(sweep.train_dataset))
    problems = [
        f"{key} saved {saved.settings.get(key)!r}, this run {now[key]!r}"
        for key in ("rollout_batch_size", "num_mini_batches", "seed", "num_train_prompts")
        if saved.settings.get(key) != now[key]
    ]
    if problems:
        raise SweepCheckpointError(
            f"cannot resume the sweep from {path}: it was saved with other settings ({'; '.join(problems)}): "
            "the prompt order and the updates depend on them; nothing was restored. Resume with the settings "
            "it was saved with, or start a new sweep in a fresh output_dir."
        )


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
    """Restore every trial from its latest complete checkpoint (``True``: under ``args.output_dir``, or a
    folder); returns ``{trial: checkpoint folder}`` of those restored.

    Everything is read and checked first; a problem raises before any trial changes.

    Raises:
        FileNotFoundError: the folder holds no sweep.
        SweepCheckpointError: a damaged or hostile file (named), a clone without a checkpoint, a trial
            whose overrides changed, or a checkpoint saved with other settings.
    """
    from rapidfire_hf.sweep.trial import trial_args

    out = Path(sweep.args.output_dir if resume_from_checkpoint is True else resume_from_checkpoint)
    data = read_index(out)
    index, sweep_id = data["trials"], data["sweep_id"]
    index.update(_unlisted_clones(out, index, sweep_id))
    plan = []
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
        found = latest_of(out / "trials" / name, sweep_id)
        if found is None and entry["parent"] is not None:
            raise SweepCheckpointError(
                f"cannot resume the sweep: trial {name!r} is a clone of {entry['parent']!r} and "
                f"{out / 'trials' / name} holds no complete checkpoint of it; nothing was restored"
            )
        saved = read_trial(found) if found is not None else None
        if saved is not None:
            check_fits(sweep, args, saved)
        plan.append((name, entry, saved))
    sweep.sweep_id = sweep_id
    restored = {}
    for name, entry, saved in plan:  # every check passed: now change the trials
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
        trial.status = "running" if entry["status"] == "finished" and not trial.done else entry["status"]
    for name, path in restored.items():
        logger.info("PPOSweep: trial %s resumed from %s", name, path)
    return restored


def _unlisted_clones(out: Path, index: dict, sweep_id: str) -> dict[str, dict]:
    """Index entries for the clones whose checkpoint this sweep wrote but whose index entry a kill
    prevented (the index is written just after a clone's checkpoint)."""
    found = {}
    trials_dir = out / "trials"
    for folder in sorted(trials_dir.iterdir()) if trials_dir.is_dir() else []:
        if folder.name in index or not folder.is_dir() or not _valid_name(folder.name):
            continue
        path = latest_of(folder, sweep_id)
        if path is None:
            continue
        meta = read_meta(path)
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
