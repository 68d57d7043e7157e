"""Adaptive precision: per-layer schedules, per-group loss scaling, fallback rules and FP8.

Example:
    >>> from rapidfire_hf.precision import AdaptivePrecisionPlugin
    >>> plugin = AdaptivePrecisionPlugin.from_config({"precision": {"initial": "fp16"}})
    >>> plugin.attach(accelerator, model, optimizer)   # accelerator.rapidfire_precision is plugin
"""

from rapidfire_hf.precision.actions import PrecisionAction
from rapidfire_hf.precision.fp8 import (
    Float8Linear,
    convert_linears_to_fp8,
    enable_fp8,
    fp8_candidates,
    fp8_support,
    resolve_fp8_backend,
)
from rapidfire_hf.precision.metrics import AsyncMetrics, GradientMonitor, OutputProbe
from rapidfire_hf.precision.plugin import AdaptivePrecisionPlugin, PrecisionMode
from rapidfire_hf.precision.scaler import PerGroupGradScaler
from rapidfire_hf.precision.schedule import (
    LayerPrecision,
    Precision,
    find_layers,
    logprob_path,
    set_layer_precision,
)
from rapidfire_hf.precision.sensitivity import LayerSensitivity, measure_sensitivity, sensitivity_table

__all__ = [
    "AdaptivePrecisionPlugin",
    "AsyncMetrics",
    "Float8Linear",
    "GradientMonitor",
    "LayerPrecision",
    "LayerSensitivity",
    "OutputProbe",
    "PerGroupGradScaler",
    "Precision",
    "PrecisionAction",
    "PrecisionMode",
    "convert_linears_to_fp8",
    "enable_fp8",
    "find_layers",
    "fp8_candidates",
    "fp8_support",
    "logprob_path",
    "measure_sensitivity",
    "resolve_fp8_backend",
    "sensitivity_table",
    "set_layer_precision",
]
