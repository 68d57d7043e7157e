"""Training-fault injection: errors raised from inside forward or backward at a chosen call.

Everything here raises the real exception types the code under test handles; nothing mocks it.
"""

from __future__ import annotations

import functools

import torch

# ---- out-of-memory injection ------------------------------------------------------------------------


def _input_shape(args, kwargs) -> tuple[int, ...]:
    """Shape of a forward call's ``input_ids`` / ``inputs_embeds`` (keyword or first argument)."""
    for key in ("input_ids", "inputs_embeds"):
        value = kwargs.get(key)
        if value is not None:
            return tuple(value.shape)
    return tuple(args[0].shape)


class OOMInjector:
    """Raises ``torch.OutOfMemoryError`` from a module's forward pre-hook on the calls ``when`` picks.

    ``when(call, rows, grad)`` sees the 1-based number of the call among those that match ``grad``
    (``True``: only gradient-tracking forwards; ``False``: only no-grad ones; ``None``: all), the rows of
    the call and whether gradients are on. ``raised`` counts the errors raised, ``calls`` the matching
    calls, ``rows`` and ``shapes`` the row count and input shape of each matching call.

    Example:
        >>> oom = OOMInjector(decoder, lambda call, rows, grad: rows > 2, grad=True)  # doctest: +SKIP
    """

    def __init__(self, module, when, grad: bool | None = True):
        self.when, self.grad = when, grad
        self.calls, self.raised, self.rows, self.shapes = 0, 0, [], []
        self.active = True  # inactive calls are neither counted nor failed (see only_during)
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        grad = torch.is_grad_enabled()
        if not self.active or (self.grad is not None and grad != self.grad):
            return
        self.calls += 1
        shape = _input_shape(args, kwargs)
        rows = shape[0]
        self.rows.append(rows)
        self.shapes.append(shape)
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


def only_during(injector: OOMInjector, obj, name: str) -> OOMInjector:
    """Make ``injector`` count and fail only calls made while ``obj.name(...)`` runs (e.g. only the
    forwards of ``PPOTrainer.optimize``, not those of a calibration pass before it)."""
    method = getattr(obj, name)

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        injector.active = True
        try:
            return method(*args, **kwargs)
        finally:
            injector.active = False

    injector.active = False
    setattr(obj, name, wrapped)
    return injector


# ---- non-finite values ------------------------------------------------------------------------------


def nan_reward(reward_fn, calls=None):
    """``reward_fn`` whose scores are all NaN on the calls numbered ``calls`` (1-based; None: every call).

    ``wrapped.calls`` counts the calls, ``wrapped.poisoned`` those that returned NaN.
    """
    chosen = None if calls is None else set(calls)

    def wrapped(*args, **kwargs):
        wrapped.calls += 1
        scores = reward_fn(*args, **kwargs)
        if chosen is None or wrapped.calls in chosen:
            wrapped.poisoned += 1
            return [float("nan")] * len(scores)
        return scores

    wrapped.calls, wrapped.poisoned = 0, 0
    wrapped.__name__ = getattr(reward_fn, "__name__", "reward")
    return wrapped


def scale_loss_at(step: int, factor: float):
    """An ``inject(step, loss, model)`` for tests/optim/helpers.train: the loss times ``factor`` at ``step``
    (``float("nan")`` gives a NaN loss and NaN gradients, 1000 a 1000x spike of both)."""

    def inject(s, loss, model):
        return loss * factor if s == step else loss

    return inject


def add_to_loss_at(steps, value: float):
    """An ``inject`` that adds ``value`` to the loss at each of ``steps``: the loss jumps (or is NaN for
    ``float("nan")``) while the gradients stay those of the clean batch."""
    chosen = set(steps) if not isinstance(steps, int) else {steps}

    def inject(s, loss, model):
        return loss + value if s in chosen else loss

    return inject


def inf_in_grad_at(step: int, param: torch.Tensor):
    """An ``inject`` that puts ``inf`` into one element of ``param``'s gradient at ``step`` (once), the loss
    staying finite."""

    def inject(s, loss, model):
        if s == step:
            fired = []

            def corrupt(grad):
                if fired:
                    return grad
                fired.append(True)
                return grad.index_fill(0, torch.tensor([0]), float("inf"))

            param.register_hook(corrupt)
        return loss

    return inject


def nan_observed_loss(optimizer, calls):
    """Make ``optimizer.observe_loss`` see a NaN on the calls numbered ``calls`` (1-based), once each: the
    health rules fail for that window while its gradients stay clean (a fault the verification catches
    and nothing else). ``optimizer.poisoned`` counts the NaNs handed over."""
    chosen, observe = set(calls), optimizer.observe_loss
    count = [0]

    def observe_loss(loss):
        count[0] += 1
        if count[0] in chosen:
            optimizer.poisoned += 1
            loss = loss * float("nan")
        observe(loss)

    optimizer.poisoned = 0
    optimizer.observe_loss = observe_loss
    return optimizer
