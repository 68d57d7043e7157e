"""Fallback rules: ``{condition: "grad_norm > 1.0", action: "switch_to fp32"}``.

A rule is parsed when it is built, so a typo fails when the config is loaded, not hours into a run.

Conditions have the form ``<metric> <op> <number>``:

* ``op`` is one of ``>``, ``>=``, ``<``, ``<=``, ``==``, ``!=``; the number may be signed and use an
  exponent (``1e-3``).
* ``metric`` is a run-wide metric from :data:`METRICS` (``grad_norm``, ``loss``, ``throughput``, ...),
  or a layer metric written ``layer:<name>.<metric>`` with ``<metric>`` from :data:`LAYER_METRICS`, e.g.
  ``layer:lm_head.grad_norm > 10``. ``<name>`` is a module name as in ``model.named_modules()`` and may
  contain dots and the glob characters ``*`` and ``?`` (``layer:model.layers.*.mlp.grad_norm > 10``).

Actions:

* ``switch_to <dtype>`` with dtype ``fp32``, ``bf16`` or ``fp16``, optionally followed by
  ``layer:<name>`` to switch one layer (``switch_to fp32 layer:lm_head``). Without an explicit layer, a
  rule whose condition names a layer switches that layer (the layers that matched, for a glob); a rule on
  a run-wide metric switches the whole model.
* ``disable_pipeline`` / ``enable_pipeline``: turn the gradient pipeline off or on.
* ``compact_memory``: release cached allocator blocks now.

Metric values are looked up by :attr:`FallbackRule.key`: the metric name for run-wide metrics and
``"layer:<name>.<metric>"`` for layer metrics. A metric that is missing from the dict never matches.
Comparisons follow IEEE rules: a NaN value matches only ``!=``; use ``nonfinite_grads > 0`` to catch NaN
or infinite gradients.
"""

from __future__ import annotations

import fnmatch
import math
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rapidfire_hf.config.errors import ConfigError, invalid_value, unknown_key

# run-wide metrics a condition may test, and what each means
METRICS: dict[str, str] = {
    "grad_norm": "global gradient L2 norm before clipping",
    "loss": "training loss of the last optimizer step",
    "throughput": "tokens per second over the last logging window",
    "nonfinite_grads": "number of parameters whose gradient has a NaN or Inf",
    "loss_scale": "current dynamic loss scale (fp16)",
    "approx_kl": "PPO approximate KL between old and new policy",
    "kl": "KL divergence to the reference policy",
    "entropy": "mean token entropy of the policy",
    "fragmentation": "allocator fragmentation, 1 - allocated/reserved",
    "memory_allocated_gb": "GPU memory held by tensors, GiB",
    "memory_reserved_gb": "GPU memory held by the caching allocator, GiB",
    "layer_grad_anomaly": "largest per-layer gradient-norm z-score of the step",
    "step": "optimizer step count",
}

# per-layer metrics usable as layer:<name>.<metric>
LAYER_METRICS: dict[str, str] = {
    "grad_norm": "gradient L2 norm of the layer's parameters",
    "grad_anomaly": "z-score of the layer's gradient norm against its running history",
    "nonfinite_grads": "number of the layer's parameters with a NaN or Inf gradient",
    "precision_error": "relative error of the layer's low-precision output against fp32",
}

OPERATORS = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}

DTYPES = ("fp32", "bf16", "fp16")
VERBS = ("switch_to", "disable_pipeline", "enable_pipeline", "compact_memory")

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_CONDITION = re.compile(
    r"^\s*(?:layer:(?P<layer>[^\s<>=!]+)\.(?P<layer_metric>\w+)|(?P<metric>\w+))"
    r"\s*(?P<op>>=|<=|==|!=|>|<)\s*(?P<number>" + _NUMBER + r")\s*$"
)
_LAYER_SCOPE = re.compile(r"^layer:(?P<layer>\S+)$")

CONDITION_ALLOWED = (
    "'<metric> <op> <number>' with op one of "
    + ", ".join(OPERATORS)
    + "; metric one of "
    + ", ".join(METRICS)
    + ", or 'layer:<name>.<m>' with m one of "
    + ", ".join(LAYER_METRICS)
)
ACTION_ALLOWED = (
    "'switch_to <dtype> [layer:<name>]' with dtype one of "
    + ", ".join(DTYPES)
    + ", or one of 'disable_pipeline', 'enable_pipeline', 'compact_memory'"
)


