"""Health rules evaluated on device tensors: finite loss and gradients, z-scores, user rules.

Everything here stays on the device until :func:`read_verdict` reads one small tensor (the rule flags
and the gradient norm) to the host, at verification time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Rule = Callable[[dict[str, torch.Tensor]], "torch.Tensor | bool"]
_REDUCERS = ("mean", "max", "last")


@dataclass
class OptimizerEvent:
    """Something the optimizer did besides a normal step, for logs.

    Attributes:
        step: optimizer step index (windows seen so far, counting skipped ones) at which it happened.
        kind: ``"rollback"`` (updates undone from a snapshot), ``"skip"`` (update not applied),
            ``"clip_miss_unrecoverable"`` (clipping would have bound but the update was already applied
            and no snapshot existed).
        reasons: names of the rules that failed.
        details: measured values (gradient norm, loss, steps lost to an older snapshot, seconds).
    """

    step: int
    kind: str
    reasons: list[str]
    details: dict[str, Any] = field(default_factory=dict)


class RobustStat:
    """Median and MAD of the last ``window`` accepted values of a scalar, kept on the device.

    The z-score of a value is ``(x - median) / scale`` with ``scale = 1.4826 * MAD`` (the standard
    deviation for normal data), floored by ``floor * median(|x|)``: during warm-up the floor is the
    typical magnitude itself (``floor=1``: only a jump of more than ``threshold`` times the usual size
    counts as a spike, which catches a 1000x spike from the second step on), afterwards ``1e-3`` of it
    (a perfectly flat history does not turn rounding noise into a huge z). A median over a window is
    not moved by one outlier the way a running mean and variance are, and values are clipped to
    ``median +- threshold * scale`` before they enter the window, so one spike neither hides the next
    nor drags the centre.

    The count is a host integer: values enter only after a verdict the host has already read.
    """

    def __init__(self, window: int = 32, abs_floor: float = 0.0):
        self.window = window
        self.abs_floor = abs_floor  # smallest scale in the value's own units (0: relative floors only)
        self.count = 0
        self.values: torch.Tensor | None = None  # (window,) float32 ring buffer on the device

    def _live(self) -> torch.Tensor:
        return self.values[: min(self.count, self.window)]

    def center_scale(self, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(median, scale) of the window; call only when ``count > 0``."""
        live = self._live()
        center = live.median()
        spread = 1.4826 * (live - center).abs().median()
        return center, torch.maximum(spread, floor * live.abs().median() + 1e-12).clamp_min(self.abs_floor)

    def zscore(self, x: torch.Tensor, floor: float) -> torch.Tensor:
        if self.count == 0:
            return torch.zeros_like(x)
        center, scale = self.center_scale(floor)
        return (x - center) / scale

    def update(self, x: torch.Tensor, threshold: float, floor: float) -> None:
        """Add ``x`` (finite, 0-d), clipped to ``median +- threshold * scale`` of the current window."""
        x = x.detach().float().reshape(())
        if self.values is None:
            self.values = torch.zeros(self.window, dtype=torch.float32, device=x.device)
        if self.count > 0:
            center, scale = self.center_scale(floor)
            x = torch.minimum(torch.maximum(x, center - threshold * scale), center + threshold * scale)
        self.values[self.count % self.window] = x
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "values": self.values}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "values" not in sd:  # running mean/variance of an older version: start the window afresh
            self.count, self.values = 0, None
            return
        self.count, self.values = sd["count"], sd["values"]


