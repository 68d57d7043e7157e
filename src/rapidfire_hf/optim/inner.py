"""Building the inner optimizer (by name, class or instance) and bucket views of it for the pipeline."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rapidfire_hf.utils.imports import require

# name -> (module that defines it or None for torch, class name, fixed keyword arguments)
INNER_OPTIMIZERS: dict[str, tuple[str | None, str, dict[str, Any]]] = {
    "adamw": (None, "AdamW", {}),
    "sgd": (None, "SGD", {}),
    "adamw8bit": ("bitsandbytes", "AdamW8bit", {}),
    "paged_adamw8bit": ("bitsandbytes", "PagedAdamW8bit", {}),
}


def resolve_inner_class(spec: str | type) -> type:
    """The inner optimizer class for ``spec`` (a name of :data:`INNER_OPTIMIZERS` or a class).

    Raises:
        ValueError: ``spec`` is a name that is not known (the message lists the choices).
        ImportError: the name needs bitsandbytes and it is not installed (the message names the extra).
        TypeError: ``spec`` is a class that is not a ``torch.optim.Optimizer``.
    """
    if isinstance(spec, str):
        key = spec.lower()
        if key not in INNER_OPTIMIZERS:
            raise ValueError(
                f"Unknown inner optimizer {spec!r}; choose one of {sorted(INNER_OPTIMIZERS)}, "
                "pass a torch.optim.Optimizer subclass, or an optimizer instance."
            )
        module_name, class_name, _ = INNER_OPTIMIZERS[key]
        if module_name is None:
            return getattr(torch.optim, class_name)
        module = require(module_name, f"RapidFireOptimizer(optimizer={spec!r})")
        return getattr(module.optim, class_name)
    if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
        return spec
    raise TypeError(f"optimizer must be a name, a torch.optim.Optimizer subclass or instance; got {spec!r}")


def check_inner_kwargs(cls: type, kwargs: dict[str, Any]) -> None:
    """Reject keyword arguments that ``cls`` does not take, before any weight exists to be changed.

    Raises:
        TypeError: one or more names are not parameters of ``cls.__init__``.
    """
    sig = inspect.signature(cls.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    unknown = sorted(set(kwargs) - set(sig.parameters) - {"self"})
    if unknown:
        allowed = sorted(n for n in sig.parameters if n not in ("self", "params"))
        raise TypeError(
            f"RapidFireOptimizer got keyword arguments {unknown} that neither it nor the inner "
            f"optimizer {cls.__name__} accepts. {cls.__name__} accepts: {allowed}."
        )


def _kernel_kwargs(cls: type, name: str | None, fused: bool | None, on_cuda: bool) -> dict[str, Any]:
    """``fused``/``foreach`` choice for torch optimizers: fused on CUDA, foreach elsewhere by default."""
    params = inspect.signature(cls.__init__).parameters
    if fused is True:
        if "fused" not in params:
            raise ValueError(
                f"enable_fused_kernels=True, but {cls.__name__} has no fused implementation; "
                "use optimizer='adamw' or leave enable_fused_kernels unset."
            )
        return {"fused": True}
    if fused is False:
        return {k: False for k in ("fused", "foreach") if k in params}
    if name == "adamw":
        return {"fused": True} if on_cuda else {"foreach": True}
    return {}


def build_inner(
    spec: str | type, param_groups: list[dict[str, Any]], kwargs: dict[str, Any], fused: bool | None
) -> torch.optim.Optimizer:
    """Construct the inner optimizer over ``param_groups`` with ``kwargs`` as its defaults."""
    cls = resolve_inner_class(spec)
    name = spec.lower() if isinstance(spec, str) else None
    on_cuda = any(p.is_cuda for g in param_groups for p in g["params"])
    fixed = INNER_OPTIMIZERS[name][2] if name else {}
    return cls(param_groups, **fixed, **_kernel_kwargs(cls, name, fused, on_cuda), **kwargs)


def normalize_param_groups(params: Iterable) -> list[dict[str, Any]]:
    """``model.parameters()`` or a list of param-group dicts -> a list of param-group dicts."""
    items = list(params)
    if not items:
        raise ValueError("RapidFireOptimizer got an empty parameter list.")
    if isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


class BucketStepper:
    """Steps a bucket of parameters of one param group with ONE call of the inner optimizer.

    A shallow copy of the inner optimizer whose only param group is a view of the bucket's master
    group: the view re-reads the master group's hyper-parameters before each step, so LR schedulers
    (which change the master group's ``lr``) act on what actually steps, and the state dict is the
    master's own, so ``state_dict()`` sees every parameter. One call over the whole view lets a
    foreach/fused optimizer run one multi-tensor kernel for the bucket; optimizers that loop over
    their parameters in Python (SGD without foreach, bitsandbytes) work unchanged, since nothing here
    depends on how the inner ``step()`` is implemented, only that it updates each parameter from its
    own gradient and state.

    One stepper per bucket keeps hooks that run on different autograd threads from sharing a mutable
    view; the lock covers the rare case of one bucket stepped from two threads (a parameter whose
    gradient arrives again after its bucket was stepped in the same window).

    Args:
        inner: the inner optimizer (its ``state`` dict and hyper-parameters are shared, not copied).
        group: the master param group (a dict of ``inner.param_groups``) the parameters belong to.
        params: the parameters of the bucket, all of ``group``.
    """

    def __init__(self, inner: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor]):
        self.params = list(params)
        self._master_group = group
        self._view = dict(group, params=self.params)
        # a copy of the whole instance dict: copy.copy would go through torch.optim.Optimizer's
        # __getstate__, which keeps only defaults/state/param_groups and drops what other optimizers
        # set in __init__ (bitsandbytes' ``initialized``: AttributeError at the first step, seen on H200)
        self._inner_view = object.__new__(type(inner))
        self._inner_view.__dict__.update(inner.__dict__)
        # an LR scheduler built on the inner instance wraps ``step`` as an instance attribute bound to
        # the original optimizer: the copy must call its own class's step, over its own view
        self._inner_view.__dict__.pop("step", None)
        self._inner_view.param_groups = [self._view]
        self._lock = threading.Lock()

    def step(self, params: list[torch.Tensor] | None = None) -> None:
        """One inner ``step()`` over ``params`` (default: the whole bucket)."""
        with self._lock:
            self._view.update(self._master_group)
            self._view["params"] = self.params if params is None else list(params)
            self._inner_view.step()


def grad_nbytes(p: torch.Tensor) -> int:
    """Bytes of ``p``'s gradient (same shape and dtype as the parameter)."""
    return p.numel() * p.element_size()


def plan_buckets(
    inner: torch.optim.Optimizer,
    segments: list[list[torch.Tensor]],
    bucket_bytes: float,
    hooked: Callable[[torch.Tensor], bool],
) -> list[tuple[int, list[torch.Tensor]]]:
    """Cut the parameters of ``inner`` into buckets of about ``bucket_bytes`` of gradient.

    ``segments`` lists the parameters in the order their gradients are expected to be ready (a
    parameter of ``inner`` missing from every segment is appended, in reverse registration order, as a
    last segment); a bucket never spans two segments. Walking that order, each parameter joins the open
    bucket of its (param group, device, hooked) key, and a bucket closes once it holds at least
    ``bucket_bytes`` (so ``0`` gives one parameter per bucket). Parameters without a hook (``hooked``
    False: frozen when the hooks were registered) get buckets of their own, which are only ever stepped
    as leftovers in ``step()``.

    Returns:
        ``(param group index, params)`` per bucket, in the order they are expected to complete.
    """
    group_of = {p: gi for gi, g in enumerate(inner.param_groups) for p in g["params"]}
    seen: set[torch.Tensor] = set()
    cleaned = []
    for segment in segments:
        kept = [p for p in segment if p in group_of and p not in seen]
        seen.update(kept)
        cleaned.append(kept)
    cleaned.append([p for p in reversed(list(group_of)) if p not in seen])
    buckets: list[tuple[int, list[torch.Tensor]]] = []
    for segment in cleaned:
        open_buckets: dict[tuple, tuple[list[torch.Tensor], list[int]]] = {}
        for p in segment:
            key = (group_of[p], p.device, bool(hooked(p)))
            params, size = open_buckets.setdefault(key, ([], [0]))
            params.append(p)
            size[0] += grad_nbytes(p)
            if size[0] >= bucket_bytes:
                buckets.append((key[0], params))
                del open_buckets[key]
        buckets.extend((key[0], params) for key, (params, _) in open_buckets.items())
    return buckets
