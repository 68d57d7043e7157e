"""Ctrl-C and SIGTERM during training: finish the update, save a checkpoint, say where it is.

:class:`StopSignals` turns the first SIGINT or SIGTERM into a request (``requested``) that the training loop
reads at its next update boundary: it then writes a checkpoint and raises :class:`TrainingInterrupted`
naming the folder. A second signal abandons the update at once (``KeyboardInterrupt``, as Python's default
Ctrl-C); the weights are then between two updates, so only the checkpoints written before stand.

Handlers can only be installed from the main thread; elsewhere (a notebook's worker thread) the signals keep
their previous behaviour.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped at an update boundary by SIGINT or SIGTERM, after saving a checkpoint.

    Attributes:
        checkpoint: the folder to resume from (None when nothing could be saved), named in the message.
    """

    def __init__(self, message: str, checkpoint: Path | None):
        super().__init__(message)
        self.checkpoint = checkpoint


class StopSignals:
    """Within ``with StopSignals(what) as stop:``, SIGINT and SIGTERM set ``stop.requested`` (the first one)
    or raise ``KeyboardInterrupt`` (the second). ``what`` names the run in the one line said on stderr."""

    def __init__(self, what: str):
        self.what = what
        self.requested: str | None = None  # the signal's name, once one came
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in _NAMES:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt  # the second signal: abandon the update now
        self.requested = _NAMES.get(signum, f"signal {signum}")
        print(
            f"{self.what}: {self.requested} received: finishing the current update, then saving a checkpoint "
            "(send it again to stop at once; the update in progress is then lost)",
            file=sys.stderr,
            flush=True,
        )
