"""Skipped optimizer steps in a ``transformers.Trainer`` / TRL trainer: counted, logged, and an honest loss.

A step is *skipped* when its update is not applied to the weights: the ``RapidFireOptimizer``'s health rules
failed (non-finite loss or gradients, a gradient-norm or loss spike, a user rule; the optimizer logs each
one with its reasons), a predicted clip coefficient missed (the window is rolled back, and a
``transformers.Trainer`` cannot replay it), or fp16 loss scaling found inf/NaN gradients (accelerate's
scaler skips the step silently in stock transformers).

:class:`SkippedStepsCallback` logs the last two kinds itself (one warning per step, with its reason) and
adds to the training logs:

- ``rapidfire/steps_skipped``: optimizer steps skipped since the ``rapidfire/*`` metrics were last logged
  (every log, or every ``logging.log_every`` steps); ``rapidfire/steps_skipped/<reason>`` per reason when
  there were any; ``rapidfire/optim/skipped`` stays the running total.
- ``loss``: transformers' ``logging_nan_inf_filter`` (on by default) replaces a NaN/inf step loss by the
  running average of the window so far, which is 0.0 when the first step of a window is non-finite, and a
  skipped step's loss counts although it trained nothing. When a window holds a skipped step or a
  non-finite loss, the logged loss becomes the mean loss of the steps that were applied (leaving out
  non-finite ones while the filter is on, as the filter intends), and **NaN when no step of the window was
  applied**: there was no training to measure. A window with neither keeps the trainer's number unchanged.
  With several processes the trainer's loss (a mean over processes) is kept; the counts are this process's.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import torch
from transformers import TrainerCallback

from rapidfire_hf.integrations.metrics import PREFIX
from rapidfire_hf.integrations.parts import find_rapidfire_optimizer
from rapidfire_hf.integrations.step_hooks import add_step_observer

logger = logging.getLogger(__name__)

SKIPPED = "rapidfire/steps_skipped"
FP16_OVERFLOW = "fp16_overflow"  # the reason name of a step fp16 loss scaling skipped
CLIP_PREDICTION = "clip_prediction"


class SkippedStepsCallback(TrainerCallback):
    """Counts the skipped optimizer steps and logs the loss of each logging window honestly.

    Args:
        trainer: the trainer; its ``training_step`` gets a step observer (the loss of each micro-batch,
            kept on the device) and its ``log`` a wrapper (the window's loss). The counts reach the logs
            through :meth:`take_counts`, called with the other ``rapidfire/*`` metrics.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self._step_loss: torch.Tensor | None = None  # sum of the open step's micro-batch losses
        self._window: list[tuple[torch.Tensor | None, bool]] = []  # (step loss, skipped) since the last log
        self._skipped = 0  # since take_counts() was last called
        self._reasons: Counter[str] = Counter()
        add_step_observer(trainer, "skips.loss", after=self._add_loss)
        self._wrap_log(trainer)

    def _add_loss(self, loss) -> None:
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().sum()
            self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    def on_step_end(self, args, state, control, **kwargs):
        reasons = self._skip_reasons(state.global_step)
        self._window.append((self._step_loss, reasons is not None))
        self._step_loss = None
        if reasons is not None:
            self._skipped += 1
            self._reasons.update(reasons or ["unknown"])

    def _skip_reasons(self, step: int) -> list[str] | None:
        """The reasons the step just taken was skipped, or None when it was applied."""
        if getattr(self.trainer.accelerator, "optimizer_step_was_skipped", False):
            logger.warning(
                "rapidfire: trainer step %d skipped (not applied to the weights): fp16 loss scaling found inf/NaN "
                "gradients and lowered the loss scale",
                step,
            )
            return [FP16_OVERFLOW]
        opt = find_rapidfire_optimizer(self.trainer.optimizer)
        if opt is None or not opt.last_step_skipped:
            return None
        reasons = list(opt.events[-1].reasons) if opt.events else []
        if reasons == [CLIP_PREDICTION] and not opt.replays_missed_windows:
            # the optimizer logs the other skips itself; this one it counts as replayed, which a
            # transformers.Trainer never does
            logger.warning(
                "rapidfire: trainer step %d skipped (not applied to the weights): the predicted clip coefficient "
                "missed and the trainer cannot replay the batch; clip_prediction='exact' (the default) "
                "avoids this",
                step,
            )
        return reasons

    def _wrap_log(self, trainer) -> None:
        log = trainer.log

        def log_with_skips(logs: dict[str, float], *args, **kwargs):
            if "loss" in logs and not any(k.startswith(("eval_", "test_")) for k in logs):
                self.close_window(logs)
            return log(logs, *args, **kwargs)

        trainer.log = log_with_skips

    def take_counts(self) -> dict[str, float]:
        """``{"steps_skipped": n, "steps_skipped/<reason>": k, ...}`` since the last call (which resets them)."""
        name = SKIPPED.removeprefix(PREFIX)
        counts = {name: float(self._skipped)}
        counts.update({f"{name}/{r}": float(n) for r, n in sorted(self._reasons.items())})
        self._skipped, self._reasons = 0, Counter()
        return counts

    def close_window(self, logs: dict[str, float]) -> None:
        """Set the loss of a training log (see the module) and start a new window."""
        window, self._window = self._window, []
        skipped = sum(s for _, s in window)
        if not window or getattr(self.trainer.args, "world_size", 1) > 1:
            return
        losses = [loss for loss, _ in window if loss is not None]
        finite = torch.stack(losses).isfinite().tolist() if losses else []  # one read, at log time only
        if not skipped and all(finite):
            return  # the trainer's own number is the mean of the window's losses
        filtering = bool(getattr(self.trainer.args, "logging_nan_inf_filter", True))
        keep, it = [], iter(finite)
        for loss, was_skipped in window:
            ok = next(it) if loss is not None else False
            if loss is not None and not was_skipped and (ok or not filtering):
                keep.append(loss)
        logs["loss"] = float(torch.stack(keep).mean()) if keep else math.nan


def install_skip_tracking(trainer) -> SkippedStepsCallback:
    """Add a :class:`SkippedStepsCallback` to ``trainer`` and return it."""
    callback = SkippedStepsCallback(trainer)
    trainer.add_callback(callback)
    return callback


__all__ = ["SKIPPED", "SkippedStepsCallback", "install_skip_tracking"]
