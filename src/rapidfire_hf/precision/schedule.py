"""Per-layer precision: which modules are "layers", and how one runs in another precision.

A layer's precision is changed by replacing its ``forward`` with a :class:`LayerPrecision` wrapper (the
same instance-attribute technique accelerate uses for ``autocast``): the wrapper casts floating inputs to
fp32 and runs the original forward under ``torch.autocast`` set to the layer's precision, or with autocast
disabled for fp32. Parameters stay where they are (fp32 master weights under mixed precision), so the
optimizer, ``state_dict`` and checkpoints do not see the change.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch
from torch import nn


class Precision(str, Enum):
    """Compute precisions, spelled as in the rapidfire config (``precision.initial``)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]

    @property
    def rank(self) -> int:
        """Range/accuracy order used to decide what "higher precision" means: fp16 < bf16 < fp32."""
        return {"fp16": 0, "bf16": 1, "fp32": 2}[self.value]


def accelerator_precision(accelerator) -> str:
    """The precision an ``Accelerator``'s own autocast runs in: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (the
    base precision of a trainer driven by it; ``PPOTrainer`` and ``enable_rapidfire`` both start the
    precision plugin in it)."""
    return {"bf16": "bf16", "fp16": "fp16"}.get(str(accelerator.mixed_precision), "fp32")


LOW_DTYPES = (torch.float16, torch.bfloat16)


def find_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's "layers": the children of each ``nn.ModuleList`` that hold a Linear, plus Linears outside them.

    For a Hugging Face decoder this gives ``model.layers.0 ... model.layers.N-1`` and ``lm_head``: the
    granularity at which the sensitivity pass measures and the schedule switches.

    Args:
        model: Any module.

    Returns:
        Module name (as in ``named_modules``) to module, in forward order of registration.
    """
    layers: dict[str, nn.Module] = {}
    covered: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in covered or not isinstance(module, nn.ModuleList):
            continue
        for i, child in enumerate(module):
            if any(isinstance(m, nn.Linear) for m in child.modules()):
                layers[f"{name}.{i}" if name else str(i)] = child
                covered.update(id(m) for m in child.modules())
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in covered:
            layers[name] = module
    return layers


def logprob_path(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that turn a causal LM's last hidden state into logits: its final norm and output head.

    Found for every causal LM inside ``model`` (the model itself, or one it wraps: PPO's policy+value
    module, a PEFT model), through ``get_output_embeddings()`` and ``get_decoder().norm``. Log-probs
    compared across two forwards (PPO's ratio ``exp(logp_new - logp_old)``) are only as exact as these
    two modules: bf16 logits carry a rounding error of up to ``|logit| * 2**-9`` per entry.

    Args:
        model: Any module.

    Returns:
        Module name (as in ``named_modules``) to module, norms before heads; empty when there is no head.
    """
    names = {id(m): n for n, m in model.named_modules()}
    norms: dict[str, nn.Module] = {}
    heads: dict[str, nn.Module] = {}
    for module in model.modules():
        head = _call_getter(module, "get_output_embeddings")
        if not isinstance(head, nn.Module) or id(head) not in names:
            continue
        heads[names[id(head)]] = head
        decoder = _call_getter(module, "get_decoder")
        norm = getattr(decoder, "norm", None)
        if isinstance(norm, nn.Module) and id(norm) in names:
            norms[names[id(norm)]] = norm
    return {**norms, **heads}


def _call_getter(module: nn.Module, name: str):
    getter = getattr(module, name, None)
    if not callable(getter):
        return None
    try:
        return getter()
    except (AttributeError, NotImplementedError, TypeError):  # models that do not implement it
        return None


