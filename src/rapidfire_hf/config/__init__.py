"""rapidfire_hf configuration: the ``RapidFireConfig`` dataclass tree, presets, YAML and env loading.

Example:
    >>> from rapidfire_hf.config import load_config
    >>> cfg = load_config("aggressive", env=False)
    >>> cfg.gradient.pipeline_depth, cfg.memory.optimization.value
    (16, 'aggressive')
"""

from rapidfire_hf.config.errors import ConfigError
from rapidfire_hf.config.loader import env_overrides, env_variables, load_config, read_yaml
from rapidfire_hf.config.presets import PRESET_DESCRIPTIONS, PRESETS
from rapidfire_hf.config.rules import LAYER_METRICS, METRICS, FallbackRule
from rapidfire_hf.config.schema import (
    Checkpointing,
    DType,
    GradientConfig,
    LoggingConfig,
    LogLevel,
    MemoryConfig,
    MemoryLevel,
    PrecisionConfig,
    PrecisionMode,
    RapidFireConfig,
    to_plain,
)

__all__ = [
    "ConfigError",
    "DType",
    "FallbackRule",
    "GradientConfig",
    "LAYER_METRICS",
    "LogLevel",
    "LoggingConfig",
    "METRICS",
    "MemoryConfig",
    "Checkpointing",
    "MemoryLevel",
    "PRESETS",
    "PRESET_DESCRIPTIONS",
    "PrecisionConfig",
    "PrecisionMode",
    "RapidFireConfig",
    "env_overrides",
    "env_variables",
    "load_config",
    "read_yaml",
    "to_plain",
]
