"""Dynamic loss scaling with one scale per optimizer parameter group.

``torch.amp.GradScaler`` keeps one scale: an inf anywhere skips the whole step and halves the scale for
every parameter. :class:`PerGroupGradScaler` keeps a scale and a growth tracker per parameter group:

* ``scale(loss)`` multiplies the loss by the *backward scale*, the smallest group scale. One backward pass
  can carry only one multiplier, so it carries the one every group can tolerate.
* ``unscale_`` divides each group's gradients by that multiplier and records an inf/NaN flag per group.
* ``step`` runs the inner optimizer for the finite groups only: an overflowing group's gradients are set
  to None, which torch optimizers treat as "no update" (no moment, weight-decay or step-count change).
* ``update`` backs off the scale of each group that overflowed and grows the others on their own
  ``growth_interval``, with the same kernel GradScaler uses (``torch._amp_update_scale_``).

With one parameter group this is GradScaler: same scale, same skipped steps, same parameters
(``tests/precision/test_scaler.py`` checks it bit for bit on CPU). It has the same interface
(``scale``, ``unscale_``, ``step``, ``update``, ``get_scale``, ``state_dict``, ``is_enabled``), so it can
stand in for ``accelerator.scaler``.

Reading the per-group flags in ``step`` is one host-device synchronisation, the same one GradScaler makes
to decide whether to skip.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch


class PerGroupGradScaler:
    """Per-parameter-group dynamic loss scaler for fp16 training.

    Args:
        optimizer: The (inner) optimizer whose ``param_groups`` get one scale each.
        device: Device of the scale tensors (that of the loss).
        init_scale: Initial scale of every group.
        growth_factor: Factor applied to a group's scale after ``growth_interval`` finite steps.
        backoff_factor: Factor applied to a group's scale when its gradients overflow.
        growth_interval: Finite steps of a group before its scale grows.
        enabled: When False every method is a pass-through, as for GradScaler.

    Example:
        >>> scaler = PerGroupGradScaler(optimizer, device="cuda")
        >>> with torch.autocast("cuda", dtype=torch.float16):
        ...     loss = model(batch).loss
        >>> scaler.scale(loss).backward()
        >>> scaler.step(optimizer)   # groups whose gradients overflowed are not updated
        >>> scaler.update()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ):
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1.0, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.optimizer = optimizer
        self._device = torch.device(device)
        self._enabled = enabled
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        n = len(optimizer.param_groups)
        self._scales = [
            torch.full((), init_scale, dtype=torch.float32, device=self._device) for _ in range(n)
        ]
        self._trackers = [torch.zeros((), dtype=torch.int32, device=self._device) for _ in range(n)]
        self._found_inf: list[torch.Tensor] | None = None  # per group, set by unscale_
        self._stepped = False
        self.overflow_counts = [0] * n  # host-side, filled by step()
        self.last_skipped_groups: list[int] = []

    # -- GradScaler interface -------------------------------------------------------------------------------
    def is_enabled(self) -> bool:
        return self._enabled

    def backward_scale(self) -> torch.Tensor:
        """The multiplier of this iteration's loss: the smallest group scale (a 0-d tensor on the device)."""
        if len(self._scales) == 1:
            return self._scales[0]
        return torch.stack(self._scales).min()

    def scale(self, outputs):
        """Multiply a loss (or a list/tuple of them) by :meth:`backward_scale`."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self.backward_scale().to(outputs.device, non_blocking=True)
        return type(outputs)(self.scale(o) for o in outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Divide every gradient by the backward scale in place and record an overflow flag per group.

        Raises:
            RuntimeError: if called twice before :meth:`update`.
        """
        if not self._enabled:
            return
        if self._found_inf is not None:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        optimizer = optimizer or self.optimizer
        # fp64 reciprocal, as GradScaler, so that single-group results match it bit for bit
        scale = self.backward_scale()
        inv_scale = scale.reciprocal() if self._device.type == "mps" else scale.double().reciprocal().float()
        self._found_inf = [self._unscale_group(g, inv_scale) for g in optimizer.param_groups]

    def _unscale_group(self, group: dict[str, Any], inv_scale: torch.Tensor) -> torch.Tensor:
        found = torch.zeros((), dtype=torch.float32, device=self._device)
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for p in group["params"]:
            if p.grad is not None:
                buckets[(p.grad.device, p.grad.dtype)].append(p.grad)
        with torch.no_grad():
            for (device, _), grads in buckets.items():
                local = found if device == self._device else torch.zeros((), device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, local, inv_scale.to(device))
                if local is not found:
                    found += local.to(self._device)
        return found

    def found_inf_per_group(self) -> list[torch.Tensor] | None:
        """This iteration's overflow flags (0-d tensors, 1.0 = overflow), or None before ``unscale_``."""
        return self._found_inf

    def step(self, optimizer: torch.optim.Optimizer | None = None, *args, **kwargs):
        """Unscale if needed, then step the inner optimizer on the groups whose gradients are finite.

        Returns:
            What ``optimizer.step`` returned, or None when every group overflowed (no step taken).
        """
        optimizer = optimizer or self.optimizer
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported by PerGroupGradScaler.")
        if self._stepped:
            raise RuntimeError("step() has already been called since the last update().")
        if self._found_inf is None:
            self.unscale_(optimizer)
        flags = torch.stack(self._found_inf).cpu().tolist()  # the one host sync, as in GradScaler
        self.last_skipped_groups = [i for i, f in enumerate(flags) if f]
        self._stepped = True
        for i in self.last_skipped_groups:
            self.overflow_counts[i] += 1
            for p in optimizer.param_groups[i]["params"]:
                p.grad = None  # only this group's update is dropped
        if len(self.last_skipped_groups) == len(flags):
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Back off the scale of each group that overflowed this iteration, grow the others on schedule.

        Args:
            new_scale: Set every group's scale to this value instead.
        """
        if not self._enabled:
            return
        if new_scale is not None:
            for s in self._scales:
                s.fill_(float(new_scale))
        else:
            if self._found_inf is None:
                raise RuntimeError("No inf checks were recorded prior to update().")
            for scale, tracker, found in zip(self._scales, self._trackers, self._found_inf):
                torch._amp_update_scale_(
                    scale, tracker, found, self._growth_factor, self._backoff_factor, self._growth_interval
                )
        self._found_inf = None
        self._stepped = False

    def get_scale(self) -> float:
        """The backward scale as a Python float (a host sync, like ``GradScaler.get_scale``)."""
        return float(self.backward_scale().item()) if self._enabled else 1.0

    def get_scales(self) -> list[float]:
        """Every group's scale (a host sync)."""
        return torch.stack(self._scales).cpu().tolist()

    def scales_tensor(self) -> torch.Tensor:
        """Every group's scale as one device tensor (no sync), for asynchronous telemetry."""
        return torch.stack(self._scales)

    def state_dict(self) -> dict[str, Any]:
        """Scales, growth trackers, factors and overflow counts, as Python numbers."""
        if not self._enabled:
            return {}
        return {
            "scales": self.get_scales(),
            "growth_trackers": [int(t.item()) for t in self._trackers],
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "overflow_counts": list(self.overflow_counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the number of groups must match.

        Raises:
            ValueError: if the saved state has another number of parameter groups.
        """
        if not self._enabled or not state:
            return
        if len(state["scales"]) != len(self._scales):
            raise ValueError(
                f"scaler state has {len(state['scales'])} parameter groups, the optimizer {len(self._scales)}"
            )
        for s, v in zip(self._scales, state["scales"]):
            s.fill_(v)
        for t, v in zip(self._trackers, state["growth_trackers"]):
            t.fill_(v)
        self._growth_factor = state["growth_factor"]
        self._backoff_factor = state["backoff_factor"]
        self._growth_interval = state["growth_interval"]
        self.overflow_counts = list(state.get("overflow_counts", [0] * len(self._scales)))
