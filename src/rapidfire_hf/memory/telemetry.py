"""The per-process telemetry stream that ``rapidfire monitor`` reads.

Each training process appends JSON lines to ``<run dir>/<host>-<pid>.jsonl`` and registers itself in
``<cache>/procs/<pid>.json`` (``<cache>`` is ``$RAPIDFIRE_CACHE_DIR`` or ``~/.cache/rapidfire``), which
points at the stream, so that ``rapidfire monitor --pid PID`` finds it from the PID alone.

The stream holds the command line, so both files are private: folders are created 0700, files 0600, and
neither is reached through a symlink (the folders are opened with ``O_NOFOLLOW`` and must belong to this
user; the registry entry is created with ``O_EXCL``; the stream refuses a symlink or a hard link). A
folder or file planted by someone else raises :class:`TelemetryPathError` instead of being written.

Records (one JSON object a line, all with ``kind`` and ``t``, the Unix time):

- ``meta``: first line: ``pid``, ``host``, ``argv``, ``torch``, ``started``.
- ``memory``: a ``MemorySample`` (``allocated``, ``reserved``, ``peak_*``, ``fragmentation``,
  ``cached_free_bytes``, ``inactive_split_*``, ``holdings`` ...) plus ``step``, ``phase``, ``where``.
- ``event``: ``name`` (``compaction``, ``oom_split``, ``rollback``, ``precision_switch``, ...),
  ``step`` and the fields the emitter gave.
- ``metrics``: ``step`` and ``values`` (e.g. ``{"tokens_per_s": 1480.0, "loss": 0.3}``).

Other parts of the library push through the process-wide writer::

    from rapidfire_hf.memory import get_telemetry
    get_telemetry().event("rollback", step=12, reason="loss spike")
    get_telemetry().metrics(12, {"tokens_per_s": 1480.0})
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import stat
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

from rapidfire_hf.utils.cache import cache_dir

_BUFFER_LIMIT = 10_000  # records kept while no stream is open (older ones are dropped first)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_POSIX_FDS = os.name == "posix" and os.open in os.supports_dir_fd


class TelemetryPathError(PermissionError):
    """A telemetry folder or file is a symlink, a hard link or belongs to another user."""


def _unsafe(path: Path, why: str) -> TelemetryPathError:
    return TelemetryPathError(
        f"rapidfire telemetry: refusing to write {path}: {why}. Someone else may have planted it; remove it, "
        "or point RAPIDFIRE_CACHE_DIR / RAPIDFIRE_TELEMETRY_DIR at a folder only you can write."
    )


def _open_private_dir(path: Path) -> int:
    """Create ``path`` (0700) if missing and open it without following a symlink; returns its fd.

    Refuses a folder owned by another user; tightens the mode of our own to 0700.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    except OSError as e:  # ELOOP / ENOTDIR: the last component is a symlink or not a folder
        raise _unsafe(path, f"it is a symlink or not a folder ({e.strerror})") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise _unsafe(path, f"the folder belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, 0o700)
    return fd


def _check_private_file(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
        os.close(fd)
        raise _unsafe(path, "it is not a regular file of this user with a single link")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, 0o600)  # ours, from an earlier run with looser permissions


def registry_path(pid: int) -> Path:
    """Where the process ``pid`` registers its telemetry stream."""
    return cache_dir() / "procs" / f"{pid}.json"


def default_telemetry_dir(output_dir: str | os.PathLike | None = None) -> Path:
    """``$RAPIDFIRE_TELEMETRY_DIR``, else ``<output_dir>/telemetry``, else ``<cache>/telemetry``."""
    env = os.environ.get("RAPIDFIRE_TELEMETRY_DIR")
    if env:
        return Path(env)
    if output_dir:
        return Path(output_dir) / "telemetry"
    return cache_dir() / "telemetry"


def _process_create_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # no psutil, or the process is gone
        return None


def _json_default(value):
    # Tensors, numpy scalars and enums reach us from other parts' events: store them as plain values.
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "value"):
        return value.value
    return str(value)