@dataclass
class FallbackRule:
    """One ``condition -> action`` rule, parsed and checked on construction.

    Args:
        condition: ``"<metric> <op> <number>"``, e.g. ``"grad_norm > 1.0"`` or ``"layer:lm_head.grad_norm > 10"``.
        action: ``"switch_to fp32"``, ``"switch_to fp32 layer:lm_head"``, ``"disable_pipeline"``,
            ``"enable_pipeline"`` or ``"compact_memory"``.

    Attributes:
        metric: Metric name (``"grad_norm"``); for a layer condition, the layer metric.
        op: Comparison operator (``">"``).
        threshold: The number compared against.
        layer: Layer name or glob of a layer condition, else None.
        verb: One of :data:`VERBS`.
        argument: The dtype of ``switch_to``, else None.
        scope: The layer named in the action (``layer:<name>``), else None.

    Raises:
        ConfigError: naming ``condition`` or ``action``, the value, and the allowed syntax.

    Example:
        >>> rule = FallbackRule(condition="grad_norm > 1.0", action="switch_to fp32")
        >>> rule.matches({"grad_norm": 2.5}), rule.matches({"loss": 3.0})
        (True, False)
    """

    condition: str
    action: str
    metric: str = field(init=False, compare=False)
    op: str = field(init=False, compare=False)
    threshold: float = field(init=False, compare=False)
    layer: str | None = field(init=False, compare=False, default=None)
    verb: str = field(init=False, compare=False)
    argument: str | None = field(init=False, compare=False, default=None)
    scope: str | None = field(init=False, compare=False, default=None)

    def __post_init__(self) -> None:
        self._parse_condition()
        self._parse_action()

    def _parse_condition(self) -> None:
        text = self.condition
        match = _CONDITION.match(text) if isinstance(text, str) else None
        if match is None:
            raise invalid_value("condition", text, CONDITION_ALLOWED, "cannot parse condition")
        self.layer = match["layer"]
        self.metric = match["layer_metric"] or match["metric"]
        known = LAYER_METRICS if self.layer else METRICS
        if self.metric not in known:
            raise invalid_value("condition", text, CONDITION_ALLOWED, f"unknown metric {self.metric!r}")
        self.op = match["op"]
        self.threshold = float(match["number"])
        self.condition = " ".join([self.key, self.op, match["number"]])

    def _parse_action(self) -> None:
        text = self.action
        words = text.split() if isinstance(text, str) else []
        if not words or words[0] not in VERBS:
            raise invalid_value("action", text, ACTION_ALLOWED, "cannot parse action")
        self.verb = words[0]
        rest = words[1:]
        if self.verb == "switch_to":
            if not rest or rest[0] not in DTYPES:
                raise invalid_value("action", text, ACTION_ALLOWED, "switch_to needs a dtype")
            self.argument, rest = rest[0], rest[1:]
            if rest and len(rest) == 1 and _LAYER_SCOPE.match(rest[0]):
                self.scope, rest = _LAYER_SCOPE.match(rest[0])["layer"], []
        if rest:
            raise invalid_value("action", text, ACTION_ALLOWED, f"unexpected {' '.join(rest)!r}")
        self.action = " ".join(words)

    @property
    def key(self) -> str:
        """The metrics-dict key this rule reads: ``"grad_norm"`` or ``"layer:lm_head.grad_norm"``."""
        return f"layer:{self.layer}.{self.metric}" if self.layer else self.metric

    @property
    def target_layer(self) -> str | None:
        """Layer the action applies to: the action's ``layer:`` scope, else the condition's layer, else None."""
        return self.scope or self.layer

    def _holds(self, value: Any) -> bool:
        try:
            value = float(value)
        except (TypeError, ValueError):
            return False
        if math.isnan(value):
            return self.op == "!="
        return OPERATORS[self.op](value, self.threshold)

    def matched_layers(self, metrics: Mapping[str, float]) -> list[str]:
        """Names of the layers whose metric satisfies a layer condition (empty for run-wide rules)."""
        if self.layer is None:
            return []
        suffix = f".{self.metric}"
        found = []
        for key, value in metrics.items():
            if not (key.startswith("layer:") and key.endswith(suffix)):
                continue
            name = key[len("layer:") : -len(suffix)]
            if fnmatch.fnmatchcase(name, self.layer) and self._holds(value):
                found.append(name)
        return found

    def matches(self, metrics: Mapping[str, float]) -> bool:
        """Whether the condition holds for ``metrics``; a missing metric never matches.

        Args:
            metrics: Metric name (or ``"layer:<name>.<metric>"``) to value.
        """
        if self.layer is not None:
            return bool(self.matched_layers(metrics))
        return self.metric in metrics and self._holds(metrics[self.metric])

    def to_dict(self) -> dict[str, str]:
        """The rule as ``{"condition": ..., "action": ...}`` (normalised spacing)."""
        return {"condition": self.condition, "action": self.action}

    @classmethod
    def from_dict(cls, data: Any) -> FallbackRule:
        """Build a rule from ``{"condition": ..., "action": ...}``; the error names the missing/unknown key."""
        if isinstance(data, FallbackRule):
            return cls(data.condition, data.action)
        if not isinstance(data, Mapping):
            raise invalid_value(
                "", data, "a mapping with keys 'condition' and 'action'", "rule is not a mapping"
            )
        for key in data:
            if key not in ("condition", "action"):
                raise unknown_key(key, ("condition", "action"))
        for key in ("condition", "action"):
            if key not in data:
                raise ConfigError(
                    "missing key", key=key, allowed="a mapping with keys 'condition' and 'action'"
                )
        return cls(condition=data["condition"], action=data["action"])
