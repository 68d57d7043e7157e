"""Health rules evaluated on device tensors: finite loss and gradients, z-scores, user rules.

Everything here stays on the device until :meth:`HealthMonitor.verdict` reads one small tensor (the
rule flags and the gradient norm) to the host: one read per optimizer step, at verification time.
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


class RunningStat:
    """Exponential running mean and variance of a scalar kept on the device (ZClip-style z-scores).

    The update count is a host integer: updates happen only after a verified step, whose verdict the
    host has already read, so counting needs no extra synchronisation.
    """

    def __init__(self, beta: float = 0.97):
        self.beta = beta
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.var: torch.Tensor | None = None

    def zscore(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return torch.zeros_like(x)
        # the floor keeps a perfectly flat history from turning rounding noise into a huge z
        std = torch.sqrt(self.var + (1e-3 * self.mean.abs() + 1e-12) ** 2)
        return (x - self.mean) / std

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        if self.mean is None:
            self.mean, self.var = x.clone(), torch.zeros_like(x)
        else:
            # alpha = 1/n at first makes this Welford's exact mean/variance, so the early z-scores are
            # not inflated by a variance that starts at 0; later it is an EMA that follows drift.
            alpha = max(1 - self.beta, 1 / (self.count + 1))
            delta = x - self.mean
            self.mean = self.mean + alpha * delta
            self.var = (1 - alpha) * (self.var + alpha * delta * delta)
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.count, self.mean, self.var = sd["count"], sd["mean"], sd["var"]


class HealthMonitor:
    """Collects the window's metrics and turns the health rules into one verdict.

    Args:
        grad_z_threshold: largest healthy z-score of the global gradient norm.
        loss_z_threshold: largest healthy z-score of the window's mean loss (only upward spikes fail).
        warmup_steps: verified steps before the z-score rules start to apply.
    """

    def __init__(self, grad_z_threshold: float, loss_z_threshold: float, warmup_steps: int):
        self.grad_z_threshold = grad_z_threshold
        self.loss_z_threshold = loss_z_threshold
        self.warmup_steps = warmup_steps
        self.grad_stat = RunningStat()
        self.loss_stat = RunningStat()
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
            out["loss_z"] = self.loss_stat.zscore(out["loss"])
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
            out["grad_norm_z"] = self.grad_stat.zscore(grad_norm)
        for name, (reduce, value, n) in self._records.items():
            out[name] = value / n if reduce == "mean" else value
        return out

    def flags(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rule name -> 0-d bool tensor, True when healthy."""
        flags: dict[str, torch.Tensor] = {}
        warm = self.grad_stat.count >= self.warmup_steps
        if "loss" in metrics:
            flags["finite_loss"] = torch.isfinite(metrics["loss"])
            if self.loss_stat.count >= self.warmup_steps:
                flags["loss_spike"] = metrics["loss_z"] <= self.loss_z_threshold
        if "grad_norm" in metrics:
            flags["finite_grads"] = torch.isfinite(metrics["grad_norm"])
            if warm:
                flags["grad_norm_zscore"] = metrics["grad_norm_z"] <= self.grad_z_threshold
        for name, rule in self.rules.items():
            flags[name] = torch.as_tensor(rule(metrics)).to(torch.bool).reshape(())
        return flags

    def update_stats(self, metrics: dict[str, torch.Tensor]) -> None:
        """Feed a verified (healthy) window into the running statistics."""
        if "grad_norm" in metrics:
            self.grad_stat.update(metrics["grad_norm"])
        if "loss" in metrics:
            self.loss_stat.update(metrics["loss"])

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
