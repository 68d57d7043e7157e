"""Concurrent PPO sweeps: many LoRA trials trained at once on one shared frozen base model.

``PPOSweep`` keeps one copy of the base weights; each trial owns a LoRA adapter, a value head, an
optimizer, a schedule, a prompt order and random streams, and a trial's results equal that trial trained
alone. Trials can be stopped, resumed and cloned with overrides at update boundaries, from Python, a
callback or another shell (``rapidfire sweep ctl``).

Public names are imported lazily: ``rapidfire sweep ctl`` imports :mod:`rapidfire_hf.sweep.control`
without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> module that defines it
_EXPORTS = {
    "PER_TRIAL_FIELDS": "rapidfire_hf.sweep.fields",
    "AdapterBank": "rapidfire_hf.sweep.lora",
    "EarlyStopping": "rapidfire_hf.sweep.control",
    "SuccessiveHalving": "rapidfire_hf.sweep.control",
    "MultiLoRALinear": "rapidfire_hf.sweep.lora",
    "PPOSweep": "rapidfire_hf.sweep.sweep",
    "SweepError": "rapidfire_hf.sweep.sweep",
    "SweepResult": "rapidfire_hf.sweep.sweep",
    "append_command": "rapidfire_hf.sweep.control",
    "trial_args": "rapidfire_hf.sweep.trial",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rapidfire_hf.sweep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from rapidfire_hf.sweep.control import EarlyStopping, SuccessiveHalving, append_command  # noqa: F401
    from rapidfire_hf.sweep.fields import PER_TRIAL_FIELDS  # noqa: F401
    from rapidfire_hf.sweep.lora import AdapterBank, MultiLoRALinear  # noqa: F401
    from rapidfire_hf.sweep.sweep import PPOSweep, SweepError, SweepResult  # noqa: F401
    from rapidfire_hf.sweep.trial import trial_args  # noqa: F401
