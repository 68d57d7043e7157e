"""Building the inner optimizer (by name, class or instance) and per-parameter views of it."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable
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


class ParamStepper:
    """Steps one parameter with the inner optimizer, sharing its state and hyper-parameters.

    A shallow copy of the inner optimizer whose only param group is a view of the parameter's master
    group: the view re-reads the master group's hyper-parameters before each step, so LR schedulers
    (which change the master group's ``lr``) act on what actually steps, and the state dict is the
    master's own, so ``state_dict()`` sees every parameter. One stepper per parameter keeps hooks
    that run on different autograd threads from touching shared mutable objects.
    """

    def __init__(self, inner: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor):
        self._param = param
        self._master_group = group
        self._view = dict(group, params=[param])
        self._inner_view = copy.copy(inner)
        self._inner_view.param_groups = [self._view]

    def step(self) -> None:
        self._view.update(self._master_group)
        self._view["params"] = [self._param]
        self._inner_view.step()


def make_steppers(inner: torch.optim.Optimizer) -> dict[torch.Tensor, ParamStepper]:
    """One :class:`ParamStepper` per parameter of ``inner`` (keyed by the parameter tensor)."""
    steppers = {}
    for group in inner.param_groups:
        for p in group["params"]:
            steppers[p] = ParamStepper(inner, group, p)
    return steppers
