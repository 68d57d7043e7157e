"""Lazy access to the other rapidfire parts, each optional, and the state ``enable_rapidfire`` leaves."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

STATE_ATTR = "_rapidfire"


def try_import(module: str) -> ModuleType | None:
    """Import a rapidfire part, or return ``None`` when that part is not in this installation.

    Only the absence of the module itself counts as "not there"; an error raised inside the part (a
    broken import of a third-party library, say) propagates, so it is not silently skipped.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and (module == err.name or module.startswith(err.name + ".")):
            return None
        raise


def optional_attr(module: str, name: str) -> Any:
    """``module.name`` or ``None`` when the part or the name does not exist (yet)."""
    mod = try_import(module)
    return getattr(mod, name, None) if mod is not None else None


def find_rapidfire_optimizer(optimizer: Any) -> Any:
    """The ``RapidFireOptimizer`` inside ``optimizer`` (through accelerate's wrapper), or ``None``."""
    cls = optional_attr("rapidfire_hf.optim", "RapidFireOptimizer")
    if cls is None:
        return None
    seen = 0
    while (
        optimizer is not None and seen < 4
    ):  # AcceleratedOptimizer -> RapidFireOptimizer, at most a few levels
        if isinstance(optimizer, cls):
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


def installed_parts(trainer) -> dict[str, Any]:
    state = getattr(trainer, STATE_ATTR, None)
    return state.parts if state is not None else {}
