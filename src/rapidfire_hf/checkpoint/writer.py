"""The atomic checkpoint writer of ``PPOTrainer`` and of every ``PPOSweep`` trial, and finding checkpoints.

A checkpoint is written into ``tmp-checkpoint-<step>/``; every file and folder is fsynced, the manifest
(:mod:`rapidfire_hf.checkpoint.manifest`: every file's SHA-256, the run's identity and settings) is written
last and atomically, then the folder is renamed to ``checkpoint-<step>``. A save killed at any point leaves
the earlier checkpoints untouched plus either a ``tmp-`` folder (ignored, with a warning) or the new
complete checkpoint. A failed write raises :class:`CheckpointSaveError` naming the checkpoint and the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from rapidfire_hf.checkpoint.errors import CheckpointError, CheckpointSaveError
from rapidfire_hf.checkpoint.manifest import MANIFEST, is_complete, write_manifest

logger = logging.getLogger(__name__)

_CKPT = re.compile(r"^checkpoint-(\d+)$")
TMP_PREFIX = "tmp-"
_OLD_PREFIX = "old-"


def write_checkpoint(
    root: Path,
    step: int,
    write: Callable[[Path, Callable[[Path], contextlib.AbstractContextManager]], None],
    *,
    identity: dict,
    settings: dict,
    save_total_limit: int | None = None,
    num_processes: int = 1,
    main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Write ``root/checkpoint-<step>`` atomically; returns its path.

    ``write(tmp, writing)`` writes the files into the temporary folder ``tmp``, each inside
    ``with writing(path):`` so a failure names the file. Then every file and folder is fsynced, the
    manifest (hashes, ``identity``, ``settings``) written, the folder renamed to its final name (replacing an
    earlier save of the same step) and, with ``save_total_limit``, the oldest complete checkpoints beyond it
    deleted.

    Args:
        main: whether this process prepares, seals and renames the folder (the main one); ``write`` runs on
            every process, between ``barrier()`` calls.

    Raises:
        CheckpointSaveError: a write failed; the unfinished ``tmp-`` folder is removed, the earlier
            checkpoints are untouched.
    """
    name = f"checkpoint-{step}"
    final, tmp = root / name, root / f"{TMP_PREFIX}{name}"
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
            fsync_tree(tmp)
        with _writing(tmp, final, tmp / MANIFEST):
            write_manifest(tmp, step, num_processes, identity, settings)
        with _writing(tmp, final, final, f"renaming {tmp.name} to"):
            _publish(tmp, final)
        if save_total_limit:
            with _writing(tmp, final, root, "deleting checkpoints beyond save_total_limit"):
                _rotate(root, int(save_total_limit), keep=final)
    barrier()
    return final


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
        complete = [p.name for _, p in checkpoints(final.parent) if is_complete(p)]
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


def fsync(path: Path) -> None:
    """Flush a file (or, on POSIX, a folder's entries) to disk."""
    if path.is_dir() and os.name != "posix":
        return  # folders cannot be opened for fsync on Windows; renames there are durable on their own
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    for dirpath, _, files in os.walk(folder):
        for f in files:
            fsync(Path(dirpath) / f)
        fsync(Path(dirpath))


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
    fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _rotate(root: Path, limit: int, keep: Path) -> None:
    """Delete complete checkpoints so that ``limit`` remain: ``keep`` (just saved) and the newest others.

    Incomplete folders are left alone; each deleted folder is renamed first, so a kill during the deletion
    never leaves a half checkpoint under its own name.
    """
    others = [p for _, p in checkpoints(root) if p != keep and is_complete(p)]
    doomed = others[max(limit - 1, 0) :]
    for path in doomed:
        gone = path.with_name(_OLD_PREFIX + path.name)
        os.replace(path, gone)
        shutil.rmtree(gone)
    if doomed:
        fsync(root)


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``checkpoint-<n>`` folders of ``root``, newest first."""
    found = [
        (int(m.group(1)), p)
        for p in Path(root).glob("checkpoint-*")
        if (m := _CKPT.match(p.name)) and p.is_dir()
    ]
    return sorted(found, reverse=True)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint of ``output_dir`` whose save finished (``None`` if there is none).

    Folders without a manifest (a save that did not finish) and ``tmp-checkpoint-*`` folders are skipped
    with a warning. A folder with only the older sizes-only marker counts as finished: reading it then
    refuses it with the reason, instead of silently falling back to an even older one.
    """
    root = Path(output_dir)
    for tmp in sorted(root.glob(f"{TMP_PREFIX}checkpoint-*")):
        logger.warning("rapidfire: ignoring %s, left by a checkpoint save that did not finish", tmp)
    for _, path in checkpoints(root):
        if is_complete(path):
            return path
        logger.warning(
            "rapidfire: skipping %s: it has no %s, so its save did not finish; resuming from an older "
            "complete checkpoint",
            path,
            MANIFEST,
        )
    return None
