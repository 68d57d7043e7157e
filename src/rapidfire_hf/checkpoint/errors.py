"""The errors of saving and resuming checkpoints, shared by ``PPOTrainer`` and ``PPOSweep``."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: incomplete, damaged, unsafe or from another run."""


class CheckpointMismatchError(CheckpointError):
    """A complete, intact checkpoint that does not fit this run (model, tokenizer, adapter, settings)."""


class CheckpointSaveError(CheckpointError, OSError):
    """Writing a checkpoint failed (disk full, I/O error); ``errno`` is the original one when there was one.

    Also an ``OSError``, so code that handled the bare ``OSError`` of a full disk still catches it.
    """


class CheckpointDamagedError(CheckpointError):
    """One file of a checkpoint is missing, changed since it was saved, unreadable, unsafe or not finite.

    Raised by the shared readers with the file (``path``) and the problem (``what``); each entry point
    (``PPOTrainer``, ``PPOSweep``) rewords it with its own advice.
    """

    def __init__(self, path: Path, what: str, error: BaseException | None = None):
        detail = (
            f" ({type(error).__name__}: {' '.join(str(error).split())[:300]})" if error is not None else ""
        )
        self.path, self.what = Path(path), f"{what}{detail}"
        super().__init__(f"{self.path} {self.what}")


class OldCheckpointError(CheckpointError):
    """A checkpoint written before manifests existed: its bytes and its run cannot be verified."""
