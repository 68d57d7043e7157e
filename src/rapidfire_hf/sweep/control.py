"""Controlling a running sweep from outside, and the rules that stop trials: early stopping, successive halving.

``rapidfire sweep ctl --dir out/sweep stop kl0.2`` checks the command against the sweep's live state
(``sweep_state.json``) and appends one JSON line to ``out/sweep/control.jsonl``; the sweep reads the lines
that arrived since its last look at every update boundary and applies them (``stop``, ``resume``,
``clone``). Lines written before the sweep started are not replayed. A line the sweep cannot use (not
UTF-8, not JSON, an unknown op, a missing trial, a bad override) is logged with its line number and
skipped: no line of that file can end the run.

Plain Python only (no torch): ``ctl`` answers in a fraction of a second.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from rapidfire_hf.sweep.fields import PER_TRIAL_FIELDS, check_trial_name, value_problem
from rapidfire_hf.sweep.files import SweepFileError, read_json

logger = logging.getLogger(__name__)

CONTROL_FILE = "control.jsonl"
STATE_FILE = "sweep_state.json"
OPS = ("stop", "resume", "clone")
_KEYS = {"stop": {"op", "trial"}, "resume": {"op", "trial"}, "clone": {"op", "trial", "new", "overrides"}}


# ---------------------------------------------------------------------------------------- the ctl side
def read_state(out_dir) -> dict:
    """The live state a running sweep writes (``sweep_state.json``), checked for shape.

    Raises:
        SweepFileError: no sweep in ``out_dir``, or a state file that cannot be read (names the file).
    """
    path = Path(out_dir) / STATE_FILE
    if not path.is_file():
        raise SweepFileError(
            f"no sweep in {out_dir}: {path.name} not found (a sweep writes it when it starts; give its output_dir)"
        )
    state = read_json(path, "a sweep state")
    if not isinstance(state, dict) or not isinstance(state.get("trials"), dict):
        raise SweepFileError(
            f"{path} is not a sweep state (written by another program or an older rapidfire_hf)"
        )
    return state


def process_gone(state: dict) -> bool:
    """Whether the sweep's process is known to be dead (only checked on the host that wrote the state)."""
    pid, host = state.get("pid"), state.get("host")
    if not isinstance(pid, int) or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by another user
        return False
    return False


def check_command(
    out_dir, op: str, trial: str, new: str | None = None, overrides: dict | None = None
) -> dict:
    """Check a command against the sweep's live state before it is queued; returns the state.

    Raises:
        ValueError: naming the problem: an unknown op, no sweep or no running sweep in ``out_dir``, an
            unknown trial, a stop of a trial that is not running, a clone name taken or not allowed, a
            field a trial cannot set or a value of the wrong kind.
    """
    if op not in OPS:
        raise ValueError(f"unknown sweep command {op!r}: allowed {', '.join(OPS)}")
    state = read_state(out_dir)
    status = state.get("status")
    if status != "running" or process_gone(state):
        why = f"status {status!r}" if status != "running" else f"its process {state.get('pid')} is gone"
        raise ValueError(
            f"the sweep in {out_dir} is not running ({why}); only a running sweep reads commands (continue it "
            "with `rapidfire sweep SWEEP.yaml --resume` or train(resume_from_checkpoint=True), then send it)"
        )
    trials = state["trials"]
    if trial not in trials:
        raise ValueError(f"no trial named {trial!r} in the sweep in {out_dir}; trials: {', '.join(trials)}")
    now = trials[trial].get("state") if isinstance(trials[trial], dict) else None
    if op == "stop" and now != "running":
        raise ValueError(f"trial {trial!r} is {now}, not running: nothing to stop")
    if op == "resume" and now not in ("stopped", "early_stopped"):
        raise ValueError(f"trial {trial!r} is {now}: only a stopped trial can be resumed")
    if op == "clone":
        if not new:
            raise ValueError("clone needs the new trial's name: clone SRC NEW [field=value ...]")
        check_trial_name(new)
        if new in trials:
            raise ValueError(f"a trial named {new!r} exists already: choose another name")
        for key, value in (overrides or {}).items():
            if key not in PER_TRIAL_FIELDS:
                raise ValueError(
                    f"{key} is not a field a trial can set (a field every trial shares, or no PPOConfig field); "
                    f"a trial can set: {', '.join(sorted(PER_TRIAL_FIELDS))}"
                )
            problem = value_problem(key, value)
            if problem is not None:
                raise ValueError(problem)
    return state


