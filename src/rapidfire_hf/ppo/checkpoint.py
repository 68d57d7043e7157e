"""Saving and resuming PPO: models through ``save_pretrained``, optimizer/scheduler/RNG/trainer state beside.

A checkpoint directory ``<output_dir>/checkpoint-<update>/`` holds:
``policy/`` (save_pretrained; the LoRA adapter alone under PEFT), ``value_model/`` or ``value_head.pt``,
the tokenizer, ``optimizer.pt``, ``scheduler.pt``, ``rng_state_<rank>.pt``, ``trainer_state.json``,
``run_settings.json`` (the settings a resume is checked against) and, written last,
``checkpoint_complete.json`` (the size of every file). Resuming restores all of it, so a resumed CPU run
continues bit-identically.

Safety and atomicity:

- A checkpoint is written into ``tmp-checkpoint-<update>/``; every file and folder is fsynced, the
  completeness marker is written, then the folder is renamed. A save killed at any point leaves either
  the previous checkpoints untouched plus a ``tmp-`` folder (ignored, with a warning) or the new complete
  checkpoint.
- Every ``.pt`` file is read with ``torch.load(weights_only=True)``: tensors and plain values only, so a
  checkpoint cannot run code. RNG states are stored as tensors and ints for that reason.
- All files are read and checked before anything is restored; a missing, truncated or unreadable file
  raises :class:`CheckpointError` naming the file, before any training step.
- Before anything is restored, the checkpoint is also compared with the run (:func:`check_run`): the
  model's parameter names and shapes, and the settings the prompt order and an update depend on (rollout
  batch, ``num_mini_batches``, ``seed``, number of prompts) must match, else
  :class:`CheckpointMismatchError`; a changed learning rate is warned about (the checkpoint's is used).
- A failed write (disk full, I/O error) raises :class:`CheckpointSaveError` naming the checkpoint and the
  file; the unfinished ``tmp-`` folder is removed and the earlier checkpoints are untouched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

MARKER = "checkpoint_complete.json"
RUN_SETTINGS = "run_settings.json"
_FORMAT = 1
_CKPT = re.compile(r"^checkpoint-(\d+)$")
_TMP_PREFIX = "tmp-"
_OLD_PREFIX = "old-"
_UNSAFE = re.compile(r"\bGLOBAL\b|unsupported global|unsupported class", re.IGNORECASE)  # torch's refusals


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: incomplete, damaged, unsafe or from another setup."""


class CheckpointMismatchError(CheckpointError):
    """A complete checkpoint that does not fit this run (model shapes, rollout batch, seed, dataset)."""


class CheckpointSaveError(CheckpointError, OSError):
    """Writing a checkpoint failed (disk full, I/O error); ``errno`` is the original one when there was one.

    Also an ``OSError``, so code that handled the bare ``OSError`` of a full disk still catches it.
    """


def save_models(trainer, output_dir: str | os.PathLike) -> None:
    """Write the policy (and tokenizer) and the value function to ``output_dir``."""
    acc = trainer.accelerator
    module = acc.unwrap_model(trainer.model)
    out = Path(output_dir)
    if not acc.is_main_process:
        return
    out.mkdir(parents=True, exist_ok=True)
    module.policy.save_pretrained(out / "policy")
    trainer.processing_class.save_pretrained(out / "policy")
    if module.fused:
        torch.save(module.value_head.state_dict(), out / "value_head.pt")
    else:
        module.value_model.save_pretrained(out / "value_model")