def check_untied_low_precision(model: nn.Module, path: dict[str, nn.Module]) -> None:
    """Refuse an fp32 log-prob ``path`` whose module shares a low-precision weight with another module.

    Raises:
        ValueError: a head shares its fp16/bf16 weight (``tie_word_embeddings``): running it in fp32 would
            convert the input embedding too and break forwards without autocast (the rollout engine).
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    for name, module in path.items():
        tied = [p for p in module.parameters(recurse=False) if owners[id(p)] > 1 and p.dtype != torch.float32]
        if tied:
            raise ValueError(
                f"{name} shares its {tied[0].dtype} weight with another module (tied input/output "
                "embeddings): an fp32 log-prob path would convert the input embedding too and break "
                "forwards without autocast. Keep fp32 master weights (mixed precision) or untie it."
            )


def match_modules(model: nn.Module, pattern: str) -> dict[str, nn.Module]:
    """Modules whose name matches ``pattern`` (exact name or ``fnmatch`` glob such as ``model.layers.*.mlp``)."""
    return {n: m for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern)}


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    # exact types only: a ModelOutput (a dict subclass) or a namedtuple must keep its type
    if type(obj) is tuple:
        return tuple(_cast_floats(o, dtype) for o in obj)
    if type(obj) is list:
        return [_cast_floats(o, dtype) for o in obj]
    if type(obj) is dict:
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj  # caches, None, ints, model outputs: left alone


def _first_float_dtype(objs: Iterable[Any]) -> torch.dtype | None:
    for obj in objs:
        if isinstance(obj, torch.Tensor) and obj.is_floating_point():
            return obj.dtype
    return None


class LayerPrecision:
    """Callable that replaces ``module.forward`` to run it in ``precision``.

    Args:
        forward: The module's original bound ``forward``.
        precision: Precision to compute in.
        device_type: ``"cuda"`` or ``"cpu"``, for ``torch.autocast``.
        cast_back: Cast floating outputs back to the input dtype when that was fp16/bf16. True for blocks
            inside a ``ModuleList`` (the next block expects that dtype in a pure low-precision model); False
            for heads, whose fp32 output (e.g. logits for log-probs) is the point of running them in fp32.
    """

    def __init__(self, forward, precision: Precision, device_type: str, cast_back: bool):
        self.forward = forward
        self.precision = Precision(precision)
        self.device_type = device_type
        self.cast_back = cast_back

    def __call__(self, *args, **kwargs):
        in_dtype = _first_float_dtype(list(args) + list(kwargs.values()))
        # Inputs go to fp32 so that the autocast region (or the fp32 region) decides the compute dtype,
        # not an fp16 tensor produced by the surrounding region.
        args, kwargs = _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)
        if self.precision is Precision.FP32:
            ctx = torch.autocast(self.device_type, enabled=False)
        else:
            ctx = torch.autocast(self.device_type, dtype=self.precision.dtype)
        with ctx:
            out = self.forward(*args, **kwargs)
        if self.cast_back and in_dtype in LOW_DTYPES:
            out = _cast_floats(out, in_dtype)
        return out


def set_layer_precision(
    module: nn.Module, precision: Precision | None, cast_back: bool
) -> list[nn.Parameter]:
    """Install (or, with ``precision=None``, remove) the :class:`LayerPrecision` wrapper of ``module``.

    Parameters stored in fp16/bf16 (a pure low-precision model) are converted to fp32 when the layer goes
    to fp32, because an fp32 matmul cannot take a bf16 weight; those parameters are returned so that the
    caller can convert the optimizer state that belongs to them.

    Args:
        module: The layer.
        precision: Target precision, or None to restore the original forward.
        cast_back: See :class:`LayerPrecision`.

    Returns:
        Parameters whose dtype changed.
    """
    current = module.__dict__.get("forward")
    if precision is None:
        if isinstance(current, LayerPrecision):
            del module.forward
        return []
    if isinstance(current, LayerPrecision):
        current.precision = Precision(precision)
    else:
        param = next(module.parameters(), None)
        device_type = param.device.type if param is not None else "cpu"
        module.forward = LayerPrecision(module.forward, precision, device_type, cast_back)
    changed = []
    if Precision(precision) is Precision.FP32:
        for p in module.parameters():
            if p.dtype in LOW_DTYPES:
                p.data = p.data.float()
                changed.append(p)
    return changed


def layer_precision(module: nn.Module) -> Precision | None:
    """The precision installed on ``module`` by :func:`set_layer_precision`, or None."""
    current = module.__dict__.get("forward")
    return current.precision if isinstance(current, LayerPrecision) else None


def original_forward(module: nn.Module):
    """The module's forward without a :class:`LayerPrecision` wrapper (used by the sensitivity pass)."""
    current = module.__dict__.get("forward")
    return current.forward if isinstance(current, LayerPrecision) else module.forward
