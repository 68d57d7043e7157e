"""Saving and resuming PPO: models through ``save_pretrained``, optimizer/scheduler/RNG/trainer state beside.

A checkpoint directory ``<output_dir>/checkpoint-<update>/`` holds:
``policy/`` (save_pretrained; the LoRA adapter alone under PEFT), ``value_model/`` or ``value_head.pt``,
the tokenizer, ``optimizer.pt``, ``scheduler.pt``, ``rng_state_<rank>.pt``, ``trainer_state.json`` and,
written last, ``checkpoint_complete.json`` (the size of every file). Resuming restores all of it, so a
resumed CPU run continues bit-identically.

Safety and atomicity:

- A checkpoint is written into ``tmp-checkpoint-<update>/``; every file and folder is fsynced, the
  completeness marker is written, then the folder is renamed. A save killed at any point leaves either
  the previous checkpoints untouched plus a ``tmp-`` folder (ignored, with a warning) or the new complete
  checkpoint.
- Every ``.pt`` file is read with ``torch.load(weights_only=True)``: tensors and plain values only, so a
  checkpoint cannot run code. RNG states are stored as tensors and ints for that reason.
- All files are read and checked before anything is restored; a missing, truncated or unreadable file
  raises :class:`CheckpointError` naming the file, before any training step.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

MARKER = "checkpoint_complete.json"
_FORMAT = 1
_CKPT = re.compile(r"^checkpoint-(\d+)$")
_TMP_PREFIX = "tmp-"
_OLD_PREFIX = "old-"
_UNSAFE = re.compile(r"\bGLOBAL\b|unsupported global|unsupported class", re.IGNORECASE)  # torch's refusals


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: incomplete, damaged, unsafe or from another setup."""


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
    """Write a full checkpoint for the current ``global_step`` atomically; returns its directory.

    Every rank writes its RNG state; the main process writes the rest, the marker and renames the folder.
    With ``save_total_limit`` set, older complete checkpoints beyond the limit are deleted afterwards.
    """
    acc, args = trainer.accelerator, trainer.args
    root = Path(args.output_dir)
    name = f"checkpoint-{trainer.state.global_step}"
    final, tmp = root / name, root / f"{_TMP_PREFIX}{name}"
    if acc.is_main_process:
        if tmp.exists():  # left by a save of this step that was killed
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    save_models(trainer, tmp)
    if acc.is_main_process:
        torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(trainer.lr_scheduler.state_dict(), tmp / "scheduler.pt")
        trainer.state.save_to_json(str(tmp / "trainer_state.json"))
    rng_file = tmp / f"rng_state_{acc.process_index}.pt"
    torch.save(_rng_state(trainer), rng_file)
    _fsync(rng_file)
    acc.wait_for_everyone()
    if acc.is_main_process:
        _fsync_tree(tmp)
        _write_marker(tmp, trainer.state.global_step, acc.num_processes)
        _publish(tmp, final)
        if args.save_total_limit:
            _rotate(root, args.save_total_limit, keep=final)
    acc.wait_for_everyone()
    return final


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
    os.replace(tmp, final)
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


def load(trainer, resume_from_checkpoint) -> int:
    """Restore a checkpoint into ``trainer``; returns the number of updates already done.

    Raises:
        CheckpointError: the checkpoint is incomplete, damaged, holds unsafe objects, or was saved by a
            different number of processes. Raised before anything is restored.
    """
    args, acc = trainer.args, trainer.accelerator
    path = _resolve(args.output_dir, resume_from_checkpoint)
    _check_marker(path, acc.num_processes)
    module = acc.unwrap_model(trainer.model)
    policy_state = _read_safetensors(path / "policy", adapter=hasattr(module.policy, "peft_config"))
    if module.fused:
        value_state = _read_pt(path / "value_head.pt", "value head state dict")
    else:
        value_state = _read_safetensors(
            path / "value_model", adapter=hasattr(module.value_model, "peft_config")
        )
    optimizer_state = _read_pt(path / "optimizer.pt", "optimizer state dict")
    scheduler_state = _read_pt(path / "scheduler.pt", "scheduler state dict")
    rng = _read_pt(path / f"rng_state_{acc.process_index}.pt", "RNG state")
    state_file = path / "trainer_state.json"
    try:
        state = type(trainer.state).load_from_json(str(state_file))
    except (OSError, ValueError, TypeError) as e:
        raise _damaged(state_file, "cannot be read as a trainer state", e) from None

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