# ---------------------------------------------------------------------------------------------- saving
def save(trainer) -> Path:
    """Write a full checkpoint for the current ``global_step`` atomically (:func:`write_checkpoint`); returns
    its directory.

    Every rank writes its RNG state; the main process writes the rest, the marker and renames the folder.
    With ``save_total_limit`` set, older complete checkpoints beyond the limit are deleted afterwards.

    Raises:
        CheckpointSaveError: a write failed (disk full, I/O error); it names the checkpoint and the file.
            The unfinished ``tmp-`` folder is removed; the earlier checkpoints are untouched (they are
            only rotated out after the new one is complete and renamed).
    """
    acc, args = trainer.accelerator, trainer.args

    def write(tmp: Path, writing) -> None:
        with writing(tmp):  # save_pretrained: the file is found in the traceback
            save_models(trainer, tmp)
        if acc.is_main_process:
            with writing(tmp / "optimizer.pt"):
                torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
            with writing(tmp / "scheduler.pt"):
                torch.save(trainer.lr_scheduler.state_dict(), tmp / "scheduler.pt")
            with writing(tmp / "trainer_state.json"):
                trainer.state.save_to_json(str(tmp / "trainer_state.json"))
            with writing(tmp / RUN_SETTINGS):
                (tmp / RUN_SETTINGS).write_text(json.dumps(run_settings(trainer), indent=2), encoding="utf-8")
        rng_file = tmp / f"rng_state_{acc.process_index}.pt"
        with writing(rng_file):
            torch.save(_rng_state(trainer), rng_file)
            _fsync(rng_file)

    return write_checkpoint(
        Path(args.output_dir),
        trainer.state.global_step,
        write,
        save_total_limit=args.save_total_limit,
        num_processes=acc.num_processes,
        main=acc.is_main_process,
        barrier=acc.wait_for_everyone,
    )


def write_checkpoint(
    root: Path,
    step: int,
    write: Callable[[Path, Callable[[Path], contextlib.AbstractContextManager]], None],
    *,
    save_total_limit: int | None = None,
    num_processes: int = 1,
    main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """The atomic checkpoint writer of PPOTrainer and of every PPOSweep trial: ``root/checkpoint-<step>``.

    ``write(tmp, writing)`` writes the files into the temporary folder ``tmp``, each inside
    ``with writing(path):`` so a failure names the file. Then every file and folder is fsynced, the
    completeness marker (:data:`MARKER`: the size of every file) is written, the folder renamed to its final
    name (replacing an earlier save of the same step) and, with ``save_total_limit``, the oldest complete
    checkpoints beyond it deleted. A kill at any moment leaves the earlier checkpoints plus either a
    ``tmp-`` folder (ignored on resume) or the new complete checkpoint.

    Args:
        main: whether this process prepares, seals and renames the folder (the main one); ``write`` runs on
            every process, between ``barrier()`` calls.

    Raises:
        CheckpointSaveError: a write failed; the unfinished ``tmp-`` folder is removed, the earlier
            checkpoints are untouched.
    """
    name = f"checkpoint-{step}"
    final, tmp = root / name, root / f"{_TMP_PREFIX}{name}"
    if main:
        with _writing(tmp, final, tmp):
            if tmp.exists():  # left by a save of this step that was killed
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
    barrier()
    write(tmp, lambda target: _writing(tmp, final, target))
    barrier()
    if main:
        with _writing(tmp, final, tmp):
            _fsync_tree(tmp)
        with _writing(tmp, final, tmp / MARKER):
            _write_marker(tmp, step, num_processes)
        with _writing(tmp, final, final, f"renaming {tmp.name} to"):
            _publish(tmp, final)
        if save_total_limit:
            with _writing(tmp, final, root, "deleting checkpoints beyond save_total_limit"):
                _rotate(root, int(save_total_limit), keep=final)
    barrier()
    return final


def run_settings(trainer) -> dict:
    """The settings a resume is checked against (:func:`check_run`), written as ``run_settings.json``."""
    args, acc = trainer.args, trainer.accelerator
    return {
        "format": 1,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "rollout_batch_size": args.local_batch_size * acc.num_processes,
        "num_mini_batches": args.num_mini_batches,
        "seed": args.seed,
        "learning_rate": args.learning_rate,
        "num_train_prompts": len(trainer.train_dataset),
    }


_PATH_LOCALS = ("filename", "f", "file", "path", "save_path", "output_file", "name")


def _file_being_written(error: BaseException, folder: Path) -> Path | None:
    """The file under ``folder`` a failed write was writing: the error's ``filename``, else a path-like
    local of the innermost frame that holds one (``safetensors.torch.save_file(filename=...)``,
    ``torch.save(f=...)``). None when neither names a file there."""
    candidates = []
    if isinstance(error, OSError) and error.filename:
        candidates.append(error.filename)
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):  # innermost first
        candidates += [frame.f_locals.get(k) for k in _PATH_LOCALS]
    for value in candidates:
        if not isinstance(value, (str, os.PathLike)):
            continue
        try:
            path = Path(value).resolve()
            path.relative_to(folder.resolve())
        except (ValueError, OSError, TypeError):
            continue
        if path != folder.resolve() and not path.is_dir():
            return path
    return None


