"""Files a sweep writes while it runs, written so that a kill at any moment leaves the old or the new one.

A JSON file is written to a temporary name beside it, flushed to disk, then renamed over the old one
(``os.replace`` is atomic on POSIX and Windows): a reader sees the whole previous file or the whole new
one, never half of each. Plain Python only (``rapidfire sweep ctl`` reads these files without torch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class SweepFileError(ValueError):
    """A sweep file that cannot be read: missing, not JSON, not UTF-8, or not the expected shape."""


def fsync(path: Path) -> None:
    """Flush a file (or, on POSIX, a folder's entries) to disk."""
    if path.is_dir() and os.name != "posix":
        return  # folders cannot be opened for fsync on Windows
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data, indent: int | None = 1) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=indent, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync(path.parent)


def read_json(path: Path, what: str):
    """The JSON value in ``path``; :class:`SweepFileError` naming the file and ``what`` it should be."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise SweepFileError(f"{path} not found (expected {what})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SweepFileError(f"{path} cannot be read as {what} ({type(err).__name__}: {err})") from None
    try:
        return json.loads(text)
    except ValueError as err:
        raise SweepFileError(f"{path} is not valid JSON ({err}); expected {what}") from None
