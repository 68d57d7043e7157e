"""Sensitivity pass: each layer's error in low precision against fp32, on real activations.

One fp32 forward/backward of the whole model records every layer's inputs and the gradient arriving at its
output. Each layer is then re-run alone on those recorded inputs, once in fp32 and once under autocast in
the low precision, and the two are compared: output, gradient of the layer's input and gradients of its
parameters. Re-running each layer on the fp32 inputs isolates the layer's own error instead of the error
accumulated by the layers before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rapidfire_hf.precision.metrics import first_tensor
from rapidfire_hf.precision.schedule import Precision, _cast_floats, original_forward


@dataclass
class LayerSensitivity:
    """One row of the sensitivity table.

    Attributes:
        name: Module name of the layer.
        output_error: ``||y_low - y_fp32|| / ||y_fp32||`` of the layer output (inf when not finite).
        grad_error: The same relative error over the input and parameter gradients.
        precision: The precision the schedule chose for the layer.
    """

    name: str
    output_error: float
    grad_error: float
    precision: str = ""

    @property
    def error(self) -> float:
        return max(self.output_error, self.grad_error)


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if type(obj) in (tuple, list):
        return type(obj)(_detach(o) for o in obj)
    if type(obj) is dict:
        return {k: _detach(v) for k, v in obj.items()}
    return obj


def _relative_error(low: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    num = den = 0.0
    for a, b in zip(low, ref):
        if a is None or b is None:
            continue
        a, b = a.detach().float(), b.detach().float()
        if not torch.isfinite(a).all():
            return math.inf
        num += (a - b).pow(2).sum().item()
        den += b.pow(2).sum().item()
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def _with_leaf_input(args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.Tensor | None]:
    """Copies of args/kwargs where the first floating tensor (the hidden state) is a leaf requiring grad."""
    args, kwargs = list(args), dict(kwargs)
    for container, keys in ((args, range(len(args))), (kwargs, list(kwargs))):
        for k in keys:
            v = container[k]
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                container[k] = v.detach().clone().requires_grad_(True)
                return tuple(args), kwargs, container[k]
    return tuple(args), kwargs, None


def _run_layer(module: nn.Module, inputs, grad_out: torch.Tensor, precision: Precision, device_type: str):
    # recorded inputs are low precision when the model's forward re-enters autocast (accelerate wraps it)
    args, kwargs = _cast_floats(inputs[0], torch.float32), _cast_floats(inputs[1], torch.float32)
    args, kwargs, x = _with_leaf_input(args, kwargs)
    if precision is Precision.FP32:
        ctx = torch.autocast(device_type, enabled=False)
    else:
        ctx = torch.autocast(device_type, dtype=precision.dtype)
    with ctx:
        out = first_tensor(original_forward(module)(*args, **kwargs))
    targets = ([x] if x is not None else []) + [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, targets, grad_outputs=grad_out.to(out.dtype), allow_unused=True)
    return out, list(grads)


def default_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Causal-LM loss with ``labels = input_ids`` when the batch has no labels; else the mean squared output."""
    batch = dict(batch)
    if "labels" not in batch and "input_ids" in batch:
        batch["labels"] = batch["input_ids"]
    if getattr(model, "config", None) is not None:
        batch.setdefault("use_cache", False)  # a KV cache would be mutated by the recorded calls
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = first_tensor(out).float().pow(2).mean()
    return loss


def measure_sensitivity(
    model: nn.Module,
    batch: Mapping[str, Any],
    layers: Mapping[str, nn.Module],
    low: Precision,
    loss_fn: Callable[[nn.Module, Mapping[str, Any]], torch.Tensor] | None = None,
) -> list[LayerSensitivity]:
    """Relative error of each layer in ``low`` precision against fp32, on one batch.

    Args:
        model: The model, with fp32 parameters (mixed-precision training keeps fp32 master weights).
        batch: Keyword arguments of the model's forward (``input_ids``, ``attention_mask``, ...).
        layers: Layers to measure, e.g. from :func:`~rapidfire_hf.precision.schedule.find_layers`.
        low: The low precision to test (``bf16`` or ``fp16``).
        loss_fn: ``loss_fn(model, batch) -> loss``; default :func:`default_loss`.

    Returns:
        One :class:`LayerSensitivity` per layer, in the order of ``layers``.

    Raises:
        ValueError: if a measured layer's parameters are not fp32 (there is no fp32 reference then).
    """
    for name, module in layers.items():
        if any(p.dtype != torch.float32 for p in module.parameters()):
            raise ValueError(f"sensitivity pass needs fp32 parameters; layer {name!r} has others")
    inputs: dict[str, tuple] = {}
    outputs: dict[str, torch.Tensor] = {}

    def pre_hook(name):
        def hook(module, args, kwargs):
            inputs[name] = (_detach(args), _detach(kwargs))

        return hook

    def post_hook(name):
        def hook(module, args, kwargs, out):
            outputs[name] = first_tensor(out)

        return hook

    handles = []
    for name, module in layers.items():
        handles.append(module.register_forward_pre_hook(pre_hook(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook(name), with_kwargs=True))
    was_training = model.training
    model.eval()  # no dropout: both runs must see the same function
    try:
        with torch.autocast(_device_type(model), enabled=False):
            loss = (loss_fn or default_loss)(model, batch)
        names = [n for n in layers if n in outputs and outputs[n].requires_grad]
        grads = torch.autograd.grad(loss, [outputs[n] for n in names], allow_unused=True)
        rows = [_compare(n, layers[n], inputs[n], g, low, _device_type(model)) for n, g in zip(names, grads)]
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return rows


def _compare(name, module, inputs, grad_out, low: Precision, device_type: str) -> LayerSensitivity:
    if grad_out is None:
        return LayerSensitivity(name, 0.0, 0.0)
    # Unit-RMS output gradient: the real one is tiny (a mean over tokens) and would underflow in fp16,
    # which is the loss scaler's job to prevent, not a property of the layer.
    rms = grad_out.float().pow(2).mean().sqrt().clamp_min(1e-30)
    grad_out = (grad_out.float() / rms).detach()
    ref_out, ref_grads = _run_layer(module, inputs, grad_out, Precision.FP32, device_type)
    low_out, low_grads = _run_layer(module, inputs, grad_out, low, device_type)
    return LayerSensitivity(
        name,
        output_error=_relative_error([low_out], [ref_out]),
        grad_error=_relative_error(low_grads, ref_grads),
    )


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def sensitivity_table(rows: list[LayerSensitivity], threshold: float, title: str = "layer sensitivity"):
    """A ``rich.table.Table`` of the rows, marking those above ``threshold``."""
    from rich.table import Table

    table = Table(title=f"{title} (threshold {threshold:g})")
    for col in ("layer", "output rel. err", "grad rel. err", "precision"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for r in rows:
        style = "bold red" if r.error > threshold else None
        table.add_row(r.name, f"{r.output_error:.2e}", f"{r.grad_error:.2e}", r.precision, style=style)
    return table


def render_table(table) -> str:
    """Plain-text rendering of a rich table, for the logger and for files."""
    from rich.console import Console

    console = Console(width=120, record=True, force_terminal=False, color_system=None)
    with console.capture() as capture:
        console.print(table)
    return capture.get()
