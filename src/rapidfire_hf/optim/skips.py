"""Skipped optimizer steps: a warning for each, and an error once too many follow one another.

Skipping an unhealthy batch keeps the weights clean, but a run that skips every batch (a NaN
coefficient in the loss, a learning rate that diverged) trains nothing while looking alive.
:class:`SkipStreak` logs every skip with its step and reasons and raises
:class:`ConsecutiveSkipsError` when ``limit`` steps in a row were skipped, naming what failed and
which settings to check.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger("rapidfire_hf.optim")

# rule name -> what it means and what to check
HINTS = {
    "finite_loss": "the loss was NaN or infinite: check what feeds it (reward scores, kl_coef, vf_coef and "
    "other loss coefficients, the input data) and the learning rate",
    "finite_grads": "a gradient was NaN or infinite: check the learning rate, the precision (fp16 overflow: "
    "use bf16 or loss scaling) and max_grad_norm",
    "grad_norm_zscore": "the gradient norm stayed above grad_z_threshold robust standard deviations from its "
    "recent median: raise grad_z_threshold if the norm legitimately grew, or lower the learning rate",
    "loss_spike": "the loss stayed above loss_z_threshold robust standard deviations from its recent median: "
    "raise loss_z_threshold if the loss legitimately grew",
    "approx_kl": "the approx-KL rule failed: raise approx_kl_limit, or lower the learning rate or cliprange",
}


class ConsecutiveSkipsError(RuntimeError):
    """Too many optimizer steps in a row were skipped as unhealthy: training is not progressing."""


def check_limit(name: str, value) -> int | None:
    """A consecutive-skip limit as an int >= 1 or None (never stop), or a ValueError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name}={value!r}: must be an int >= 1 (steps skipped in a row before training stops with "
            "an error) or None (never stop)."
        )
    return value


def hint(reason: str) -> str:
    return HINTS.get(reason, f"the user rule {reason!r} failed: relax it or check why its metric moved")


class SkipStreak:
    """Counts skipped steps, warns about each, and raises after ``limit`` in a row.

    Args:
        limit: skipped steps in a row that stop training (None: never).
        owner: who skips, for the messages (``"RapidFireOptimizer"``, ``"PPOTrainer"``).
        setting: the name of the setting that holds ``limit``, for the error message.
    """

    def __init__(self, limit: int | None, owner: str, setting: str = "max_consecutive_skips"):
        self.limit = check_limit(setting, limit)
        self.owner = owner
        self.setting = setting
        self.total = 0
        self.run: list[tuple[int, list[str]]] = []  # the current streak: (step, reasons)

    def healthy(self) -> None:
        self.run = []

    def skipped(self, step: int, reasons: Iterable[str], details: dict | None = None) -> None:
        """Record and log a skipped step (:meth:`check` raises once the streak reaches the limit)."""
        reasons = list(reasons)
        self.total += 1
        self.run.append((step, reasons))
        shown = {k: v for k, v in (details or {}).items() if v is not None and (k, v) != ("steps_lost", 0)}
        logger.warning(
            "%s: step %d skipped (not applied to the weights): %s failed%s",
            self.owner,
            step,
            ", ".join(reasons) or "a health check",
            f" ({', '.join(f'{k}={v}' for k, v in shown.items())})" if shown else "",
        )

    def check(self) -> None:
        """Raise :class:`ConsecutiveSkipsError` when the current streak has reached the limit."""
        if self.limit is not None and len(self.run) >= self.limit:
            raise ConsecutiveSkipsError(self.message())

    def message(self) -> str:
        first, last = self.run[0][0], self.run[-1][0]
        seen = list(dict.fromkeys(r for _, reasons in self.run for r in reasons))
        why = "; ".join(f"{r}: {hint(r)}" for r in seen) or "a health check failed"
        return (
            f"{self.owner} skipped {len(self.run)} optimizer steps in a row (steps {first}-{last}) because "
            f"they were unhealthy, so training made no progress. {why}. Set {self.setting} (now "
            f"{self.limit}) higher, or None, to tolerate longer runs of skipped steps."
        )