class HealthMonitor:
    """Collects the window's metrics and turns the health rules into one verdict.

    The z-score rules apply from the second verified window on (see :class:`RobustStat`): during the
    first ``warmup_steps`` windows a value is compared with the typical magnitude of the values seen so
    far, afterwards with their spread.

    Args:
        grad_z_threshold: largest healthy z-score of the global gradient norm.
        loss_z_threshold: largest healthy z-score of the window's mean loss (only upward spikes fail).
        warmup_steps: verified windows judged against the magnitude (not yet the spread) of the history.
    """

    def __init__(self, grad_z_threshold: float, loss_z_threshold: float, warmup_steps: int):
        self.grad_z_threshold = grad_z_threshold
        self.loss_z_threshold = loss_z_threshold
        self.warmup_steps = warmup_steps
        self.grad_stat = RobustStat()
        self.loss_stat = RobustStat()
        self.rules: dict[str, Rule] = {}
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._records: dict[str, tuple[str, torch.Tensor, int]] = {}

    # ---- inputs -------------------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor) -> None:
        value = loss.detach().float().mean()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def record(self, name: str, value: torch.Tensor | float, reduce: str) -> None:
        if reduce not in _REDUCERS:
            raise ValueError(f"record(reduce={reduce!r}): choose one of {_REDUCERS}")
        value = torch.as_tensor(value).detach().float().mean()
        old = self._records.get(name)
        if old is None or reduce == "last":
            self._records[name] = (reduce, value, 1)
        elif reduce == "max":
            self._records[name] = (reduce, torch.maximum(old[1], value), 1)
        else:
            self._records[name] = (reduce, old[1] + value, old[2] + 1)

    def reset_window(self) -> None:
        self._loss_sum, self._loss_count, self._records = None, 0, {}

    # ---- verdict ------------------------------------------------------------------------------------
    def metrics(self, grad_norm: torch.Tensor | None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        if self._loss_sum is not None:
            out["loss"] = self._loss_sum / self._loss_count
            out["loss_z"] = self.loss_stat.zscore(out["loss"], self._floor(self.loss_stat))
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
            out["grad_norm_z"] = self.grad_stat.zscore(grad_norm, self._floor(self.grad_stat))
        for name, (reduce, value, n) in self._records.items():
            out[name] = value / n if reduce == "mean" else value
        return out

    def flags(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rule name -> 0-d bool tensor, True when healthy."""
        flags: dict[str, torch.Tensor] = {}
        if "loss" in metrics:
            flags["finite_loss"] = torch.isfinite(metrics["loss"])
            if self.loss_stat.count > 0:  # a non-finite loss is finite_loss's verdict alone
                flags["loss_spike"] = (metrics["loss_z"] <= self.loss_z_threshold) | ~flags["finite_loss"]
        if "grad_norm" in metrics:
            flags["finite_grads"] = torch.isfinite(metrics["grad_norm"])
            if self.grad_stat.count > 0:  # likewise a non-finite gradient norm is finite_grads' alone
                flags["grad_norm_zscore"] = (metrics["grad_norm_z"] <= self.grad_z_threshold) | ~flags[
                    "finite_grads"
                ]
        for name, rule in self.rules.items():
            flags[name] = torch.as_tensor(rule(metrics)).to(torch.bool).reshape(())
        return flags

    def set_loss_scale(self, scale: float) -> None:
        """The loss's own typical size, for a loss that is signed and hovers near zero (PPO's clipped
        surrogate with whitened advantages, whose terms are of order 1): a loss-spike z-score then never
        divides by less than ``scale``. Without it, a PPO loss going from 0.003 to 0.033 on its second step
        read as a 10-sigma spike and a healthy step was undone (the tiny PPO snippet of the README)."""
        if not scale >= 0:
            raise ValueError(f"loss scale {scale!r}: a number >= 0")
        self.loss_stat.abs_floor = float(scale)

    def _floor(self, stat: RobustStat) -> float:
        return 1.0 if stat.count < self.warmup_steps else 1e-3

    def update_stats(self, metrics: dict[str, torch.Tensor], failed: list[str] | tuple = ()) -> None:
        """Feed a verified window into the statistics.

        A healthy window adds its values; a window that failed only a z-score rule (or a user rule) adds
        them too, clipped (so a lasting shift of the level is followed instead of failing forever); a
        window with a non-finite loss or gradient adds nothing, nor does one undone for a missed clip
        prediction (its batch is replayed and counted then).
        """
        if {"finite_loss", "finite_grads", "clip_prediction"} & set(failed):
            return
        if "grad_norm" in metrics:
            stat = self.grad_stat
            stat.update(metrics["grad_norm"], self.grad_z_threshold, self._floor(stat))
        if "loss" in metrics:
            stat = self.loss_stat
            stat.update(metrics["loss"], self.loss_z_threshold, self._floor(stat))

    def state_dict(self) -> dict[str, Any]:
        return {"grad": self.grad_stat.state_dict(), "loss": self.loss_stat.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.grad_stat.load_state_dict(sd["grad"])
        self.loss_stat.load_state_dict(sd["loss"])


def read_verdict(flags: dict[str, torch.Tensor], extra: list[torch.Tensor]) -> tuple[list[str], list[float]]:
    """All-reduce the flags across ranks (MIN: one unhealthy rank fails all) and read them once.

    Returns:
        The names of failed rules (the same on every rank) and the host values of ``extra``.
    """
    names = list(flags)
    tensors = [flags[n].float() for n in names] + [t.detach().float().reshape(()) for t in extra]
    if not tensors:
        return [], []
    packed = torch.stack([t.to(tensors[0].device) for t in tensors])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        verdict = packed[: len(names)].clone()
        torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN)
        packed = torch.cat([verdict, packed[len(names) :]])
    host = packed.tolist()  # the one host read of the step
    failed = [n for n, ok in zip(names, host[: len(names)]) if ok < 0.5]
    return failed, host[len(names) :]
