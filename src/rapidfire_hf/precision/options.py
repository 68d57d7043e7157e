"""Options of ``AdaptivePrecisionPlugin``: defaults, ``RAPIDFIRE_PRECISION_*`` parsing, small helpers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import field
from enum import Enum
from typing import Any

import torch
from torch import nn

from rapidfire_hf.precision.schedule import Precision

logger = logging.getLogger("rapidfire_hf.precision")

ENV_PREFIX = "RAPIDFIRE_PRECISION_"


class PrecisionMode(str, Enum):
    """``static``: ``initial`` everywhere; ``adaptive``: sensitivity pass, anomaly switches and rules."""

    STATIC = "static"
    ADAPTIVE = "adaptive"


def help_field(text: str, default: Any = None, **kw):
    return field(default=default, metadata={"help": text}, **kw)


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(f"expected a boolean (true/false/1/0), got {text!r}")
    return value in ("1", "true", "yes")


def _parse_rules(text: str) -> list:
    # the config package owns the rule syntax, including the env spelling "cond -> action; ..."
    from rapidfire_hf.config import PrecisionConfig

    check = PrecisionConfig.field_check("fallback")
    return check("precision.fallback", check.parse_env(text))


# field -> (default, parser of its RAPIDFIRE_PRECISION_<FIELD> value)
DEFAULTS: dict[str, tuple[Any, Callable[[str], Any]]] = {
    "mode": (PrecisionMode.ADAPTIVE, PrecisionMode),
    "initial": (Precision.BF16, Precision),
    "fallback": (None, _parse_rules),  # None: the config package's default rules
    "sensitive_precision": (None, Precision),  # None: fp32
    "sensitivity_threshold": (0.02, float),
    "sensitivity_batches": (1, int),
    "auto_switch_layers": (True, _parse_bool),
    "rule_cooldown_steps": (10, int),
    "init_scale": (2.0**16, float),
    "growth_interval": (2000, int),
}


def as_rule(rule):
    from rapidfire_hf.config import FallbackRule

    return rule if isinstance(rule, FallbackRule) else FallbackRule.from_dict(rule)


def inner_optimizer(optimizer):
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` wrappers (or None)."""
    while optimizer is not None and hasattr(optimizer, "optimizer") and hasattr(optimizer, "scaler"):
        optimizer = optimizer.optimizer
    return optimizer


def cast_optimizer_state(optimizer, params: list[nn.Parameter]) -> None:
    """Give the moments of parameters converted to fp32 the same dtype (fused/foreach kernels require it)."""
    if optimizer is None:
        return
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == p.shape:
                optimizer.state[p][key] = value.to(p.dtype)
