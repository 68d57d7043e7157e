"""``AdaptivePrecisionPlugin``: per-layer precision, per-group loss scaling and fallback rules.

Attached to an ``accelerate.Accelerator`` the way accelerate's own plugins are, and driven by the trainer
at three points of each step (see :class:`AdaptivePrecisionPlugin`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from rapidfire_hf.optim.step_health import rapidfire_optimizer
from rapidfire_hf.precision.actions import PrecisionAction
from rapidfire_hf.precision.metrics import AsyncMetrics, GradientMonitor, OutputProbe, overflow_culprit
from rapidfire_hf.precision.options import (
    DEFAULTS,
    ENV_PREFIX,
    PrecisionMode,
    as_rule,
    cast_optimizer_state,
    help_field,
    inner_optimizer,
    logger,
)
from rapidfire_hf.precision.rules import FallbackRules
from rapidfire_hf.precision.scaler import PerGroupGradScaler
from rapidfire_hf.precision.schedule import (
    Precision,
    check_untied_low_precision,
    find_layers,
    logprob_path,
    match_modules,
    set_layer_precision,
)
from rapidfire_hf.precision.sensitivity import (
    LayerSensitivity,
    measure_sensitivity,
    render_table,
    sensitivity_table,
)


@dataclass
class AdaptivePrecisionPlugin:
    """Adaptive mixed precision for an ``accelerate.Accelerator``.

    Every field left as None takes ``RAPIDFIRE_PRECISION_<FIELD>`` from the environment, else its default
    (accelerate's convention: an explicit argument beats the environment).

    Per step, the trainer calls (fp16 or not, with or without accelerate):

    1. once, on the first batch(es): ``plugin.calibrate(batch)``: the sensitivity pass; layers whose
       low-precision error passes ``sensitivity_threshold`` go to ``sensitive_precision``.
    2. after backward, before the optimizer step: ``plugin.observe_gradients()`` (device-side per-layer
       gradient statistics, no sync). ``plugin.backward(loss)`` / ``plugin.step()`` do this and the
       per-group loss scaling for a plain PyTorch loop.
    3. after the optimizer step: ``actions = plugin.on_step_end(step, {"loss": loss, "grad_norm": gn})``,
       where values may be floats or device tensors (read asynchronously; rules see them a step or so late).

    Example:
        >>> plugin = AdaptivePrecisionPlugin.from_config("config/advanced.yaml")
        >>> plugin.attach(accelerator, model, optimizer, compact_memory=torch.cuda.empty_cache)
        >>> accelerator.rapidfire_precision is plugin
        True
    """

    mode: PrecisionMode | str | None = help_field(
        "'static' keeps `initial` everywhere; 'adaptive' measures and switches."
    )
    initial: Precision | str | None = help_field("Precision the run starts in: 'bf16', 'fp16' or 'fp32'.")
    fallback: list | None = help_field(
        "Fallback rules (FallbackRule or {condition, action}) checked at step ends."
    )
    sensitive_precision: Precision | str | None = help_field(
        "Precision of layers found sensitive: 'fp32', or 'bf16' when `initial` is 'fp16'."
    )
    sensitivity_threshold: float | None = help_field(
        "Relative error (output or gradient) above which a layer is sensitive."
    )
    sensitivity_batches: int | None = help_field(
        "Batches the sensitivity pass measures (the maximum error is kept)."
    )
    auto_switch_layers: bool | None = help_field(
        "In adaptive mode, switch the layer where a non-finite value started to `sensitive_precision`."
    )
    rule_cooldown_steps: int | None = help_field("Steps after a rule fires before it may fire again.")
    init_scale: float | None = help_field("Initial per-group loss scale (fp16).")
    growth_interval: int | None = help_field("Finite steps of a group before its loss scale doubles (fp16).")

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.startswith("_") or getattr(self, f.name) is not None:
                continue
            default, parse = DEFAULTS[f.name]
            raw = os.environ.get(ENV_PREFIX + f.name.upper())
            try:
                setattr(self, f.name, parse(raw) if raw is not None else default)
            except (ValueError, TypeError) as err:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r} is invalid: {err}") from None
        self.mode, self.initial = PrecisionMode(self.mode), Precision(self.initial)
        self.sensitive_precision = Precision(self.sensitive_precision or Precision.FP32)
        if self.fallback is None:
            from rapidfire_hf.config import PrecisionConfig

            self.fallback = list(PrecisionConfig().fallback)
        self.fallback = [as_rule(r) for r in self.fallback]
        if self.initial is not Precision.FP32 and self.sensitive_precision.rank <= self.initial.rank:
            raise ValueError(
                f"sensitive_precision={self.sensitive_precision.value!r} is not higher than "
                f"initial={self.initial.value!r}; allowed: 'fp32', or 'bf16' under 'fp16'"
            )
        for name in ("sensitivity_batches", "rule_cooldown_steps", "growth_interval"):
            if getattr(self, name) < (0 if name == "rule_cooldown_steps" else 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if not self.sensitivity_threshold > 0:
            raise ValueError(f"sensitivity_threshold must be > 0, got {self.sensitivity_threshold}")
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self.model: nn.Module | None = None
        self._accelerator = None
        self.optimizer = None
        self.scaler: PerGroupGradScaler | None = None
        self.layers: dict[str, nn.Module] = {}
        self.current: Precision = self.initial
        self.overrides: dict[str, Precision] = {}
        self.sensitivity: dict[str, LayerSensitivity] = {}
        self.calibrated_batches = 0
        self.history: list[PrecisionAction] = []
        self.handlers: dict[str, Callable[[], Any]] = {}
        self._rules = FallbackRules()  # when each fallback rule last fired, the pipeline state they set
        self._queue = AsyncMetrics()
        self._monitor: GradientMonitor | None = None
        self._probe: OutputProbe | None = None
        self._grad_stats: dict[str, torch.Tensor] = {}
        self._elapsed_before = 0.0
        self._t0 = time.time()
        self.last_metrics: dict[str, float] = {}

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any = None, **overrides) -> AdaptivePrecisionPlugin:
        """Build from the ``precision:`` section of a rapidfire config.

        Args:
            config: A ``RapidFireConfig``, its ``PrecisionConfig``, or anything ``load_config`` accepts (a
                preset name, a YAML path, a short- or full-form mapping, None for the defaults).
            **overrides: Plugin fields that the config does not hold (``sensitivity_threshold``, ...).

        Raises:
            ConfigError: for an invalid config, including unparsable fallback rules.
        """
        from rapidfire_hf.config import PrecisionConfig, load_config

        section = config if isinstance(config, PrecisionConfig) else getattr(config, "precision", None)
        if not isinstance(section, PrecisionConfig):
            section = load_config(config).precision
        return cls(
            mode=overrides.pop("mode", section.mode.value),
            initial=overrides.pop("initial", section.initial.value),
            fallback=overrides.pop("fallback", list(section.fallback)),
            **overrides,
        )

    def attach(
        self,
        accelerator=None,
        model: nn.Module | None = None,
        optimizer=None,
        *,
        compact_memory: Callable[[], Any] | None = None,
        handlers: dict[str, Callable[[], Any]] | None = None,
    ) -> AdaptivePrecisionPlugin:
        """Bind the plugin to a model, its optimizer and (optionally) an Accelerator.

        With an accelerator: sets ``accelerator.rapidfire_precision = self``, registers the plugin for
        ``accelerator.save_state``/``load_state``, and, when the accelerator runs fp16 with a GradScaler and
        ``initial`` is fp16, replaces that scaler (``accelerator.scaler`` and each prepared optimizer's) by
        the plugin's :class:`PerGroupGradScaler`.

        Args:
            accelerator: An ``accelerate.Accelerator`` or None for a plain PyTorch loop.
            model: The model (default: the accelerator's first prepared model), unwrapped from DDP.
            optimizer: Its optimizer, plain or ``AcceleratedOptimizer`` (default: the accelerator's first).
            compact_memory: What the ``compact_memory`` action calls (e.g. the memory part's compaction).
            handlers: Callables for ``disable_pipeline`` / ``enable_pipeline`` / ``compact_memory`` that
                take precedence over the optimizer's methods of the same name.

        Returns:
            self, for chaining.
        """
        if accelerator is not None:
            model = model if model is not None else (accelerator._models or [None])[0]
            optimizer = optimizer if optimizer is not None else (accelerator._optimizers or [None])[0]
            model = accelerator.unwrap_model(model) if model is not None else None
        if model is None:
            raise ValueError("attach() needs a model (pass it, or prepare it with the accelerator first)")
        self.model, self.optimizer = model, optimizer
        self.handlers.update(handlers or {})
        if compact_memory is not None:
            self.handlers["compact_memory"] = compact_memory
        self.layers = find_layers(model)
        self._monitor = GradientMonitor(self.layers)
        if self.mode is PrecisionMode.ADAPTIVE and self.auto_switch_layers:
            self._probe = OutputProbe(self.layers)
        inner = inner_optimizer(optimizer)
        if self.initial is Precision.FP16 and inner is not None:
            device = next(model.parameters()).device
            self.scaler = PerGroupGradScaler(
                inner, device=device, init_scale=self.init_scale, growth_interval=self.growth_interval
            )
        if accelerator is not None:
            self._bind_accelerator(accelerator)
        self._apply_schedule()
        return self

    def _bind_accelerator(self, accelerator) -> None:
        self._accelerator = accelerator
        accelerator.rapidfire_precision = self
        accelerator.register_for_checkpointing(self)
        amp = {"fp16": Precision.FP16, "bf16": Precision.BF16, "no": Precision.FP32}.get(
            str(accelerator.mixed_precision)
        )
        if amp is not None and amp is not self.initial:
            logger.warning(
                "Accelerator mixed_precision=%r but the precision plugin starts in %r: wrap forward in "
                "plugin.autocast() or use Accelerator(mixed_precision=%r).",
                accelerator.mixed_precision,
                self.initial.value,
                {"fp32": "no"}.get(self.initial.value, self.initial.value),
            )
        if self.scaler is not None and getattr(accelerator, "scaler", None) is not None:
            accelerator.scaler = self.scaler
            for opt in accelerator._optimizers:
                if getattr(opt, "scaler", None) is not None:
                    opt.scaler = self.scaler

    # -- precision control ---------------------------------------------------------------------------------
    def autocast(self):
        """Context manager for the forward pass in the run's base precision (``initial``)."""
        if self.initial is Precision.FP32:
            return contextlib.nullcontext()
        device_type = next(self.model.parameters()).device.type if self.model is not None else "cuda"
        return torch.autocast(device_type, dtype=self.initial.dtype)

    def precision_of(self, layer: str) -> Precision:
        """The precision a layer (or any module name with an override) computes in now."""
        return self.overrides.get(layer, self.current)

    def set_precision(
        self, precision: Precision | str, layer: str | None = None, reason: str = "", step: int = -1
    ):
        """Switch the whole model (``layer=None``) or the layers matching ``layer`` (name or glob).

        Returns:
            The :class:`PrecisionAction` records of the switches made (empty when nothing changed).
        """
        precision = Precision(precision)
        if layer is None:
            if precision is self.current:
                return []
            self.current = precision
            # overrides that now equal the model precision carry no information any more
            self.overrides = {k: v for k, v in self.overrides.items() if v is not precision}
            targets = [None]
        else:
            names = [layer] if layer in self.layers else list(match_modules(self.model, layer))
            if not names:
                logger.warning("precision: no module matches %r; nothing switched (%s)", layer, reason)
            targets = [n for n in names if self.precision_of(n) is not precision]
            self.overrides.update({n: precision for n in targets})
        self._apply_schedule()
        made = [PrecisionAction(step, "switch_to", precision.value, t, reason) for t in targets]
        for action in made:
            self.record_action(action)
        return made

    def set_logprob_path(
        self, precision: Precision | str | None = None, reason: str = "log-prob path", step: int = 0
    ):
        """Run the log-prob path (final norm + output head of each causal LM in the model) in ``precision``.

        For RL losses built on ratios of log-probs from two forwards (PPO/GRPO: rollout vs training), where
        bf16 logits make the ratio differ from 1 before any update. The outputs stay in ``precision``
        (fp32 logits). See :func:`~rapidfire_hf.precision.schedule.logprob_path`.

        Args:
            precision: Default: ``sensitive_precision`` (fp32).
            reason: Recorded with the switches.
            step: Recorded with the switches.

        Returns:
            The :class:`PrecisionAction` records of the switches made.

        Raises:
            ValueError: a head shares its weight with another module (``tie_word_embeddings``) and that
                weight is stored in fp16/bf16: running the head in fp32 converts the weight, and with it
                the input embedding, whose fp32 output then meets bf16 weights in the first layer wherever
                no autocast is active (the rollout engine). Keep fp32 master weights or untie the head.
        """
        if self.model is None:
            raise ValueError("set_logprob_path() needs an attached model: call attach() first")
        precision = Precision(precision or self.sensitive_precision)
        path = logprob_path(self.model)
        if precision is Precision.FP32:
            check_untied_low_precision(self.model, path)
        made = []
        for name in path:
            made += self.set_precision(precision, name, reason, step)
        return made

    def _apply_schedule(self) -> None:
        if self.model is None:
            return
        modules = dict(self.model.named_modules())
        wanted = {name: self.current for name in self.layers}
        wanted.update(self.overrides)
        # The final norm and output head of each causal LM in the model (also one wrapped, as PPO's
        # policy+value module wraps the policy) keep their higher-precision output: fp32 logits for
        # log-probs are the point of running them in fp32, and the fp32 norm output feeds the head.
        keep_output = {id(m) for m in logprob_path(self.model).values()}
        for name, precision in wanted.items():
            module = self.layers.get(name, modules.get(name))
            if module is None:
                continue
            target = None if precision is self.initial else precision  # the ambient autocast covers initial
            changed = set_layer_precision(module, target, cast_back=id(module) not in keep_output)
            cast_optimizer_state(inner_optimizer(self.optimizer), changed)

    # -- what fallback rules act on (rules.RuleTarget) ------------------------------------------------------
    def record_action(self, action: PrecisionAction) -> None:
        """Keep ``action`` in :attr:`history` and log it."""
        self.history.append(action)
        logger.warning("precision: %s", action)

    def rule_handler(self, verb: str) -> Callable[[], Any] | None:
        """The handler given for ``verb``, else the RapidFireOptimizer's own pipeline switch, else None."""
        handler = self.handlers.get(verb)
        rapidfire = rapidfire_optimizer(self.optimizer)
        if handler is None and rapidfire is not None:
            handler = {
                "disable_pipeline": rapidfire.disable_pipeline,
                "enable_pipeline": rapidfire.enable_pipeline,
            }.get(verb)
        return handler

    def pipeline_state(self) -> bool | None:
        """Whether the RapidFireOptimizer's gradient pipeline is on (None for another optimizer)."""
        rapidfire = rapidfire_optimizer(self.optimizer)
        return rapidfire.pipeline_enabled if rapidfire is not None else None

    def _evaluate(self, step: int, metrics: dict[str, float]) -> list[PrecisionAction]:
        """The per-layer overflow switch, then the configured rules in order."""
        actions: list[PrecisionAction] = []
        if self.auto_switch_layers:
            culprit = overflow_culprit(list(self.layers), metrics)
            if culprit is not None:
                actions += self.set_precision(self.sensitive_precision, culprit[0], culprit[1], step)
                # explained by that layer: model-wide rules on it would undo the per-layer schedule
                metrics["nonfinite_grads"] = 0.0
        return actions + self._rules.evaluate(step, metrics, self.fallback, self.rule_cooldown_steps, self)

    # -- statistics and checkpoints ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Switch counts, switches per hour, actions by kind, layers above the base precision, loss scales."""
        hours = (self._elapsed_before + time.time() - self._t0) / 3600.0
        switches = [a for a in self.history if a.verb == "switch_to"]
        scaler = self.scaler
        return {
            "mode": self.mode.value,
            "precision": self.current.value,
            "switches": len(switches),
            "switches_per_hour": len(switches) / max(hours, 1e-9),
            "actions": dict(Counter(a.verb for a in self.history)),
            "layer_precision": {n: p.value for n, p in self.overrides.items()},
            "loss_scales": scaler.get_scales() if scaler is not None else None,
            "overflow_steps_per_group": list(scaler.overflow_counts) if scaler is not None else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """Schedule, sensitivity table, switch history, rule cooldowns and loss scales (plain Python types,
        so accelerate can checkpoint them)."""
        return {
            "version": 1,
            "current": self.current.value,
            "overrides": {n: p.value for n, p in self.overrides.items()},
            "sensitivity": [vars(r).copy() for r in self.sensitivity.values()],
            "calibrated_batches": self.calibrated_batches,
            "history": [a.to_dict() for a in self.history],
            **self._rules.state_dict(),
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
        self._rules.load_state_dict(state)
        self._elapsed_before, self._t0 = state["elapsed_s"], time.time()
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self._apply_schedule()

    # -- calibration ---------------------------------------------------------------------------------------
    calibration_skipped = None  # why the sensitivity pass will not run, once known (not a dataclass field)

    def calibrate(self, batch, loss_fn=None) -> dict[str, str] | None:
        """Run the sensitivity pass on ``batch`` (first ``sensitivity_batches`` calls; later calls are no-ops).

        Args:
            batch: Keyword arguments of the model's forward.
            loss_fn: ``loss_fn(model, batch) -> loss``; default: causal-LM loss on ``input_ids``.

        Returns:
            ``{layer: precision}`` once the pass is complete, else None.
        """
        if self.mode is PrecisionMode.STATIC or self.initial is Precision.FP32 or self.calibration_done:
            return None
        if self.calibration_skipped is not None:
            return None
        sharded = sharded_parameters_reason(self.model)
        if sharded is not None:
            # a layer run on its own cannot gather sharded weights (FSDP2 DTensors, ZeRO-3 partitions):
            # seen on 2x H200 as "aten.mul.Tensor got mixed torch.Tensor and DTensor"
            self.calibration_skipped = sharded
            logger.info(
                "rapidfire: no precision sensitivity pass (%s); the schedule stays as configured", sharded
            )
            return None
        for module in self.layers.values():  # the fp32 reference run must not pass through wrappers
            set_layer_precision(module, None, cast_back=False)
        try:
            rows = measure_sensitivity(self.model, batch, self.layers, self.initial, loss_fn)
        finally:
            self._apply_schedule()
        for row in rows:
            old = self.sensitivity.get(row.name)
            if old is None or row.error > old.error:
                self.sensitivity[row.name] = row
        self.calibrated_batches += 1
        if not self.calibration_done:
            return None
        for row in self.sensitivity.values():
            if row.error > self.sensitivity_threshold:
                reason = (
                    f"sensitivity {row.error:.2e} > {self.sensitivity_threshold:g} in {self.initial.value}"
                )
                self.set_precision(self.sensitive_precision, row.name, reason, step=0)
            row.precision = self.precision_of(row.name).value
        logger.info("precision schedule:\n%s", render_table(self.table()))
        return {n: self.precision_of(n).value for n in self.layers}

    def unprobed(self) -> contextlib.AbstractContextManager:
        """Forwards without gradients that train nothing (a PPO rollout's generation): the output probe's
        layer hooks are off inside, since they record only under gradients; nothing changes without a
        probe (``precision.mode`` static, or ``auto_switch_layers`` off)."""
        return self._probe.paused() if self._probe is not None else contextlib.nullcontext()

    @property
    def calibration_done(self) -> bool:
        return self.calibrated_batches >= self.sensitivity_batches

    def table(self):
        """The sensitivity table as a ``rich.table.Table``."""
        return sensitivity_table(list(self.sensitivity.values()), self.sensitivity_threshold)

    # -- per step ------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, loss-scaled when the plugin runs fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward(**kwargs)

    def observe_gradients(self) -> None:
        """Queue per-layer gradient statistics (device tensors; call after backward, before the step)."""
        if self._monitor is None:
            return
        inv = 1.0
        if self.scaler is not None and self.scaler.found_inf_per_group() is None:
            inv = self.scaler.backward_scale().double().reciprocal().float()  # grads still scaled
        self._grad_stats.update(self._monitor.collect(inv))
        if self._probe is not None:
            self._grad_stats.update(self._probe.collect())
        if self.scaler is not None:
            self._grad_stats["loss_scale"] = self.scaler.backward_scale()

    def step(self, optimizer=None, *args, **kwargs):
        """Unscale (fp16), observe gradients, step the optimizer (per-group skipping under fp16)."""
        optimizer = optimizer or self.optimizer
        if self._accelerator is not None and not self._accelerator.sync_gradients:
            return None  # inside accelerator.accumulate(): not the step that closes the window
        if self.scaler is not None:
            self.scaler.unscale_(inner_optimizer(optimizer))
        self.observe_gradients()
        if self.scaler is None:
            return optimizer.step(*args, **kwargs)
        out = self.scaler.step(inner_optimizer(optimizer), *args, **kwargs)
        self.scaler.update()
        return out

    def on_step_end(self, step: int, metrics: dict[str, Any] | None = None, wait: bool = False):
        """Evaluate switches and fallback rules on the metrics that have reached the host.

        Args:
            step: The optimizer step just completed.
            metrics: ``{"loss": ..., "grad_norm": ..., "throughput": ...}``; floats or device tensors.
            wait: Wait for device values instead of deferring them (end of training, tests).

        Returns:
            The :class:`PrecisionAction` records applied now.
        """
        merged = dict(self._grad_stats)
        self._grad_stats = {}
        merged.update(metrics or {})
        merged.update({f"layer:{n}.precision_error": r.error for n, r in self.sensitivity.items()})
        self._queue.submit(step, merged)
        actions: list[PrecisionAction] = []
        for s, values in self._queue.ready(wait):
            if self._monitor is not None:
                values = self._monitor.expand(values)
            self.last_metrics = values
            if self.mode is PrecisionMode.ADAPTIVE:
                actions += self._evaluate(s, values)
        return actions


def sharded_parameters_reason(model) -> str | None:
    """Why ``model``'s parameters cannot be run layer by layer here, or None: FSDP2 shards them as
    DTensors, DeepSpeed ZeRO-3 partitions them (``ds_id``)."""
    for p in model.parameters():
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            return "parameters are FSDP2 DTensor shards"
        if hasattr(p, "ds_id"):
            return "parameters are partitioned by DeepSpeed ZeRO-3"
    return None
