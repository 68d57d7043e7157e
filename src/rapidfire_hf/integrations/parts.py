"""The state ``enable_rapidfire`` leaves on a trainer, finding the ``RapidFireOptimizer`` it installed, and
the error it raises for a trainer it cannot change."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rapidfire_hf.optim import RapidFireOptimizer

STATE_ATTR = "_rapidfire"


class RapidFireIntegrationError(RuntimeError):
    """``enable_rapidfire`` was called on a trainer it cannot safely change."""


def find_rapidfire_optimizer(optimizer: Any) -> RapidFireOptimizer | None:
    """The ``RapidFireOptimizer`` inside ``optimizer`` (through accelerate's wrapper), or ``None``."""
    seen = 0
    while (
        optimizer is not None and seen < 4
    ):  # AcceleratedOptimizer -> RapidFireOptimizer, at most a few levels
        if isinstance(optimizer, RapidFireOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


@dataclass
class RapidFireState:
    """What ``enable_rapidfire`` installed on a trainer (stored as ``trainer._rapidfire``).

    Attributes:
        config: the resolved ``RapidFireConfig``.
        installed: human-readable names of what was installed, in order.
        skipped: what was not installed and why.
        parts: the installed objects by part name (``metrics``, ``memory``, ``precision``, ``rollout``).
        pipeline: whether the gradient pipeline should be on (applied to the optimizer once it exists).
    """

    config: Any
    installed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    parts: dict[str, Any] = field(default_factory=dict)
    pipeline: bool = True

    def table(self, trainer_name: str) -> str:
        """What is on, what was skipped and why, and where the telemetry and the process registry are:
        the lines ``enable_rapidfire`` prints once."""
        from rapidfire_hf.utils.start_table import start_table

        return start_table(f"rapidfire on {trainer_name}:", self.installed, self.skipped)


def rapidfire_state(trainer) -> RapidFireState | None:
    """What ``enable_rapidfire`` installed on ``trainer``, or ``None`` when it was not called on it."""
    return getattr(trainer, STATE_ATTR, None)


def installed_parts(trainer) -> dict[str, Any]:
    state = rapidfire_state(trainer)
    return state.parts if state is not None else {}