@contextlib.contextmanager
def _writing(tmp: Path, final: Path, target: Path, doing: str = "writing"):
    """Turn a failed write into :class:`CheckpointSaveError` naming the checkpoint and the file, after
    removing the unfinished ``tmp`` folder (it frees the space a full disk needs, and nothing can be
    resumed from it). Complete checkpoints are never touched here."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # OSError, SafetensorError, torch's "PytorchStreamWriter failed writing file"
        if target == tmp or target.is_dir():  # a folder-wide step: find the file in the traceback
            target = _file_being_written(e, target) or target
        shown = str(target.relative_to(tmp)) if target.is_relative_to(tmp) and target != tmp else str(target)
        kept = ""
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            kept = f" The unfinished {tmp.name} was removed."
        complete = [p.name for _, p in _checkpoints(final.parent) if (p / MARKER).is_file()]
        kept += (
            f" Complete checkpoints on disk, untouched: {', '.join(complete[:3])}"
            f"{', ...' if len(complete) > 3 else ''}."
            if complete
            else " There is no complete checkpoint on disk yet."
        )
        error = CheckpointSaveError(
            f"saving checkpoint {final} failed while {doing} {shown} "
            f"({type(e).__name__}: {str(e)[:300]}).{kept} Free disk space (or fix the I/O error) and "
            "resume with resume_from_checkpoint=True."
        )
        error.errno = getattr(e, "errno", None)
        raise error from e


def _rng_state(trainer) -> dict:
    """Every random state the run draws from, as tensors, ints and floats (loadable with weights_only)."""
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "permutation": trainer._perm_generator.get_state(),
    }


def _set_rng_state(trainer, rng: dict) -> None:
    py = rng["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = rng["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    trainer._perm_generator.set_state(rng["permutation"])


def _fsync(path: Path) -> None:
    """Flush a file (or, on POSIX, a folder's entries) to disk."""
    if path.is_dir() and os.name != "posix":
        return  # folders cannot be opened for fsync on Windows; renames there are durable on their own
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, files in os.walk(folder):
        for f in files:
            _fsync(Path(dirpath) / f)
        _fsync(Path(dirpath))


def _write_marker(folder: Path, step: int, num_processes: int) -> None:
    files = {
        str(p.relative_to(folder).as_posix()): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    marker = folder / MARKER
    with open(marker, "w", encoding="utf-8") as f:
        json.dump({"format": _FORMAT, "global_step": step, "num_processes": num_processes, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync(folder)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` folder to ``final`` (replacing an earlier save of the same step)."""
    old = final.with_name(_OLD_PREFIX + final.name)
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old.exists() and not final.exists():  # put the earlier save of this step back
            os.replace(old, final)
        raise
    _fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _rotate(root: Path, limit: int, keep: Path) -> None:
    """Delete complete checkpoints so that ``limit`` remain: ``keep`` (just saved) and the newest others.

    Incomplete folders are left alone; each deleted folder is renamed first, so a kill during the deletion
    never leaves a half checkpoint under its own name.
    """
    others = [p for _, p in _checkpoints(root) if p != keep and (p / MARKER).is_file()]
    doomed = others[max(limit - 1, 0) :]
    for path in doomed:
        gone = path.with_name(_OLD_PREFIX + path.name)
        os.replace(path, gone)
        shutil.rmtree(gone)
    if doomed:
        _fsync(root)


# -------------------------------------------------------------------------------------------- finding
def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``checkpoint-<n>`` folders of ``root``, newest first."""
    found = [
        (int(m.group(1)), p)
        for p in Path(root).glob("checkpoint-*")
        if (m := _CKPT.match(p.name)) and p.is_dir()
    ]
    return sorted(found, reverse=True)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of ``output_dir`` (``None`` if there is none).

    Folders without the completeness marker (a save that did not finish) and ``tmp-checkpoint-*`` folders
    are skipped with a warning.
    """
    root = Path(output_dir)
    for tmp in sorted(root.glob(f"{_TMP_PREFIX}checkpoint-*")):
        logger.warning("rapidfire: ignoring %s, left by a checkpoint save that did not finish", tmp)
    for _, path in _checkpoints(root):
        if (path / MARKER).is_file():
            return path
        logger.warning(
            "rapidfire: skipping %s: it has no %s, so its save did not finish (or an older rapidfire_hf "
            "wrote it); resuming from an older complete checkpoint",
            path,
            MARKER,
        )
    return None


# -------------------------------------------------------------------------------------------- loading
def _damaged(path: Path, what: str, error: BaseException | None = None) -> CheckpointError:
    detail = f" ({type(error).__name__}: {str(error)[:300]})" if error is not None else ""
    return CheckpointError(
        f"cannot resume from this checkpoint: {path} {what}{detail}. The checkpoint is damaged or "
        "incomplete: resume from another checkpoint-* folder, or delete this one "
        "(resume_from_checkpoint=True picks the newest complete checkpoint)."
    )


def _check_marker(path: Path, num_processes: int) -> dict:
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"cannot resume from {path}: it has no {MARKER}, so its save did not finish (or an older "
            "rapidfire_hf wrote it). Resume from another checkpoint-* folder "
            "(resume_from_checkpoint=True picks the newest complete one)."
        )
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
        files = {str(k): int(v) for k, v in info["files"].items()}
        saved_by = int(info["num_processes"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _damaged(marker, "is not a valid completeness marker", e) from None
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            raise _damaged(f, "is missing")
        if f.stat().st_size != size:
            raise _damaged(f, f"has {f.stat().st_size} bytes instead of the {size} that were saved")
    if saved_by != num_processes:
        raise CheckpointError(
            f"cannot resume from {path}: it was saved by {saved_by} processes and this run has {num_processes}; "
            "resume with the same number of processes (each restores its own rng_state_<rank>.pt)"
        )
    return files


def _read_pt(path: Path, what: str):
    """``torch.load(weights_only=True)`` with errors that name the file."""
    if not path.is_file():
        raise _damaged(path, "is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (
        Exception
    ) as e:  # torch raises UnpicklingError, EOFError, RuntimeError, ... depending on the damage
        if _UNSAFE.search(str(e)):
            raise CheckpointError(
                f"refusing to load {path}: it holds Python objects other than tensors and plain values "
                f"(a {what} saved by rapidfire_hf never does), and unpickling them could run code. "
                "Do not resume from a checkpoint you did not write; resume from another checkpoint-* folder."
            ) from None
        raise _damaged(path, f"cannot be read as a {what}", e) from None


def _read_safetensors(folder: Path, adapter: bool) -> dict:
    from safetensors.torch import load_file

    files = [folder / "adapter_model.safetensors"] if adapter else sorted(folder.glob("*.safetensors"))
    if not files or not all(f.is_file() for f in files):
        raise _damaged(folder / (files[0].name if files else "*.safetensors"), "is missing")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # SafetensorError, OSError
            raise _damaged(f, "cannot be read as safetensors weights", e) from None
    return state


def _load_weights(model: torch.nn.Module, folder: Path, state: dict) -> None:
    """Load safetensors weights written by ``save_pretrained`` (adapter weights under PEFT)."""
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    really_missing = [k for k in missing if k not in tied and not _is_tied(model, k)]
    if really_missing or unexpected:
        raise CheckpointError(
            f"checkpoint {folder} does not match the model: missing {really_missing[:5]}, unexpected {unexpected[:5]}"
        )


def _is_tied(model, key: str) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False)) and key.endswith("lm_head.weight")


def _resolve(output_dir, resume_from_checkpoint) -> Path:
    if resume_from_checkpoint is True:
        path = latest_checkpoint(output_dir)
        if path is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint-* folder"
            )
        return path
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint={str(path)!r} is not a folder")
    return path


# ------------------------------------------------------------------------------ checking against the run
_NEW_RUN = "start a new run (without resume_from_checkpoint, best in a fresh output_dir)"


def _read_settings(path: Path) -> dict | None:
    """``run_settings.json`` of the checkpoint; None for a checkpoint written before it existed."""
    f = path / RUN_SETTINGS
    if not f.exists():
        return None
    try:
        settings = json.loads(f.read_text(encoding="utf-8"))
        if not isinstance(settings, dict):
            raise TypeError(f"a JSON {type(settings).__name__}, not an object")
    except (OSError, ValueError, TypeError) as e:
        raise _damaged(f, "cannot be read as run settings", e) from None
    return settings


def _lr_text(lrs) -> str:
    values = [float(v) for v in lrs]
    return f"{values[0]:g}" if len(set(values)) == 1 else "[" + ", ".join(f"{v:g}" for v in values) + "]"


def _learning_rate_warning(trainer, path: Path, settings: dict | None, scheduler_state) -> str | None:
    """A changed learning rate: the restored optimizer and scheduler state carry the checkpoint's, so
    that one is used. Compared on the scheduler's ``base_lrs`` (what is actually replaced, also with a
    custom optimizer and in checkpoints without ``run_settings.json``), else on ``learning_rate``."""
    saved = scheduler_state.get("base_lrs") if isinstance(scheduler_state, dict) else None
    new = getattr(trainer.lr_scheduler, "base_lrs", None)
    if not (isinstance(saved, (list, tuple)) and isinstance(new, (list, tuple)) and len(saved) == len(new)):
        if settings is None or "learning_rate" not in settings:
            return None
        saved, new = [settings["learning_rate"]], [trainer.args.learning_rate]
    try:
        if all(math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0) for a, b in zip(saved, new)):
            return None
    except (TypeError, ValueError):
        return None
    return (
        f"rapidfire: resuming from {path}: this run sets learning_rate {_lr_text(new)}, the checkpoint was "
        f"saved with {_lr_text(saved)}. The checkpoint's learning_rate {_lr_text(saved)} is used (the restored "
        f"optimizer and scheduler state carry it); to train with {_lr_text(new)}, {_NEW_RUN}."
    )


def check_run(trainer, path: Path, settings: dict | None, scheduler_state=None) -> list[str]:
    """Compare a checkpoint's ``run_settings.json`` with this run, before anything is restored.

    Refused (:class:`CheckpointMismatchError`, naming each setting, both values and the fix), because the
    resumed run would not continue the saved one:

    - the rollout batch (``per_device_train_batch_size * gradient_accumulation_steps`` x processes): the
      prompt order is cut into batches of that size, so prompts of the current epoch would be skipped or
      repeated. Another split of the same product (e.g. 4 x 2 -> 2 x 4, against an out-of-memory) is fine;
    - ``num_mini_batches``: it sets the optimizer steps (and the mini-batch size) of every update;
    - ``seed``: the prompt order is a permutation seeded with ``seed + pass``, so a new seed mid-epoch
      repeats some prompts and skips others. It cannot be "taken" by the resumed run either: the RNG
      states (sampling, dropout) are restored from the checkpoint. So it is refused, not warned about;
    - the number of prompts in ``train_dataset``: the permutation is over all rows and the batches per
      epoch depend on it.

    Warned about: a changed learning rate (the checkpoint's is used). A checkpoint without the file (an
    older rapidfire_hf) gets one warning that these settings cannot be checked.

    Returns the warnings to log once every check (the model shapes too) has passed.
    """
    args = trainer.args
    warnings = []
    if settings is None:
        warnings.append(
            f"rapidfire: {path} has no {RUN_SETTINGS} (an older rapidfire_hf saved it), so this run's rollout "
            "batch (per_device_train_batch_size x gradient_accumulation_steps), num_mini_batches, seed and "
            "train_dataset size cannot be checked against it; resuming assumes they are unchanged (a change "
            "alters the prompt order). The model's shapes are still checked."
        )
        settings = {}
    now = run_settings(trainer)
    problems = []
    old_batch, new_batch = settings.get("rollout_batch_size"), now["rollout_batch_size"]
    if old_batch is not None and old_batch != new_batch:
        old_local = (
            settings.get("per_device_train_batch_size", "?"),
            settings.get("gradient_accumulation_steps", "?"),
        )
        procs = trainer.accelerator.num_processes
        per_process = f" x {procs} processes" if procs > 1 else ""
        problems.append(
            f"rollout batch size (per_device_train_batch_size x gradient_accumulation_steps{per_process}): "
            f"saved {old_batch} (per_device_train_batch_size={old_local[0]} x gradient_accumulation_steps="
            f"{old_local[1]}), this run {new_batch} (per_device_train_batch_size="
            f"{args.per_device_train_batch_size} x gradient_accumulation_steps={args.gradient_accumulation_steps}). "
            "The prompt order is cut into rollout batches of this size, so resuming would skip or repeat "
            f"prompts of the current epoch. Resume with per_device_train_batch_size x "
            f"gradient_accumulation_steps = {old_batch // procs} (any split, e.g. per_device_train_batch_size="
            f"{old_local[0]}, gradient_accumulation_steps={old_local[1]}), or {_NEW_RUN}."
        )
    same = [
        (
            "num_mini_batches",
            "it sets the optimizer steps and the mini-batch size of every update, so the resumed run would not "
            "continue the saved one's updates",
        ),
        (
            "seed",
            "the prompt order is a permutation seeded with seed (one per pass over the data), so a new seed "
            "mid-epoch repeats some prompts and skips others (and the sampling RNG is restored from the "
            "checkpoint anyway)",
        ),
        (
            "num_train_prompts",
            "the prompt order is a seeded permutation of all rows of train_dataset and the batches per epoch "
            "depend on their number, so the resumed run would train on another order",
        ),
    ]
    for key, why in same:
        old, new = settings.get(key), now[key]
        if old is None or old == new:
            continue
        if key == "num_train_prompts":
            problems.append(
                f"train_dataset size: saved {old} prompts, this run {new}; {why}. Resume with the "
                f"train_dataset it was saved with ({old} prompts), or {_NEW_RUN}."
            )
        else:
            problems.append(
                f"{key}: saved {old}, this run {new}; {why}. Resume with {key}={old}, or {_NEW_RUN}."
            )
    if problems:
        raise CheckpointMismatchError(
            f"cannot resume from {path}: it was saved by a run with other settings; nothing was restored.\n- "
            + "\n- ".join(problems)
        )
    lr = _learning_rate_warning(trainer, path, settings or None, scheduler_state)
    return warnings + ([lr] if lr else [])


def _model_shapes(model, adapter: bool) -> dict[str, tuple[int, ...]]:
    """Names and shapes of what ``save_pretrained`` writes for ``model`` (the adapter alone under PEFT)."""
    if adapter:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
    else:
        state = model.state_dict()
    return {k: tuple(v.shape) for k, v in state.items()}


def check_shapes(what: str, folder: Path, model, saved: dict, adapter: bool = False) -> None:
    """Refuse a checkpoint whose weights for ``model`` have other names or shapes, before anything loads.

    Raises:
        CheckpointMismatchError: naming the first parameter (in the model's order) whose shape differs,
            with both shapes; or the names only one of the two has.
    """
    expected = _model_shapes(model, adapter)
    for name, shape in expected.items():
        if name in saved and tuple(saved[name].shape) != shape:
            raise CheckpointMismatchError(
                f"cannot resume from {folder.parent}: the {what} does not match the checkpoint's "
                f"({folder.name}): parameter {name} has shape {tuple(saved[name].shape)} in the checkpoint "
                f"and {shape} in this run's model; nothing was restored. Resume with the model the checkpoint "
                f"was saved with (the same config: hidden size, layers, heads, vocabulary), or {_NEW_RUN}."
            )
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if not adapter else set()
    missing = [
        k for k in expected if k not in saved and k not in tied and (adapter or not _is_tied(model, k))
    ]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"cannot resume from {folder.parent}: the {what} does not match the checkpoint's ({folder.name}): "
            f"parameters only in this run's model: {missing[:5]}, only in the checkpoint: {unexpected[:5]}; "
            f"nothing was restored. Resume with the model the checkpoint was saved with, or {_NEW_RUN}."
        )


def load(trainer, resume_from_checkpoint) -> int:
    """Restore a checkpoint into ``trainer``; returns the number of updates already done.

    Every file is read and the checkpoint is compared with the run (:func:`check_shapes`,
    :func:`check_run`) before anything of the trainer changes.

    Raises:
        CheckpointError: the checkpoint is incomplete, damaged, holds unsafe objects, or was saved by a
            different number of processes. Raised before anything is restored.
        CheckpointMismatchError: the model's parameter names or shapes, the rollout batch,
            ``num_mini_batches``, ``seed`` or the number of prompts differ from the checkpoint's. Raised
            before anything is restored.
    """
    args, acc = trainer.args, trainer.accelerator
    path = _resolve(args.output_dir, resume_from_checkpoint)
    _check_marker(path, acc.num_processes)
    module = acc.unwrap_model(trainer.model)
    policy_adapter = hasattr(module.policy, "peft_config")
    policy_state = _read_safetensors(path / "policy", adapter=policy_adapter)
    value_adapter = not module.fused and hasattr(module.value_model, "peft_config")
    if module.fused:
        value_state = _read_pt(path / "value_head.pt", "value head state dict")
    else:
        value_state = _read_safetensors(path / "value_model", adapter=value_adapter)
    optimizer_state = _read_pt(path / "optimizer.pt", "optimizer state dict")
    scheduler_state = _read_pt(path / "scheduler.pt", "scheduler state dict")
    rng = _read_pt(path / f"rng_state_{acc.process_index}.pt", "RNG state")
    state_file = path / "trainer_state.json"
    try:
        state = type(trainer.state).load_from_json(str(state_file))
    except (OSError, ValueError, TypeError) as e:
        raise _damaged(state_file, "cannot be read as a trainer state", e) from None
    settings = _read_settings(path)

    # Compare before restoring anything: a refused resume leaves the trainer exactly as it was.
    check_shapes("policy", path / "policy", module.policy, policy_state, policy_adapter)
    if module.fused:
        if not isinstance(value_state, dict):
            raise _damaged(path / "value_head.pt", "does not hold a state dict")
        check_shapes("value head", path / "value_head.pt", module.value_head, value_state)
    else:
        check_shapes("value model", path / "value_model", module.value_model, value_state, value_adapter)
    for message in check_run(trainer, path, settings, scheduler_state):
        logger.warning("%s", message)

    try:  # the optimizer first: it checks its groups before changing anything
        trainer.optimizer.load_state_dict(optimizer_state)
        trainer.lr_scheduler.load_state_dict(scheduler_state)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(
            f"cannot resume from {path}: its optimizer or scheduler state does not fit this trainer "
            f"({type(e).__name__}: {str(e)[:300]}); resume with the optimizer and settings it was saved with"
        ) from None
    _load_weights(module.policy, path / "policy", policy_state)
    if module.fused:
        module.value_head.load_state_dict(value_state)
    else:
        _load_weights(module.value_model, path / "value_model", value_state)
    try:
        _set_rng_state(trainer, rng)
    except (KeyError, ValueError, TypeError, RuntimeError, AttributeError) as e:
        raise _damaged(path / f"rng_state_{acc.process_index}.pt", "does not hold an RNG state", e) from None
    trainer.state = state
    return state.global_step
