"""NonFiniteGuard: skip a plain torch optimizer's step when the loss or a gradient is not finite.

``RapidFireOptimizer`` verifies every step itself; a plain optimizer (PPOTrainer's default AdamW, one a
user passes) applies whatever gradient it gets, and one NaN makes every weight NaN. The guard sits
between backward and ``optimizer.step()``, as ``torch.amp.GradScaler`` does for fp16:

* the health flag is computed on the device: the window's losses (:meth:`NonFiniteGuard.observe_loss`)
  and the global gradient norm must be finite (across processes: one all-reduce, no host read);
* optimizers that accept a ``found_inf`` tensor (torch's fused Adam, AdamW, SGD:
  ``_step_supports_amp_scaling``) get it and skip the update inside their kernel, parameters, moments
  and step count alike, with no host synchronisation;
* any other optimizer is stepped only after one host read of the flag (what ``GradScaler`` does for
  non-fused optimizers; on the CPU this read is free).

The flags of a PPO update are read once, at :meth:`NonFiniteGuard.drain`: each skipped step is logged
with its number and counted, and a run of ``max_consecutive_skips`` skipped steps raises
:class:`~rapidfire_hf.optim.skips.ConsecutiveSkipsError`.
"""

from __future__ import annotations

import torch
from torch.nn.utils import get_total_norm

from rapidfire_hf.optim.skips import SkipStreak

REASONS = ("finite_loss", "finite_grads")


def innermost(optimizer):
    """The torch optimizer under wrappers such as accelerate's ``AcceleratedOptimizer``."""
    while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _full(t: torch.Tensor) -> torch.Tensor:
    to_full = getattr(t, "full_tensor", None)  # a DTensor (FSDP2) norm: its global value
    return to_full() if callable(to_full) else t


class NonFiniteGuard:
    """Skips the optimizer step of a window whose loss or gradients are not finite.

    Args:
        max_consecutive_skips: skipped steps in a row after which :meth:`drain` raises (None: never).
        owner: who is guarded, for the messages.
        setting: the name of the setting that holds the limit, for the error message.

    Example:
        >>> guard = NonFiniteGuard()
        >>> loss = model(x).pow(2).mean(); guard.observe_loss(loss); loss.backward()
        >>> guard.step(optimizer, list(model.parameters())); optimizer.zero_grad()
        >>> guard.drain()   # once per logging period: warns about each skipped step, returns their count
    """

    def __init__(
        self,
        max_consecutive_skips: int | None = 10,
        owner: str = "NonFiniteGuard",
        setting: str = "max_consecutive_skips",
    ):
        self.streak = SkipStreak(max_consecutive_skips, owner, setting)
        self.steps = 0
        self._loss_ok: torch.Tensor | None = None
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, 0-d/len-2 bad flags, device)

    @property
    def skipped(self) -> int:
        """Steps skipped so far (counted when :meth:`drain` reads the flags)."""
        return self.streak.total

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss to the current window (a device op, no host read)."""
        ok = torch.isfinite(loss.detach()).all()
        self._loss_ok = ok if self._loss_ok is None else self._loss_ok & ok

    def bad_flags(self, params: list[torch.Tensor], grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """``[loss not finite, gradients not finite]`` as a float tensor on the device."""
        grads = [p.grad for p in params if p.grad is not None]
        if grad_norm is None and grads:
            grad_norm = get_total_norm(grads)
        device = grads[0].device if grads else (self._loss_ok.device if self._loss_ok is not None else None)
        loss_bad = torch.zeros((), device=device) if self._loss_ok is None else (~self._loss_ok).float()
        grads_bad = (
            torch.zeros((), device=device)
            if grad_norm is None
            else (~torch.isfinite(_full(grad_norm).detach())).float().to(loss_bad.device)
        )
        bad = torch.stack([loss_bad.reshape(()), grads_bad.reshape(())])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # one rank's NaN skips all
        return bad

    def step(self, optimizer, params: list[torch.Tensor], grad_norm: torch.Tensor | None = None) -> None:
        """``optimizer.step()`` unless the window's loss or gradients are not finite.

        Args:
            optimizer: the optimizer (or a wrapper whose ``.optimizer`` is it, e.g. accelerate's).
            params: the trained parameters (their ``.grad`` is checked).
            grad_norm: the global gradient norm when already computed (``clip_grad_norm_``'s return).
        """
        bad = self.bad_flags(params, grad_norm)
        self._loss_ok = None
        target = innermost(optimizer)
        if getattr(target, "_step_supports_amp_scaling", False) and not hasattr(target, "found_inf"):
            target.found_inf = bad.amax().to(torch.float32)  # the fused kernel skips when it is 1
            try:
                optimizer.step()
            finally:
                del target.found_inf
            self._pending.append((self.steps, bad))
        else:
            host = bad.tolist()  # one read, as GradScaler does for optimizers without found_inf
            if not any(host):
                optimizer.step()
            self._pending.append((self.steps, torch.tensor(host)))
        self.steps += 1

    def drain(self) -> int:
        """Read the flags of the steps since the last call (one host read), log each skipped step and
        check the streak. Returns the number of steps skipped since the last call.

        Raises:
            ConsecutiveSkipsError: ``max_consecutive_skips`` steps in a row were skipped.
        """
        if not self._pending:
            return 0
        pending, self._pending = self._pending, []
        flags = torch.stack([f.to(pending[0][1].device) for _, f in pending]).tolist()
        skipped = 0
        for (step, _), row in zip(pending, flags):
            if any(row):
                skipped += 1
                self.streak.skipped(step, [r for r, bad in zip(REASONS, row) if bad])
                self.streak.check()
            else:
                self.streak.healthy()
        return skipped