def append_command(
    out_dir, op: str, trial: str, new: str | None = None, overrides: dict | None = None
) -> Path:
    """Append one command for the sweep writing to ``out_dir``; returns the control file's path.

    Only the command's own shape is checked here; :func:`check_command` also checks it against the
    running sweep (``rapidfire sweep ctl`` calls both).

    Raises:
        ValueError: an unknown ``op``, or a clone without a new name.
    """
    if op not in OPS:
        raise ValueError(f"unknown sweep command {op!r}: allowed {', '.join(OPS)}")
    if op == "clone" and not new:
        raise ValueError("clone needs the new trial's name: clone SRC NEW [field=value ...]")
    path = Path(out_dir) / CONTROL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"op": op, "trial": trial}
    if op == "clone":
        line.update(new=new, overrides=overrides or {})
    with open(path, "ab") as f:  # one write of one line: appends of two shells do not mix
        # a line left unfinished by a writer that died would swallow this one: end it first
        cut = f.tell() > 0 and _last_byte(path) != b"\n"
        f.write((b"\n" if cut else b"") + json.dumps(line).encode("utf-8") + b"\n")
    return path


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


# ------------------------------------------------------------------------------------- the sweep side
def parse_line(raw: bytes) -> tuple | None:
    """One line of the control file as ``("stop", name, "ctl")``, ``("resume", name)`` or
    ``("clone", src, new, overrides)``; None for a blank line.

    Raises:
        ValueError: what is wrong with the line.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("is not UTF-8 text") from None
    if not text.strip():
        return None
    try:
        cmd = json.loads(text)
    except ValueError as err:
        raise ValueError(f"is not JSON ({err})") from None
    if not isinstance(cmd, dict):
        raise ValueError(
            f'is a JSON {type(cmd).__name__}, not an object like {{"op": "stop", "trial": NAME}}'
        )
    op = cmd.get("op")
    if op not in OPS:
        raise ValueError(f"has an unknown op {op!r}: allowed {', '.join(OPS)}")
    extra = sorted(set(cmd) - _KEYS[op])
    if extra:
        raise ValueError(f"has keys a {op} command does not take: {', '.join(map(str, extra))}")
    if not isinstance(cmd.get("trial"), str) or not cmd["trial"]:
        raise ValueError(f'needs "trial": the name of the trial to {op}')
    if op == "stop":
        return ("stop", cmd["trial"], "ctl")
    if op == "resume":
        return ("resume", cmd["trial"])
    if not isinstance(cmd.get("new"), str) or not cmd["new"]:
        raise ValueError('needs "new": the clone\'s name')
    overrides = cmd.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise ValueError(f"has overrides {overrides!r}: give an object of PPOConfig fields")
    return ("clone", cmd["trial"], cmd["new"], overrides)


class ControlFile:
    """Reads the commands appended to ``<out_dir>/control.jsonl`` after this object was created.

    :meth:`read` never raises: a line it cannot use is logged (file and line number) and skipped.
    """

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / CONTROL_FILE
        self._offset, self._line = 0, 0
        self._last_problem = None
        try:
            data = self.path.read_bytes()
            self._offset, self._line = len(data), data.count(b"\n")
        except OSError:  # none yet (or unreadable: read() says so)
            pass

    @property
    def offset(self) -> int:
        """Bytes of the file read so far (complete lines only)."""
        return self._offset

    def seek(self, offset: int) -> None:
        """Read on from byte ``offset`` (a resumed sweep: where the killed one had read to, so a command it
        never read is read now and one it applied is never applied twice). A file shorter than that (it was
        replaced) is read from its end, with a warning."""
        try:
            data = self.path.read_bytes()
        except OSError:
            data = b""
        if offset > len(data) or (offset > 0 and data[offset - 1 : offset] != b"\n"):
            if data or offset:
                self._warn(f"{self.path} changed since the sweep read it up to byte {offset}: only new lines are read")
            offset = len(data)
        self._offset, self._line = offset, data[:offset].count(b"\n")

    def _warn(self, message: str) -> None:
        if message != self._last_problem:  # a file that stays unreadable is reported once
            logger.warning("PPOSweep: %s", message)
        self._last_problem = message

    def read(self) -> list[tuple[int, tuple, int]]:
        """``[(line number, command, offset after its line), ...]`` of the complete lines that arrived since
        the last call."""
        try:
            size = self.path.stat().st_size
            if size < self._offset:
                self._warn(f"{self.path} became shorter than what was read; reading it again from its start")
                self._offset, self._line = 0, 0
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        except OSError as err:
            self._warn(f"cannot read {self.path} ({type(err).__name__}: {err}); its commands wait")
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next look
        start, self._offset = self._offset, self._offset + end
        commands = []
        for raw in data[:end].split(b"\n")[:-1]:
            self._line += 1
            start += len(raw) + 1
            try:
                cmd = parse_line(raw)
            except ValueError as err:
                logger.warning("PPOSweep: %s line %d skipped: it %s", self.path, self._line, err)
                continue
            if cmd is not None:
                commands.append((self._line, cmd, start))
        return commands


# ------------------------------------------------------------------------------------ stopping rules
def _check_rule(rule, metric, window, mode) -> None:
    name = type(rule).__name__
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"{name} metric must be a metric name such as 'objective/scores', got {metric!r}")
    if mode not in ("max", "min"):
        raise ValueError(f"{name} mode={mode!r}: allowed 'max' or 'min'")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{name} window must be an integer >= 1, got {window!r}")


def _level(trial, metric: str, window: int, upto: int | None = None) -> float | None:
    """Mean of ``metric`` over the trial's last ``window`` logged updates (up to update ``upto``)."""
    hist = trial.state.log_history
    values = [h[metric] for h in hist if metric in h and (upto is None or h.get("step", 0) <= upto)]
    values = values[-window:]
    return sum(values) / len(values) if values else None


