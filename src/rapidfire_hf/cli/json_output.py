"""Keep the stdout of a ``--json`` command exactly its JSON document(s).

Libraries print to stdout while a command works: transformers prints ``[INFO] Running in WANDB offline
mode`` when its integrations are imported with ``WANDB_MODE=offline``, bitsandbytes says which CPU kernels it
failed to load, C extensions and child processes write to file descriptor 1 directly. Any of those lines in
front of the JSON breaks ``rapidfire plan --json | jq``. Inside :class:`JsonStdout`, ``sys.stdout`` is
``sys.stderr`` and fd 1 is a copy of fd 2, so all of it lands on stderr; :meth:`JsonStdout.emit` puts stdout
back for the moment it writes one document::

    with JsonStdout(args.json) as out:
        doc = work()          # whatever is printed here goes to stderr
        out.emit(doc)         # the only thing on stdout
"""

from __future__ import annotations

import ctypes
import json
import os
import sys


def _flush_all() -> None:
    """Flush Python's streams and C's stdio buffers (a C ``printf`` made while stdout was diverted must be
    written to stderr now, not to the real stdout once it is restored)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to reach (not POSIX): nothing buffered there
        pass


class JsonStdout:
    """While entered (and ``active``), stdout goes to stderr; :meth:`emit` writes a JSON document to the real
    stdout. Inactive, it changes nothing and :meth:`emit` is a plain ``print``."""

    def __init__(self, active: bool = True) -> None:
        self.active = active
        self._stdout = None  # sys.stdout as it was on entry
        self._saved_fd: int | None = None  # a duplicate of fd 1 as it was on entry
        self._diverted = False

    def __enter__(self) -> JsonStdout:
        if self.active:
            self._divert()
        return self

    def __exit__(self, *exc) -> None:
        if self._diverted:
            self._restore()

    def emit(self, doc, indent: int | None = 2) -> None:
        """Write ``doc`` as JSON and a newline to the real stdout, flushed."""
        if not self._diverted:
            print(json.dumps(doc, indent=indent), flush=True)
            return
        self._restore()
        try:
            print(json.dumps(doc, indent=indent), flush=True)
        finally:
            self._divert()

    def _divert(self) -> None:
        _flush_all()
        self._stdout = sys.stdout
        sys.stdout = sys.stderr
        try:
            self._saved_fd = os.dup(1)
            os.dup2(2, 1)
        except OSError:  # fd 1 or fd 2 closed: only Python's sys.stdout can be diverted
            if self._saved_fd is not None:
                os.close(self._saved_fd)
            self._saved_fd = None
        self._diverted = True

    def _restore(self) -> None:
        _flush_all()
        if self._saved_fd is not None:
            os.dup2(self._saved_fd, 1)
            os.close(self._saved_fd)
            self._saved_fd = None
        sys.stdout = self._stdout
        self._diverted = False
