"""What a fired fallback rule does, and the record kept of it."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class PrecisionAction:
    """One applied action: a precision switch, a pipeline toggle or a memory compaction.

    Attributes:
        step: Step whose metrics triggered it.
        verb: ``switch_to``, ``disable_pipeline``, ``enable_pipeline`` or ``compact_memory``.
        argument: The precision of ``switch_to`` (``"fp32"``), else None.
        target: Layer name for a layer switch, None for the whole model or a non-switch action.
        reason: Why, e.g. ``"rule 'grad_norm > 1.0' (grad_norm=2.31)"``.
        time: Wall-clock time (``time.time()``) when it was applied.
    """

    step: int
    verb: str
    argument: str | None = None
    target: str | None = None
    reason: str = ""
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        what = f"{self.verb} {self.argument}" if self.argument else self.verb
        where = f" layer {self.target}" if self.target else (" (model)" if self.verb == "switch_to" else "")
        return f"step {self.step}: {what}{where} because {self.reason}"


def describe_match(rule, metrics: dict[str, float], layers: list[str] | None = None) -> str:
    """Human-readable reason for a fired rule, with the values that matched."""
    if rule.layer is None:
        return f"rule '{rule.condition}' ({rule.metric}={metrics.get(rule.metric, float('nan')):.4g})"
    shown = ", ".join(f"{n}={metrics[f'layer:{n}.{rule.metric}']:.4g}" for n in (layers or [])[:4])
    return f"rule '{rule.condition}' ({shown})"
