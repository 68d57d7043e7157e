"""One interface in front of an optimizer's step health, whatever the optimizer.

A training loop asks the same six things of every optimizer: take the window's losses (and other device
metrics) for the health check, step (or skip) the window, say how many steps were taken and how many
skipped, give its counters, and verify what is still unverified. :class:`StepHealth` is that interface; three adapters
satisfy it:

* :class:`RapidFireHealth`: a :class:`~rapidfire_hf.optim.RapidFireOptimizer`, which verifies its own
  steps (health rules, rollback, replay reports);
* :class:`GuardedHealth`: any other torch optimizer behind a
  :class:`~rapidfire_hf.optim.guard.NonFiniteGuard` (a NaN/inf loss or gradient never reaches the weights);
* :class:`UncheckedHealth`: an optimizer whose step someone else guards (DeepSpeed's engine, fp16's
  GradScaler).

:func:`step_health` picks the adapter once, by type; callers never ask ``hasattr(optimizer, ...)``.

Example:
    >>> health = step_health(optimizer, guard=True)
    >>> loss = model(x).pow(2).mean(); health.observe_loss(loss.detach()); loss.backward()
    >>> health.step(optimizer, list(model.parameters())); optimizer.zero_grad()
    >>> health.skipped()   # steps skipped so far as unhealthy (one host read per call)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from rapidfire_hf.optim.bnb import eight_bit_state
from rapidfire_hf.optim.guard import NonFiniteGuard
from rapidfire_hf.optim.optimizer import RapidFireOptimizer
from rapidfire_hf.optim.spans import Rollback


@runtime_checkable
class StepHealth(Protocol):
    """The step health of one optimizer, as a training loop sees it."""

    #: the RapidFireOptimizer behind this health, or None (what verifies steps and reports rollbacks)
    rapidfire: RapidFireOptimizer | None

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's (detached) loss to the current window's health check (no host read)."""

    def record(self, name: str, value: torch.Tensor, reduce: str = "mean") -> None:
        """Add a device metric (e.g. PPO's approx-KL) for the window's health rules."""

    def step(self, optimizer, params: list[torch.Tensor], grad_norm: torch.Tensor | None = None) -> None:
        """Step ``optimizer`` (the one to call, e.g. accelerate's wrapper) for a closed window, or skip it."""

    def steps(self) -> int:
        """Optimizer steps taken so far, skipped ones included (``stats()["steps"]``; a host counter, no
        device read): what a loop keys a window by, without building the logging counters."""

    def skipped(self) -> int:
        """Optimizer steps skipped so far as unhealthy (may read the device once; may raise
        :class:`~rapidfire_hf.optim.skips.ConsecutiveSkipsError`)."""

    def stats(self) -> dict[str, Any]:
        """Counters for logging: at least ``steps`` and ``skipped``."""

    def verify_now(self) -> Rollback | None:
        """Verify every step still unverified; what a failed check undid (and asks to replay), or None."""

    def last_rollback(self) -> Rollback | None:
        """What the latest step undid (and asks to replay), or None."""


class RapidFireHealth:
    """A :class:`RapidFireOptimizer`'s own verification, behind :class:`StepHealth`.

    Calls go to the optimizer's methods as they are at call time (a test may patch ``observe_loss``).
    """

    def __init__(self, optimizer: RapidFireOptimizer):
        self.rapidfire = optimizer

    def observe_loss(self, loss: torch.Tensor) -> None:
        self.rapidfire.observe_loss(loss)

    def record(self, name: str, value: torch.Tensor, reduce: str = "mean") -> None:
        self.rapidfire.record(name, value, reduce=reduce)

    def step(self, optimizer, params: list[torch.Tensor], grad_norm: torch.Tensor | None = None) -> None:
        optimizer.step()  # the optimizer checks the window itself (and rolls back a failed one)

    def steps(self) -> int:
        return self.rapidfire.step_count

    def skipped(self) -> int:
        stats = self.rapidfire.stats()
        return stats["skipped"] - stats["clip_misses"]  # a missed clip prediction is replayed, not lost

    def stats(self) -> dict[str, Any]:
        return self.rapidfire.stats()

    def verify_now(self) -> Rollback | None:
        return self.rapidfire.verify_now()

    def last_rollback(self) -> Rollback | None:
        return self.rapidfire.last_rollback


