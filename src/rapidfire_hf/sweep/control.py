"""Controlling a running sweep from outside: a command file in its output folder, and early stopping.

``rapidfire sweep ctl --dir out/sweep stop kl0.2`` appends one JSON line to ``out/sweep/control.jsonl``;
the sweep reads the lines that arrived since its last look at every update boundary and applies them
(``stop``, ``resume``, ``clone``). Lines written before the sweep started are not replayed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

CONTROL_FILE = "control.jsonl"
OPS = ("stop", "resume", "clone")


def append_command(
    out_dir, op: str, trial: str, new: str | None = None, overrides: dict | None = None
) -> Path:
    """Append one command for the sweep writing to ``out_dir``; returns the control file's path.

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
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    return path


class ControlFile:
    """Reads the commands appended to ``<out_dir>/control.jsonl`` after this object was created."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / CONTROL_FILE
        self._offset = self.path.stat().st_size if self.path.exists() else 0

    def read(self) -> list[tuple]:
        """New complete lines as ``("stop", name, "ctl")``, ``("resume", name)``, ``("clone", src, new, overrides)``."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next look
        self._offset += end
        ops = []
        for raw in data[:end].decode().splitlines():
            if not raw.strip():
                continue
            cmd = json.loads(raw)
            if cmd["op"] == "stop":
                ops.append(("stop", cmd["trial"], "ctl"))
            elif cmd["op"] == "resume":
                ops.append(("resume", cmd["trial"]))
            elif cmd["op"] == "clone":
                ops.append(("clone", cmd["trial"], cmd["new"], cmd.get("overrides") or {}))
        return ops


@dataclass
class EarlyStopping:
    """Stop trials that fall behind the best trial by ``margin`` once they have run ``after_updates`` updates.

    A trial's level is the mean of ``metric`` over its last ``window`` logged updates; "best" is the highest
    level (``mode="max"``, e.g. reward) or the lowest (``mode="min"``) among trials with enough updates.

    Example:
        >>> PPOSweep(..., early_stopping=EarlyStopping(metric="objective/scores", after_updates=10, margin=0.1))
    """

    metric: str = "objective/scores"
    after_updates: int = 10
    margin: float = 0.1
    window: int = 3
    mode: str = "max"

    def __post_init__(self):
        if self.mode not in ("max", "min"):
            raise ValueError(f"EarlyStopping mode={self.mode!r}: allowed 'max' or 'min'")
        if self.window < 1 or self.after_updates < 1:
            raise ValueError("EarlyStopping window and after_updates must be >= 1")

    def level(self, trial) -> float | None:
        values = [h[self.metric] for h in trial.state.log_history if self.metric in h][-self.window :]
        if trial.state.global_step < self.after_updates or not values:
            return None
        return sum(values) / len(values)

    def check(self, trials: dict) -> list[tuple[str, str]]:
        """``[(name, reason), ...]`` of running trials to stop now."""
        levels = {n: lv for n, t in trials.items() if (lv := self.level(t)) is not None}
        if len(levels) < 2:
            return []
        sign = 1.0 if self.mode == "max" else -1.0
        best = max(levels.values(), key=lambda v: sign * v)
        out = []
        for name, lv in levels.items():
            if trials[name].active and sign * (best - lv) > self.margin and math.isfinite(lv):
                out.append(
                    (name, f"{self.metric} {lv:.4g} is {abs(best - lv):.4g} behind the best {best:.4g}")
                )
        return out
