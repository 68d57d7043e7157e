"""rapidfire_hf: faster, lighter RLHF and fine-tuning on Hugging Face TRL.

Public names are imported lazily so that ``import rapidfire_hf`` stays cheap and the CLI starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "RapidFireConfig": "rapidfire_hf.config",
    "load_config": "rapidfire_hf.config",
    "ConfigError": "rapidfire_hf.config",
    "RapidFireOptimizer": "rapidfire_hf.optim",
    "PPOConfig": "rapidfire_hf.ppo",
    "PPOTrainer": "rapidfire_hf.ppo",
    "PPOSweep": "rapidfire_hf.sweep",
    "MemoryCompactionCallback": "rapidfire_hf.memory",
    "AdaptivePrecisionPlugin": "rapidfire_hf.precision",
    "enable_rapidfire": "rapidfire_hf.integrations",
    "AutoModelForCausalLMWithValueHead": "rapidfire_hf.models",
    "AutoModelForSeq2SeqLMWithValueHead": "rapidfire_hf.models",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rapidfire_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from rapidfire_hf.config import ConfigError, RapidFireConfig, load_config  # noqa: F401
    from rapidfire_hf.integrations import enable_rapidfire  # noqa: F401
    from rapidfire_hf.memory import MemoryCompactionCallback  # noqa: F401
    from rapidfire_hf.models import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead  # noqa: F401
    from rapidfire_hf.optim import RapidFireOptimizer  # noqa: F401
    from rapidfire_hf.ppo import PPOConfig, PPOTrainer  # noqa: F401
    from rapidfire_hf.precision import AdaptivePrecisionPlugin  # noqa: F401
    from rapidfire_hf.sweep import PPOSweep  # noqa: F401