class GuardedHealth:
    """A plain torch optimizer behind a :class:`NonFiniteGuard`, behind :class:`StepHealth`."""

    rapidfire = None

    def __init__(self, guard: NonFiniteGuard):
        self.guard = guard

    def observe_loss(self, loss: torch.Tensor) -> None:
        self.guard.observe_loss(loss)

    def record(self, name: str, value: torch.Tensor, reduce: str = "mean") -> None:
        pass  # the guard's rule is finiteness of the loss and gradients only

    def step(self, optimizer, params: list[torch.Tensor], grad_norm: torch.Tensor | None = None) -> None:
        self.guard.step(optimizer, params, grad_norm)

    def steps(self) -> int:
        return self.guard.steps

    def skipped(self) -> int:
        self.guard.drain()  # one host read of the flags since the last call
        return self.guard.skipped

    def stats(self) -> dict[str, Any]:
        return {"steps": self.guard.steps, "skipped": self.guard.skipped}

    def verify_now(self) -> Rollback | None:
        return None  # the guard decides before each step: nothing is left unverified

    def last_rollback(self) -> Rollback | None:
        return None


class UncheckedHealth:
    """An optimizer whose steps another component guards (DeepSpeed's engine, fp16's GradScaler)."""

    rapidfire = None

    def __init__(self):
        self._steps = 0

    def observe_loss(self, loss: torch.Tensor) -> None:
        pass

    def record(self, name: str, value: torch.Tensor, reduce: str = "mean") -> None:
        pass

    def step(self, optimizer, params: list[torch.Tensor], grad_norm: torch.Tensor | None = None) -> None:
        optimizer.step()
        self._steps += 1

    def steps(self) -> int:
        return self._steps

    def skipped(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {"steps": self._steps, "skipped": 0}

    def verify_now(self) -> Rollback | None:
        return None

    def last_rollback(self) -> Rollback | None:
        return None


@dataclass(frozen=True)
class ClosedWindow:
    """What the step of one closed accumulation window left (:func:`close_window`)."""

    #: optimizer steps taken so far, this one and skipped ones included (``StepHealth.steps()``)
    steps: int
    #: what this step undid and asks to replay (``StepHealth.last_rollback()``), or None
    rollback: Rollback | None


def close_window(
    health: StepHealth,
    optimizer,
    params: list[torch.Tensor],
    grad_norm: torch.Tensor | None = None,
    *,
    loss: torch.Tensor | None = None,
    records: tuple[tuple[str, torch.Tensor, str], ...] = (),
) -> ClosedWindow:
    """A loop's window closed in one call: the last micro-batch's ``loss`` and device metrics
    (``(name, value, reduce)``) handed to ``health``, the optimizer stepped or skipped, and what the step
    left. No host read beyond the ones ``health.step`` makes.

    Example:
        >>> closed = close_window(health, optimizer, params, grad_norm, loss=loss.detach())
        >>> closed.steps, closed.rollback  # the next window's key; what to replay (None: nothing)
    """
    if loss is not None:
        health.observe_loss(loss)
    for name, value, reduce in records:
        health.record(name, value, reduce=reduce)
    health.step(optimizer, params, grad_norm)
    return ClosedWindow(health.steps(), health.last_rollback())


def rapidfire_optimizer(optimizer) -> RapidFireOptimizer | None:
    """The :class:`RapidFireOptimizer` ``optimizer`` is, or wraps (accelerate's ``AcceleratedOptimizer``
    keeps it as ``.optimizer``), else None."""
    while isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer"):
        if isinstance(optimizer, RapidFireOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def eight_bit_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` (a RapidFireOptimizer, a plain torch optimizer, either behind accelerate's
    wrapper) keeps its state in 8 bits: read from the optimizer's type and setting, never its class name."""
    rapidfire = rapidfire_optimizer(optimizer)
    if rapidfire is not None:
        return rapidfire.eight_bit_state
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer
    return eight_bit_state(optimizer)


def step_health(
    optimizer, *, guard: bool, max_consecutive_skips: int | None = 10, owner: str = "NonFiniteGuard"
) -> StepHealth:
    """The :class:`StepHealth` of ``optimizer``: its own verification for a RapidFireOptimizer, else a
    :class:`NonFiniteGuard` when ``guard`` (False where another component guards the step)."""
    rapidfire = rapidfire_optimizer(optimizer)
    if rapidfire is not None:
        return RapidFireHealth(rapidfire)
    if guard:
        return GuardedHealth(NonFiniteGuard(max_consecutive_skips, owner=owner))
    return UncheckedHealth()
