"""The sweep's decision journal: every stop, resume and clone, every stopping rule's cut and every save,
recorded the moment it is taken, so a sweep killed at any point resumes to the same trial states.

``<output_dir>/decisions.jsonl`` is append-only: one JSON object a line, each written with one ``write``
and flushed to disk (``fsync``) before the sweep goes on. A kill in the middle of a line leaves a line
without its newline, which the reader drops (that decision was not taken yet: the resumed sweep takes it
again, as the uninterrupted one did). Every line carries ``round``: the rounds the sweep had run (one update
of every active trial each) when it was written.

A resume starts from the last ``saved`` line whose checkpoints are all there: every trial's checkpoint of
one round, the index and every trial's status then (:meth:`Replay.restore_cut` sets the folder back to
it). From there the same rounds run again: callbacks and stopping rules take the same decisions at the
same rounds (they are deterministic; a line they write again is known and not repeated), and what came from
outside (a control-file command, a Python call) is applied at the round it was applied in.

Lines (``op``):

- ``begin``: ``sweep_id``, ``control_offset`` (bytes of ``control.jsonl`` not to replay), ``statuses``
  (each trial's ``[status, reason, pinned]`` when training started).
- ``stop`` / ``resume`` / ``clone``: a command applied, with ``trial``, ``at`` (that trial's update) and
  ``status``/``reason`` (a stop), ``new``/``overrides`` (a clone); ``offset`` when it came from the control
  file; ``cmd``/``queued_at`` when it was a Python call queued during training.
- ``queued``: a Python call (``sweep.stop`` from a callback, ...) taken during training, applied at the next
  update boundary: ``cmd``, ``at``. ``ignored``: a queued call that could not be applied.
- ``control``: the control file was read up to ``offset`` (its commands that were refused included).
- ``rule``: a stopping rule's record for ``summary.json`` (``rule`` index, ``decision``).
- ``saved``: every trial checkpointed at this round: ``steps``, ``statuses`` and the ``index`` written.

Plain Python only (no torch).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections import Counter
from pathlib import Path

from rapidfire_hf.sweep.files import fsync, write_json

logger = logging.getLogger(__name__)

JOURNAL = "decisions.jsonl"
INDEX_NAME = "sweep_checkpoint.json"  # the sweep's index (rapidfire_hf.sweep.checkpoint.INDEX)
OPS = ("begin", "stop", "resume", "clone", "queued", "ignored", "control", "rule", "saved")


class JournalError(ValueError):
    """A decision journal that cannot be replayed (a damaged line in its middle); names the file and line."""


def _key(entry: dict) -> str:
    return json.dumps(entry, sort_keys=True)


class DecisionJournal:
    """Appends decision lines to ``<out_dir>/decisions.jsonl``, each on disk before :meth:`record` returns.

    Lines already in the journal when a resumed sweep takes the same decision again (a callback that fires
    again on an update the checkpoints lacked, a rule judging the same rung) are not written twice.
    """

    def __init__(self, out_dir):
        self.path = Path(out_dir) / JOURNAL
        self._known: Counter = Counter()
        self.round = 0  # the sweep's rounds so far (updates of its active trials), stamped on every line

    def start(self, sweep_id: str, control_offset: int, statuses: dict) -> None:
        """A new journal for a sweep that starts afresh (atomically replaces an earlier sweep's)."""
        begin = {"op": "begin", "sweep_id": sweep_id, "control_offset": control_offset, "statuses": statuses}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(json.dumps(begin).encode("utf-8") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync(self.path.parent)
        self._known = Counter()

    def replayed(self, entries: list[dict]) -> None:
        """The lines read back on resume: taking one of these decisions again does not write it again."""
        self._known = Counter(_key(e) for e in entries)

    def known(self, entry: dict) -> bool:
        """Whether ``entry`` is a line read back on resume (consumed: a second identical one is new)."""
        key = _key({**entry, "round": entry.get("round", self.round)})
        if self._known[key] > 0:
            self._known[key] -= 1
            return True
        return False

    def record(self, entry: dict) -> None:
        """Append ``entry`` and flush it to disk (one ``write`` of one line), unless read back on resume."""
        entry = {**entry, "round": entry.get("round", self.round)}
        if self.known(entry):
            return
        if entry.get("op") not in OPS:
            raise ValueError(f"unknown journal op {entry.get('op')!r}")
        data = json.dumps(entry).encode("utf-8") + b"\n"
        with open(self.path, "ab") as f:
            if f.tell() > 0 and _last_byte(self.path) != b"\n":
                data = b"\n" + data  # a line a killed writer left unfinished: end it, never join it
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def read_journal(out_dir) -> list[dict] | None:
    """The complete lines of ``<out_dir>/decisions.jsonl`` (None without one); a torn last line is dropped.

    Raises:
        JournalError: a line in the middle that is not a journal line (the file was damaged), or a first
            line that is not ``begin``; names the file and the line.
    """
    path = Path(out_dir) / JOURNAL
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise JournalError(f"cannot read {path} ({type(err).__name__}: {err})") from None
    lines = data.split(b"\n")
    complete, torn = lines[:-1], lines[-1]
    if torn:
        logger.info("PPOSweep: %s ends in a line a kill left unfinished: dropped", path)
    entries = []
    for number, raw in enumerate(complete, start=1):
        if not raw.strip():
            continue  # the newline that ended a torn line
        try:
            entry = json.loads(raw.decode("utf-8"))
        except ValueError:
            entry = None
        if not isinstance(entry, dict) or entry.get("op") not in OPS:
            if entry is None and _torn_then_ended(raw):
                # cut by a kill mid-write, then ended by the resumed sweep's newline: a decision not taken
                logger.info("PPOSweep: %s line %d was left unfinished by a kill: dropped", path, number)
                continue
            raise JournalError(
                f"cannot resume the sweep: {path} line {number} is not a decision line (the file was "
                "changed by hand or damaged); nothing was restored. Delete the file to resume from the "
                "checkpoints and the index alone."
            )
        entries.append(entry)
    if entries and entries[0].get("op") != "begin":
        raise JournalError(f"cannot resume the sweep: {path} does not start with its begin line")
    return entries


def _torn_then_ended(raw: bytes) -> bool:
    """A line that is a journal line cut short (a kill mid-write; the next writer ended it with a newline)."""
    raw = raw.strip()
    return raw.startswith(b'{"op": ') and not raw.endswith(b"}")


# ------------------------------------------------------------------------------------------ replaying
_TRANSITIONS = ("stop", "resume", "clone")
_CKPT = re.compile(r"^checkpoint-(\d+)$")


def command_of(entry: dict) -> tuple:
    """The sweep command a transition line records: ``("stop", name, reason)``, ``("resume", name)``,
    ``("clone", src, new, overrides)``."""
    if entry["op"] == "stop":
        return ("stop", entry["trial"], "early_stopped" if entry["status"] == "early_stopped" else entry["reason"])
    if entry["op"] == "resume":
        return ("resume", entry["trial"])
    return ("clone", entry["trial"], entry["new"], entry["overrides"])


def _complete(commit: dict, has_checkpoint) -> bool:
    """Whether every trial of a ``saved`` line has its checkpoint (a trial never saved needs none)."""
    trials = (commit.get("index") or {}).get("trials") or {}
    for name, step in commit["steps"].items():
        entry = trials.get(name) or {}
        if entry.get("status") in ("diverged", "damaged"):
            continue
        if (step > 0 or entry.get("parent") is not None) and not has_checkpoint(name, step):
            return False
    return True


class Replay:
    """What a resumed sweep takes from the journal of the run that was killed.

    The last ``saved`` line is the sweep's last complete save: every trial's checkpoint at one round, the
    index and every trial's status then. The resumed sweep starts from exactly that state (:meth:`restore_cut`
    sets the folder back to it), then runs the same rounds again: its callbacks and stopping rules take the
    same decisions at the same rounds (they are deterministic; the lines they write again are known and not
    repeated), and what came from outside (the control file, a Python call) is applied at the round it was
    applied in (:meth:`due_now`).

    Args:
        entries: the journal's lines (:func:`read_journal`), ``begin`` first.
    """

    def __init__(self, entries: list[dict], has_checkpoint=None):
        begin, body = entries[0], entries[1:]
        saves = [i for i, e in enumerate(body) if e["op"] == "saved"]
        # the last save whose checkpoints are all there (one removed by hand or by save_total_limit: an earlier)
        cut = next((i for i in reversed(saves) if has_checkpoint is None or _complete(body[i], has_checkpoint)), -1)
        if saves and cut != saves[-1]:
            logger.warning(
                "PPOSweep: the sweep's last save (round %d) lacks a checkpoint; resuming from its save of round %s",
                body[saves[-1]]["round"], body[cut]["round"] if cut >= 0 else "0 (the start)",
            )  # fmt: skip
        commit = body[cut] if cut >= 0 else None
        self.round = commit["round"] if commit else 0
        self.steps: dict = commit["steps"] if commit else {}
        self.index: dict | None = commit["index"] if commit else None
        self.statuses: dict = (commit or begin).get("statuses") or {}
        before, after = body[: cut + 1], body[cut + 1 :]
        self.decisions = [(e["rule"], e["decision"]) for e in before if e["op"] == "rule"]
        # Python calls queued in the round of the save: applied at the boundary that follows it
        self.pending = [(tuple(e["cmd"]), e["at"]) for e in before if e["op"] == "queued" and e["round"] == self.round]
        self.due = [e for e in after if (e["op"] in _TRANSITIONS and "offset" in e) or e["op"] == "queued"]
        # the round the killed run was in: control-file lines it had not read yet wait for it (it would have
        # read them at that round's boundary; `rapidfire sweep ctl` sends nothing to a sweep whose process is gone)
        self.last_round = max((e.get("round", 0) for e in body), default=0)
        offsets = [e["offset"] for e in body if isinstance(e.get("offset"), int)]
        self.control_offset = max([begin.get("control_offset", 0), *offsets])

    def restore_cut(self, out: Path, ours) -> None:
        """Set ``out`` back to the last complete save: its index, and none of this sweep's checkpoints written
        after it (by a save the kill cut short, or of a clone made after it: the replay writes them again).
        ``ours(folder)`` says whether a checkpoint folder is this sweep's (another sweep's are left alone)."""
        if self.index is not None:
            write_json(out / INDEX_NAME, self.index)
        trials = out / "trials"
        for folder in sorted(trials.iterdir()) if trials.is_dir() else []:
            step = self.steps.get(folder.name)
            for ckpt in folder.glob("checkpoint-*"):
                m = _CKPT.match(ckpt.name)
                if m and ckpt.is_dir() and (step is None or int(m.group(1)) > step) and ours(ckpt):
                    logger.info("PPOSweep: removing %s: written after the sweep's last complete save", ckpt)
                    shutil.rmtree(ckpt)

    def start(self, trials: dict) -> None:
        """Every trial's status at the last complete save (diverged trials keep theirs)."""
        for name, t in trials.items():
            if t.status in ("diverged", "damaged") or name not in self.statuses:  # decided by the checkpoints
                continue
            status, reason, pinned = self.statuses[name]
            status = "running" if status == "finished" else status  # finished is no decision: more updates may come
            t.status, t.reason, t.pinned = status, reason, bool(pinned)

    def due_now(self, round_: int) -> list[dict]:
        """The lines from outside the sweep (control file, Python calls) applied at round ``round_``."""
        now = [e for e in self.due if e["round"] <= round_]
        self.due = [e for e in self.due if e["round"] > round_]
        return now
