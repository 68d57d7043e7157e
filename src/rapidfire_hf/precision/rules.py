"""The fallback rules of ``AdaptivePrecisionPlugin``: which configured rule fires at a step end, and what
it does. :class:`FallbackRules` owns what the rules remember between steps (when each last fired, the
pipeline state the last pipeline rule set); what a rule acts on is a :class:`RuleTarget` (the plugin)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from rapidfire_hf.precision.actions import PrecisionAction, describe_match
from rapidfire_hf.precision.options import logger

PIPELINE_VERBS = ("disable_pipeline", "enable_pipeline")


class RuleTarget(Protocol):
    """What a fired rule acts on."""

    def set_precision(
        self, precision: str, layer: str | None, reason: str, step: int
    ) -> list[PrecisionAction]:
        """Switch the model (``layer=None``) or the matching layers; the switches made."""

    def rule_handler(self, verb: str) -> Callable[[], Any] | None:
        """What runs ``verb`` (``disable_pipeline``, ``enable_pipeline``, ``compact_memory``), or None."""

    def pipeline_state(self) -> bool | None:
        """Whether the optimizer's gradient pipeline is on (None: the optimizer does not say)."""

    def record_action(self, action: PrecisionAction) -> None:
        """Keep and log an action taken."""


class FallbackRules:
    """The state of the configured fallback rules between step ends."""

    def __init__(self):
        self.last_fired: dict[int, int] = {}  # rule index -> step it last fired at
        self.pipeline_enabled: bool | None = None  # what the last pipeline rule set, where nothing else says

    def evaluate(
        self, step: int, metrics: dict[str, float], rules: list, cooldown_steps: int, target: RuleTarget
    ) -> list[PrecisionAction]:
        """Fire the rules that match ``metrics``, in order, each at most once per ``cooldown_steps``.

        Returns:
            The actions taken (a rule that changes nothing is not an action and does not start its cooldown).
        """
        actions: list[PrecisionAction] = []
        for index, rule in enumerate(rules):
            last = self.last_fired.get(index)
            if last is not None and step - last < cooldown_steps:
                continue
            if not rule.matches(metrics):
                continue
            fired = self._apply(rule, step, metrics, target)
            if fired:
                self.last_fired[index] = step
                actions += fired
        return actions

    def _apply(self, rule, step: int, metrics: dict[str, float], target: RuleTarget) -> list[PrecisionAction]:
        layers = rule.matched_layers(metrics)
        reason = describe_match(rule, metrics, layers)
        if rule.verb == "switch_to":
            if rule.scope is not None:
                return target.set_precision(rule.argument, rule.scope, reason, step)
            if rule.layer is not None:
                return [a for name in layers for a in target.set_precision(rule.argument, name, reason, step)]
            return target.set_precision(rule.argument, None, reason, step)
        if rule.verb in PIPELINE_VERBS:
            enable = rule.verb == "enable_pipeline"
            state = target.pipeline_state()
            if (self.pipeline_enabled if state is None else state) is enable:
                return []  # already so: not an action, and no log line every step
            self.pipeline_enabled = enable
        handler = target.rule_handler(rule.verb)
        if handler is None:
            logger.warning("precision: rule '%s' fired but nothing handles %r", rule.condition, rule.verb)
            return []
        handler()
        action = PrecisionAction(step, rule.verb, None, None, reason)
        target.record_action(action)
        return [action]

    def state_dict(self) -> dict[str, Any]:
        return {"rule_last_fired": dict(self.last_fired), "pipeline_enabled": self.pipeline_enabled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_fired = {int(k): v for k, v in state["rule_last_fired"].items()}
        self.pipeline_enabled = state["pipeline_enabled"]
