"""Training-fault injection: errors raised from inside forward or backward at a chosen call.

Everything here raises the real exception types the code under test handles; nothing mocks it.
"""

from __future__ import annotations

import torch

# ---- out-of-memory injection ------------------------------------------------------------------------


def _rows(args, kwargs) -> int:
    """Rows of a forward call: ``input_ids`` / ``inputs_embeds`` (keyword or first argument)."""
    for key in ("input_ids", "inputs_embeds"):
        value = kwargs.get(key)
        if value is not None:
            return value.shape[0]
    return args[0].shape[0]


class OOMInjector:
    """Raises ``torch.OutOfMemoryError`` from a module's forward pre-hook on the calls ``when`` picks.

    ``when(call, rows, grad)`` sees the 1-based number of the call among those that match ``grad``
    (``True``: only gradient-tracking forwards; ``False``: only no-grad ones; ``None``: all), the rows of
    the call and whether gradients are on. ``raised`` counts the errors raised, ``calls`` the matching
    calls, ``rows`` the row count of each matching call.

    Example:
        >>> oom = OOMInjector(decoder, lambda call, rows, grad: rows > 2, grad=True)  # doctest: +SKIP
    """

    def __init__(self, module, when, grad: bool | None = True):
        self.when, self.grad = when, grad
        self.calls, self.raised, self.rows = 0, 0, []
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        grad = torch.is_grad_enabled()
        if self.grad is not None and grad != self.grad:
            return
        self.calls += 1
        rows = _rows(args, kwargs)
        self.rows.append(rows)
        if self.when(self.calls, rows, grad):
            self.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: call {self.calls}, {rows} rows)")

    def remove(self) -> None:
        self.handle.remove()


def oom_above_rows(module, max_rows: int, grad: bool | None = True) -> OOMInjector:
    """OOM on every matching forward of ``module`` with more than ``max_rows`` rows."""
    return OOMInjector(module, lambda call, rows, g: rows > max_rows, grad=grad)


def oom_on_calls(module, calls, grad: bool | None = True) -> OOMInjector:
    """OOM on the matching forwards of ``module`` numbered ``calls`` (1-based), once each."""
    chosen = set(calls)
    return OOMInjector(module, lambda call, rows, g: call in chosen, grad=grad)


def oom_in_backward(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, with a hook that raises ``torch.OutOfMemoryError`` when backward reaches it."""

    def fail(grad):
        raise torch.OutOfMemoryError("CUDA out of memory (injected, in backward)")

    tensor.register_hook(fail)
    return tensor
