"""Reading a telemetry stream back: locate it by PID, tail it, and fold it into a summary.

Used by ``rapidfire monitor``; kept here, next to the writer, so the record format has one home.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from rapidfire_hf.memory.telemetry import registry_path


class NoSuchProcessError(LookupError):
    """No process has this PID."""


class NotRapidfireProcessError(LookupError):
    """The process exists but has no rapidfire telemetry stream registered."""


def _create_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # another user's process: it exists, we cannot read its start time
        return -1.0


def is_running(pid: int, create_time: float | None = None) -> bool:
    """Whether ``pid`` runs and, when ``create_time`` is given, is the same process (PIDs get reused)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - create_time) <= 1.0
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def locate_stream(pid: int) -> tuple[Path, dict]:
    """Find the telemetry stream of ``pid`` through its registry entry.

    Returns:
        The stream path and the registry entry (``pid``, ``create_time``, ``stream``, ``host``).

    Raises:
        NoSuchProcessError: Nothing runs with this PID.
        NotRapidfireProcessError: The process has not registered a stream (or the entry is stale).
    """
    created = _create_time(pid)
    if created is None:
        raise NoSuchProcessError(f"no process with PID {pid} is running")
    entry_path = registry_path(pid)
    try:
        entry = json.loads(entry_path.read_text())
    except FileNotFoundError:
        raise NotRapidfireProcessError(
            f"process {pid} is not a rapidfire training process: it has no telemetry entry at {entry_path} "
            "(the stream opens when training starts; a run in another account or container writes its own "
            "cache: set RAPIDFIRE_CACHE_DIR to match)"
        ) from None
    except (OSError, ValueError) as err:
        raise NotRapidfireProcessError(
            f"process {pid}: unreadable telemetry entry {entry_path}: {err}"
        ) from None
    if entry.get("create_time") and created > 0 and abs(created - entry["create_time"]) > 1.0:
        raise NotRapidfireProcessError(
            f"process {pid} is not the rapidfire process that registered {entry_path} (the PID was reused)"
        )
    stream = Path(entry["stream"])
    if not stream.exists():
        raise NotRapidfireProcessError(f"process {pid} registered {stream}, which does not exist")
    return stream, entry


class TelemetryTail:
    """Reads the records appended to a stream since the last call (a partly written line waits)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[dict]:
        """Records appended since the previous call (all of them on the first)."""
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # "" when data ended with a newline
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a torn line from a crash: skip it, keep reading
        return out


class TelemetrySummary:
    """Folds records into what the monitor shows: latest memory, event counts, latest metrics."""

    def __init__(self):
        self.meta: dict = {}
        self.memory: dict | None = None
        self.events: Counter = Counter()
        self.last_events: dict[str, dict] = {}
        self.bytes_returned = 0
        self.metrics: dict = {}
        self.step = None
        self.phase = None
        self.updated = None
        self.records = 0

    def update(self, records: list[dict]) -> None:
        """Fold new records in."""
        for rec in records:
            self.records += 1
            self.updated = rec.get("t", self.updated)
            if rec.get("step") is not None:
                self.step = rec["step"]
            kind = rec.get("kind")
            if kind == "meta":
                self.meta = rec
            elif kind == "memory":
                self.memory = rec
                self.phase = rec.get("phase") or self.phase
            elif kind == "event":
                name = rec.get("name", "?")
                self.events[name] += 1
                self.last_events[name] = rec
                if name == "compaction":
                    self.bytes_returned += int(rec.get("bytes_returned") or 0)
            elif kind == "metrics":
                self.metrics.update(rec.get("values") or {})

    def to_dict(self) -> dict:
        """A JSON-ready view (what ``rapidfire monitor --json`` prints)."""
        mem = self.memory or {}
        return {
            "pid": self.meta.get("pid"),
            "host": self.meta.get("host"),
            "step": self.step,
            "phase": self.phase,
            "updated": self.updated,
            "records": self.records,
            "device": mem.get("device"),
            "memory": {
                k: mem.get(k)
                for k in (
                    "allocated",
                    "reserved",
                    "peak_allocated",
                    "peak_reserved",
                    "fragmentation",
                    "cached_free_bytes",
                    "inactive_split_bytes",
                    "inactive_split_blocks",
                    "num_alloc_retries",
                    "num_ooms",
                    "rss_bytes",
                )
            },
            "holdings": mem.get("holdings") or {},
            "compactions": {
                "count": self.events.get("compaction", 0),
                "bytes_returned": self.bytes_returned,
                "last": self.last_events.get("compaction"),
            },
            "rollbacks": self.events.get("rollback", 0),
            "precision_switches": self.events.get("precision_switch", 0),
            "oom_splits": self.events.get("oom_split", 0),
            "events": dict(self.events),
            "tokens_per_s": self.metrics.get("tokens_per_s"),
            "metrics": self.metrics,
        }