def _existed(trial, update: int) -> bool:
    """Whether ``trial`` existed when the trials were judged after ``update``: a clone is made at the boundary
    after its parent's update ``branch_step``, after the rules judged it. A rule's verdict at an update then
    depends on the trials' histories up to it only, whichever trials were rebuilt by a resume."""
    branch = getattr(trial, "branch_step", None)  # rules also judge plain objects (tests, custom sweeps)
    return branch is None or branch < update


def _every(trial) -> int:
    return max(1, int(trial.args.logging_steps))


def check_metric_logged(rules, logged: dict, trial: str) -> None:
    """Refuse a rule whose metric is not among the metrics a trial logs (checked at the first update).

    Raises:
        ValueError: naming the rule, the metric, the trial and the closest logged names.
    """
    import difflib

    for rule in rules:
        metric = getattr(rule, "metric", None)
        if isinstance(metric, str) and metric not in logged:
            close = difflib.get_close_matches(metric, sorted(logged), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(
                f"{type(rule).__name__} judges trials by {metric!r}, which trial {trial!r} does not log{hint}; "
                "it would never rank a trial by it. Give a metric of the update's logs."
            )


@dataclass
class EarlyStopping:
    """Stop trials that fall behind the best trial by ``margin`` once they have run ``after_updates`` updates.

    A trial's level is the mean of ``metric`` over its last ``window`` logged updates; "best" is the highest
    level (``mode="max"``, e.g. reward) or the lowest (``mode="min"``) among trials with enough updates.
    A non-finite level (a diverged trial) is never the best and never compared. A trial resumed by hand is
    not stopped again.

    Example:
        >>> PPOSweep(..., early_stopping=EarlyStopping(metric="objective/scores", after_updates=10, margin=0.1))
    """

    metric: str = "objective/scores"
    after_updates: int = 10
    margin: float = 0.1
    window: int = 3
    mode: str = "max"

    def __post_init__(self):
        _check_rule(self, self.metric, self.window, self.mode)
        if (
            not isinstance(self.after_updates, int)
            or isinstance(self.after_updates, bool)
            or self.after_updates < 1
        ):
            raise ValueError(
                f"EarlyStopping after_updates must be an integer >= 1, got {self.after_updates!r}"
            )
        m = self.margin
        if not isinstance(m, int | float) or isinstance(m, bool) or not math.isfinite(m) or m < 0:
            raise ValueError(f"EarlyStopping margin must be a finite number >= 0, got {m!r}")

    def check_logging(self, trials) -> None:
        """Refuse a trial that logs too rarely to be judged: its first log after ``after_updates``.

        Raises:
            ValueError: naming the trial and its ``logging_steps``.
        """
        for t in trials:
            if _every(t) > self.after_updates and t.num_updates > self.after_updates:
                raise ValueError(
                    f"EarlyStopping judges trials from update {self.after_updates} on, but trial {t.name!r} logs "
                    f"every {_every(t)} updates (logging_steps): it would be judged on no value of "
                    f"{self.metric!r}. Lower its logging_steps to at most {self.after_updates} or raise after_updates."
                )

    def level(self, trial, upto: int | None = None) -> float | None:
        """The trial's level at update ``upto`` (its latest without); None before ``after_updates``."""
        if trial.state.global_step < self.after_updates or trial.status == "diverged":
            return None
        value = _level(trial, self.metric, self.window, upto)
        return value if value is not None and math.isfinite(value) else None

    def check(self, trials: dict) -> list[tuple[str, str]]:
        """``[(name, reason), ...]`` of running trials to stop now.

        The trials are judged at the update every running trial has reached (all of them at once, as they
        advance together), each by its level up to that update: a resumed sweep, whose trials may come back
        from checkpoints of different updates, judges them as the uninterrupted one did."""
        judged = [t for t in trials.values() if t.active and not getattr(t, "pinned", False)]
        if not judged:
            return []
        now = min(t.state.global_step for t in judged)
        if now < self.after_updates:
            return []
        levels = {
            n: lv for n, t in trials.items() if _existed(t, now) and (lv := self.level(t, upto=now)) is not None
        }
        if len(levels) < 2:
            return []
        sign = 1.0 if self.mode == "max" else -1.0
        best = max(levels.values(), key=lambda v: sign * v)
        out = []
        for t in judged:
            lv = levels.get(t.name)
            if lv is not None and t.state.global_step == now and sign * (best - lv) > self.margin:
                out.append(
                    (t.name, f"{self.metric} {lv:.4g} is {abs(best - lv):.4g} behind the best {best:.4g}")
                )
        return out


@dataclass
class SuccessiveHalving:
    """Successive halving: at each rung (an update count) keep the best ``keep`` fraction of the trials
    that reached it, by ``metric``, and stop the others (state ``early_stopped``, the decision in
    ``reason``).

    A rung is judged once every running trial has reached it, over every trial that reached it (those
    already past it too, by their level at the rung; diverged trials never). Judging a rung again stops
    nobody new, so a resumed sweep can apply the rule without repeating a cut. The level is the mean of
    ``metric`` over the last ``window`` logged updates up to the rung; a non-finite level ranks last. At
    least one trial is always kept. A trial resumed by hand is not stopped again.

    Example:
        >>> PPOSweep(..., early_stopping=SuccessiveHalving(rungs=(5, 10, 20), keep=0.5))
    """

    rungs: tuple = (5, 10, 20)
    keep: float = 0.5
    metric: str = "objective/scores"
    window: int = 1
    mode: str = "max"
    decisions: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        _check_rule(self, self.metric, self.window, self.mode)
        rungs = self.rungs
        if (not isinstance(rungs, list | tuple) or not rungs
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in rungs)
                or list(rungs) != sorted(set(rungs))):  # fmt: skip
            raise ValueError(f"SuccessiveHalving rungs must be increasing update counts >= 1, got {rungs!r}")
        k = self.keep
        if not isinstance(k, int | float) or isinstance(k, bool) or not 0 < k < 1:
            raise ValueError(f"SuccessiveHalving keep must be a fraction between 0 and 1, got {k!r}")
        self.rungs = tuple(rungs)

    def check_logging(self, trials) -> None:
        """Refuse a trial whose ``logging_steps`` skips a rung it reaches (it would be ranked on an older value).

        Raises:
            ValueError: naming the trial, its ``logging_steps`` and the rung.
        """
        for t in trials:
            missed = [r for r in self.rungs if r < t.num_updates and r % _every(t)]
            if missed:
                raise ValueError(
                    f"SuccessiveHalving ranks trials by {self.metric!r} at updates {list(self.rungs)}, but trial "
                    f"{t.name!r} logs every {_every(t)} updates (logging_steps), not at update {missed[0]}: give "
                    "it a logging_steps that divides every rung, or rungs it logs at."
                )

    def _rank(self, trial, rung: int) -> tuple:
        lv = _level(trial, self.metric, self.window, upto=rung)
        sign = 1.0 if self.mode == "max" else -1.0
        return (0, -sign * lv) if lv is not None and math.isfinite(lv) else (1, 0.0)

    def check(self, trials: dict) -> list[tuple[str, str]]:
        """``[(name, reason), ...]`` of running trials to stop now."""
        running = [t for t in trials.values() if t.active]
        if not running:
            return []
        now = min(t.state.global_step for t in running)
        out, stopping = [], set()
        for rung in (r for r in self.rungs if r <= now):
            pool = [t for t in trials.values()
                    if t.status != "diverged" and t.state.global_step >= rung and _existed(t, rung)]  # fmt: skip
            ordered = sorted(pool, key=lambda t, rung=rung: self._rank(t, rung))
            kept = max(1, math.ceil(len(ordered) * self.keep))
            cut = [(pos, t) for pos, t in enumerate(ordered[kept:], start=kept + 1)
                   if t.active and not getattr(t, "pinned", False) and t.name not in stopping]  # fmt: skip
            for pos, t in cut:
                lv = _level(t, self.metric, self.window, upto=rung)
                shown = "none" if lv is None else f"{lv:.4g}"
                out.append((t.name, f"successive halving at update {rung}: {self.metric} {shown} ranks {pos} "
                                    f"of {len(ordered)} (the best {kept} continue)"))  # fmt: skip
                stopping.add(t.name)
            decision = {"update": rung, "kept": [t.name for t in ordered[:kept]], "stopped": [t.name for _, t in cut]}
            if cut and decision not in self.decisions:  # a resumed sweep judging the rung again: recorded once
                self.decisions.append(decision)
        return out
