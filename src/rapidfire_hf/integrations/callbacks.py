"""Driving ``AdaptivePrecisionPlugin`` from a ``transformers.Trainer``'s events."""

from __future__ import annotations

import functools
import logging

import torch
from transformers import TrainerCallback

from rapidfire_hf.integrations.step_hooks import add_step_observer

logger = logging.getLogger(__name__)

# Trainer log keys -> metric names of the fallback rules (rapidfire_hf.config.rules.METRICS).
_RULE_METRICS = {
    "entropy": "entropy",
    "kl": "kl",
    "rapidfire/tokens_per_sec": "throughput",
    "rapidfire/memory/fragmentation": "fragmentation",
    "rapidfire/memory/allocated_gib": "memory_allocated_gb",
    "rapidfire/memory/reserved_gib": "memory_reserved_gb",
}


# Rows of a micro-batch the sensitivity pass runs on: its fp32 reference forward materialises [B, T, V]
# logits, and a few rows measure a layer's error as well as a whole GRPO batch of 64 x 384 tokens would.
CALIBRATION_ROWS = 4


def calibration_batch(inputs, rows: int = CALIBRATION_ROWS) -> dict[str, torch.Tensor] | None:
    """Causal-LM forward kwargs from one micro-batch of a TRL trainer, for the sensitivity pass."""
    if not isinstance(inputs, dict):
        return None
    if isinstance(inputs.get("input_ids"), torch.Tensor):  # SFT, DPO, reward
        batch = {k: inputs[k] for k in ("input_ids", "attention_mask") if k in inputs}
    elif "prompt_ids" in inputs and "completion_ids" in inputs:  # GRPO, RLOO
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        batch = {"input_ids": ids, "attention_mask": mask}
    else:
        return None
    return {k: v[:rows] for k, v in batch.items()}


class PrecisionPluginCallback(TrainerCallback):
    """Attaches an ``AdaptivePrecisionPlugin`` to a trainer and runs its per-step protocol.

    - ``on_train_begin`` (after ``accelerator.prepare``): ``attach`` with the final model and optimizer;
      the plugin's ``disable_pipeline``/``enable_pipeline`` actions go to ``trainer.disable_pipeline()``
      and its ``compact_memory`` action to the memory callback when installed.
    - before each micro-batch's ``training_step`` (a step observer, ``rapidfire_hf.integrations.step_hooks``)
      until calibration is done: ``calibrate`` (the sensitivity pass, on a few rows; a no-op in static
      mode or fp32, and skipped when the weights themselves are not fp32); after it, its loss is kept.
    - before each optimizer step: ``observe_gradients`` (gradients the pipeline already applied are gone,
      so in pipelined windows only the rules on global metrics see data).
    - after each optimizer step: ``on_step_end(step, metrics)`` with the window's loss (a device tensor,
      read asynchronously by the plugin), the optimizer's gradient norm, and the most recent logged
      throughput / memory / entropy / KL (logging happens after ``on_step_end``: a step late).

    Args:
        plugin: the ``AdaptivePrecisionPlugin``.
        trainer: the trainer it belongs to.
    """

    def __init__(self, plugin, trainer):
        self.plugin = plugin
        self.trainer = trainer
        self.logged: dict[str, float] = {}
        self._losses: list[torch.Tensor] = []
        self._attached = False
        self._calibrate = False
        add_step_observer(trainer, "precision", before=self._before_step, after=self._after_step)

    def _before_step(self, model, inputs) -> None:
        if self._calibrate and not self.plugin.calibration_done:
            batch = calibration_batch(inputs)
            if batch is not None:
                self.plugin.calibrate(batch)

    def _after_step(self, loss) -> None:
        self._losses.append(loss.detach())

    def stats(self) -> dict:
        return self.plugin.stats()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._attached:
            return
        handlers = {"disable_pipeline": self._pipeline(False), "enable_pipeline": self._pipeline(True)}
        memory = getattr(getattr(self.trainer, "_rapidfire", None), "parts", {}).get("memory")
        if memory is not None:
            handlers["compact_memory"] = functools.partial(memory.compact, "precision rule")
        self.plugin.attach(self.trainer.accelerator, model, optimizer, handlers=handlers)
        self._attached = True
        # The sensitivity pass compares against fp32 weights; a model held in bf16/fp16 has none.
        self._calibrate = all(p.dtype == torch.float32 for p in self.plugin.model.parameters())
        if not self._calibrate:
            logger.info("rapidfire: no precision sensitivity pass (the model's weights are not fp32)")

    def _pipeline(self, enabled: bool):
        def switch():
            method = getattr(self.trainer, "enable_pipeline" if enabled else "disable_pipeline", None)
            if method is not None:
                method()

        return switch

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.plugin.observe_gradients()

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key, name in _RULE_METRICS.items():
            value = (logs or {}).get(key)
            if isinstance(value, (int, float)):
                self.logged[name] = float(value)

    def on_step_end(self, args, state, control, **kwargs):
        from rapidfire_hf.integrations.parts import find_rapidfire_optimizer

        metrics: dict = dict(self.logged)
        if self._losses:
            metrics["loss"] = torch.stack(self._losses).mean()
            self._losses = []
        opt = find_rapidfire_optimizer(self.trainer.optimizer)
        norm = opt.stats().get("last_grad_norm") if opt is not None else None
        if norm is not None:
            metrics["grad_norm"] = norm
        self.plugin.on_step_end(state.global_step, metrics)
