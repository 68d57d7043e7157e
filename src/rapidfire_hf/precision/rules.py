"""Fallback-rule evaluation and plugin state, as mixins of ``AdaptivePrecisionPlugin``."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from rapidfire_hf.precision.actions import PrecisionAction, describe_match
from rapidfire_hf.precision.metrics import overflow_culprit
from rapidfire_hf.precision.options import inner_optimizer, logger
from rapidfire_hf.precision.schedule import Precision
from rapidfire_hf.precision.sensitivity import LayerSensitivity


class RuleEngine:
    """Turns step metrics into actions: the per-layer overflow switch, then the configured rules in order."""

    def _evaluate(self, step: int, metrics: dict[str, float]) -> list[PrecisionAction]:
        actions: list[PrecisionAction] = []
        if self.auto_switch_layers:
            culprit = overflow_culprit(list(self.layers), metrics)
            if culprit is not None:
                actions += self.set_precision(self.sensitive_precision, culprit[0], culprit[1], step)
                # explained by that layer: model-wide rules on it would undo the per-layer schedule
                metrics["nonfinite_grads"] = 0.0
        for index, rule in enumerate(self.fallback):
            last = self._rule_last_fired.get(index)
            if last is not None and step - last < self.rule_cooldown_steps:
                continue
            if not rule.matches(metrics):
                continue
            fired = self._apply_rule(rule, step, metrics)
            if fired:
                self._rule_last_fired[index] = step
                actions += fired
        return actions

    def _apply_rule(self, rule, step: int, metrics: dict[str, float]) -> list[PrecisionAction]:
        layers = rule.matched_layers(metrics)
        reason = describe_match(rule, metrics, layers)
        if rule.verb == "switch_to":
            if rule.scope is not None:
                return self.set_precision(rule.argument, rule.scope, reason, step)
            if rule.layer is not None:
                return [a for name in layers for a in self.set_precision(rule.argument, name, reason, step)]
            return self.set_precision(rule.argument, None, reason, step)
        if rule.verb in ("disable_pipeline", "enable_pipeline"):
            enable = rule.verb == "enable_pipeline"
            state = getattr(inner_optimizer(self.optimizer), "pipeline_enabled", self._pipeline_enabled)
            if state is enable:
                return []  # already so: not an action, and no log line every step
            self._pipeline_enabled = enable
        handler = self.handlers.get(rule.verb) or getattr(inner_optimizer(self.optimizer), rule.verb, None)
        if handler is None:
            logger.warning("precision: rule '%s' fired but nothing handles %r", rule.condition, rule.verb)
            return []
        handler()
        action = PrecisionAction(step, rule.verb, None, None, reason)
        self._record(action)
        return [action]


class PluginState:
    """Statistics and ``state_dict`` of the plugin (plain Python types, so accelerate can checkpoint them)."""

    def stats(self) -> dict[str, Any]:
        """Switch counts, switches per hour, actions by kind, layers above the base precision, loss scales."""
        hours = (self._elapsed_before + time.time() - self._t0) / 3600.0
        switches = [a for a in self.history if a.verb == "switch_to"]
        return {
            "mode": self.mode.value,
            "precision": self.current.value,
            "switches": len(switches),
            "switches_per_hour": len(switches) / max(hours, 1e-9),
            "actions": dict(Counter(a.verb for a in self.history)),
            "layer_precision": {n: p.value for n, p in self.overrides.items()},
            "loss_scales": self.scaler.get_scales() if self.scaler is not None else None,
            "overflow_steps_per_group": list(self.scaler.overflow_counts)
            if self.scaler is not None
            else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """Schedule, sensitivity table, switch history, rule cooldowns and loss scales (plain Python types)."""
        return {
            "version": 1,
            "current": self.current.value,
            "overrides": {n: p.value for n, p in self.overrides.items()},
            "sensitivity": [vars(r).copy() for r in self.sensitivity.values()],
            "calibrated_batches": self.calibrated_batches,
            "history": [a.to_dict() for a in self.history],
            "rule_last_fired": dict(self._rule_last_fired),
            "pipeline_enabled": self._pipeline_enabled,
            "elapsed_s": self._elapsed_before + time.time() - self._t0,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` and re-apply the schedule to the attached model."""
        self.current = Precision(state["current"])
        self.overrides = {n: Precision(p) for n, p in state["overrides"].items()}
        self.sensitivity = {r["name"]: LayerSensitivity(**r) for r in state["sensitivity"]}
        self.calibrated_batches = state["calibrated_batches"]
        self.history = [PrecisionAction(**a) for a in state["history"]]
        self._rule_last_fired = {int(k): v for k, v in state["rule_last_fired"].items()}
        self._pipeline_enabled = state["pipeline_enabled"]
        self._elapsed_before, self._t0 = state["elapsed_s"], time.time()
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self._apply_schedule()