class TelemetryWriter:
    """Appends telemetry records of this process to a JSON-lines file and registers it by PID.

    Records written before :meth:`open` are kept in memory and written when the stream opens, so events
    that other parts emit before training starts (e.g. a precision decision) are not lost.

    Args:
        directory: Run directory of the stream (default: :func:`default_telemetry_dir` at open time).
        register: Write the ``<cache>/procs/<pid>.json`` entry that ``rapidfire monitor --pid`` reads.

    Example:
        >>> writer = TelemetryWriter("/tmp/run/telemetry")
        >>> writer.open()  # doctest: +SKIP
        >>> writer.event("compaction", step=10, bytes_returned=1 << 30)  # doctest: +SKIP
    """

    def __init__(self, directory: str | os.PathLike | None = None, register: bool = True):
        self.directory = Path(directory) if directory is not None else None
        self.register = register
        self.pid = os.getpid()
        self.path: Path | None = None
        self._file = None
        self._lock = threading.Lock()
        self._pending: deque[dict] = deque(maxlen=_BUFFER_LIMIT)

    @property
    def is_open(self) -> bool:
        """Whether records go to a file (``False``: they are buffered in memory)."""
        return self._file is not None

    def open(self, directory: str | os.PathLike | None = None) -> Path:
        """Open the stream (idempotent), register the process and flush buffered records.

        Args:
            directory: Overrides the directory given at construction.

        Returns:
            The path of the JSON-lines file.
        """
        with self._lock:
            if self._file is not None:
                return self.path
            self.directory = (
                Path(directory) if directory is not None else self.directory or default_telemetry_dir()
            )
            self.path = self.directory / f"{socket.gethostname()}-{self.pid}.jsonl"
            # line buffering: the monitor reads whole lines while we write
            self._file = open(_open_stream(self.path), "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            self._write_locked(
                {
                    "kind": "meta",
                    "t": time.time(),
                    "pid": self.pid,
                    "host": socket.gethostname(),
                    "argv": sys.argv,
                    "torch": torch.__version__,
                    "started": _process_create_time(self.pid),
                }
            )
            while self._pending:
                self._write_locked(self._pending.popleft())
        if self.register:
            self._register()
        atexit.register(self.close)
        return self.path

    def _register(self) -> None:
        entry = registry_path(self.pid)
        payload = json.dumps(
            {
                "pid": self.pid,
                "create_time": _process_create_time(self.pid),
                "stream": str(self.path.resolve()),
                "host": socket.gethostname(),
            }
        ).encode()
        if not _POSIX_FDS:
            entry.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_entries(entry.parent)
            tmp = entry.with_suffix(".tmp")
            tmp.write_bytes(payload)
            tmp.replace(entry)
            return
        dir_fd = _open_private_dir(entry.parent)
        try:
            _remove_stale_entries(entry.parent)
            tmp = f"{self.pid}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
            try:
                fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            except FileExistsError:  # left by an earlier process with this PID, or planted: drop the name
                os.unlink(tmp, dir_fd=dir_fd)
                fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            # atomic, and a rename never follows a symlink: the monitor never reads half a file
            os.replace(tmp, entry.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def _write_locked(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=_json_default) + "\n")

    def write(self, kind: str, **fields) -> None:
        """Append one record of ``kind`` (``t`` is added); buffered in memory until :meth:`open`."""
        record = {"kind": kind, "t": time.time(), **fields}
        with self._lock:
            if self._file is None:
                self._pending.append(record)
            else:
                self._write_locked(record)

    def event(self, name: str, step: int | None = None, **fields) -> None:
        """Record an event (``compaction``, ``oom_split``, ``rollback``, ``precision_switch``, ...)."""
        self.write("event", name=name, step=step, **fields)

    def metrics(self, step: int | None, values: dict) -> None:
        """Record numeric metrics of a step, e.g. ``{"tokens_per_s": 1480.0}``."""
        self.write("metrics", step=step, values=dict(values))

    def memory(
        self, sample, step: int | None = None, phase: str | None = None, where: str | None = None
    ) -> None:
        """Record a :class:`~rapidfire_hf.memory.stats.MemorySample`."""
        self.write("memory", step=step, phase=phase, where=where, **sample.to_dict())

    def close(self) -> None:
        """Close the stream and remove the registry entry (the stream file stays)."""
        with self._lock:
            if self._file is None:
                return
            self._file.close()
            self._file = None
        if self.register:
            registry_path(self.pid).unlink(missing_ok=True)


def _open_stream(path: Path) -> int:
    """Open (create 0600, or append to) the stream at ``path`` in a private folder; never through a link."""
    if not _POSIX_FDS:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    dir_fd = _open_private_dir(path.parent)
    try:
        try:
            fd = os.open(path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o600, dir_fd=dir_fd)
        except OSError as e:  # ELOOP: a symlink sits where the stream goes
            raise _unsafe(path, f"it is a symlink ({e.strerror})") from None
    finally:
        os.close(dir_fd)
    _check_private_file(fd, path)
    return fd


def _remove_stale_entries(procs: Path) -> None:
    # Entries of processes killed before they could clean up; cheap (one small file per process).
    for entry in procs.glob("*.json"):
        try:
            info = json.loads(entry.read_text())
            created = _process_create_time(int(info["pid"]))
            if created is None or (info.get("create_time") and abs(created - info["create_time"]) > 1.0):
                entry.unlink(missing_ok=True)
        except (OSError, ValueError, KeyError):
            continue


_DEFAULT: TelemetryWriter | None = None
_DEFAULT_LOCK = threading.Lock()


def get_telemetry() -> TelemetryWriter:
    """The process-wide writer (created on first use; records are buffered until someone opens it)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT.pid != os.getpid():  # a forked child gets its own stream
            _DEFAULT = TelemetryWriter()
        return _DEFAULT
