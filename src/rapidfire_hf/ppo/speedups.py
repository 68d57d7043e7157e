"""Opt-in kernel speed-ups of the trained and frozen models: Liger kernels and per-layer ``torch.compile``.

``PPOConfig(use_liger_kernel=True)`` patches the policy, the separate value model and the reference
model with Liger's Triton kernels (RMSNorm, SwiGLU MLP, RoPE for Llama), instance by instance and once
per model. ``PPOConfig(torch_compile=True)`` compiles every decoder layer of the same models
(``layer.compile()``: one graph per layer type, reused by all layers), with ``torch_compile_backend``
and ``torch_compile_mode``. Both serve scoring and training; the rollout runs the models' own kernels
(:meth:`KernelPatches.original` undoes both while generating: the static engine compiles and records its
own decode step, and ``model.generate`` would recompile compiled layers for every new cache length).

``PPOTrainer`` does not subclass ``transformers.Trainer`` (whose ``train()`` applies Liger to
``self.model`` when ``use_liger_kernel`` is set), so nothing else patches these models; the trainer's
``PolicyAndValue`` wrapper is not a transformers model and Liger's own dispatcher would skip it without a
word, which is why each transformers model is patched here and the patch is checked.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from rapidfire_hf.models import decoder_layers as _decoder_layers
from rapidfire_hf.models import unwrap_peft
from rapidfire_hf.utils.imports import is_available

logger = logging.getLogger(__name__)

# what PPO needs untouched: per-token log-probs come from the LM head, never from a fused loss
_LIGER_FORCED_OFF = ("fused_linear_cross_entropy", "cross_entropy")
# dynamo's per-code-object recompile limit (default 8): the decoder layers of policy, value and reference
# model share one code object, with graphs for grad / no-grad, batch shapes and (LoRA) adapter on/off
RECOMPILE_LIMIT = 64


@dataclass
class KernelPatches:
    """What the speed-ups changed, so that the rollout can run without them and a benchmark can record them.

    Attributes:
        liger: per model role, ``{"model_type", "liger_modules", "already_patched"}``.
        compiled: per model role, the number of decoder layers compiled.
    """

    liger: dict[str, dict] = field(default_factory=dict)
    compiled: dict[str, int] = field(default_factory=dict)
    _forwards: list[tuple[nn.Module, object, object]] = field(default_factory=list, repr=False)
    _layers: list[tuple[nn.Module, object]] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        return {"liger": self.liger, "compiled_layers": self.compiled}

    def original(self) -> AbstractContextManager[None]:
        """Inside: the patched modules run their own ``forward`` and compiled layers run eagerly (a plain
        ``nullcontext`` when nothing is patched or compiled: there is nothing to undo)."""
        return self._unpatched() if self._forwards or self._layers else nullcontext()

    @contextmanager
    def _unpatched(self) -> Iterator[None]:
        for module, before, _ in self._forwards:
            _set_forward(module, before)
        for layer, _ in self._layers:
            layer._compiled_call_impl = None
        try:
            yield
        finally:
            for module, _, after in self._forwards:
                _set_forward(module, after)
            for layer, compiled in self._layers:
                layer._compiled_call_impl = compiled


def _set_forward(module: nn.Module, forward) -> None:
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = forward


def distinct_models(models: dict[str, nn.Module | None]) -> dict[str, nn.Module]:
    """``role -> transformers model`` (PEFT unwrapped), each model once (the first role naming it)."""
    out, seen = {}, set()
    for role, model in models.items():
        if model is None:
            continue
        base = unwrap_peft(model)
        if id(base) not in seen:
            seen.add(id(base))
            out[role] = base
    return out


# ------------------------------------------------------------------ Liger
def check_liger_usable(device: torch.device) -> None:
    """Raise a clear error when Liger kernels cannot run here (before any model is touched).

    Raises:
        ValueError: ``device`` is not a CUDA device (Liger's kernels are Triton kernels).
        ImportError: liger-kernel (or triton) is not installed.
    """
    if device.type != "cuda":
        raise ValueError(
            f"use_liger_kernel=True needs a CUDA GPU (Liger's kernels are Triton kernels), but the trainer runs "
            f"on {device.type!r}: set use_liger_kernel=False there."
        )
    if not is_available("liger_kernel"):
        raise ImportError(
            "use_liger_kernel=True needs the package `liger-kernel`, which is not installed. Install it with "
            "`pip install 'rapidfire_hf[liger]'` (or `pip install liger-kernel`)."
        )
    if not is_available("triton"):
        raise ImportError(
            "use_liger_kernel=True needs `triton`, which ships with the CUDA builds of torch: install a CUDA "
            "build of torch."
        )


def liger_kwargs(config: dict | None, compiled: bool = False) -> dict:
    """Liger options from ``TrainingArguments.liger_kernel_config``, with the fused (linear) cross-entropy
    off: PPO needs per-token log-probs, which a fused loss never materialises. With compiled layers, RoPE
    stays with the compiler unless the config asks for Liger's: Liger routes its RoPE through a dispatcher
    under ``torch.compiler.disable``, a graph break in every layer, and inductor fuses RoPE itself.

    Raises:
        ValueError: the config turns a cross-entropy kernel on.
    """
    config = dict(config or {})
    on = [k for k in _LIGER_FORCED_OFF if config.get(k)]
    if on:
        raise ValueError(
            f"liger_kernel_config turns on {on}: PPO computes per-token log-probs from the LM head, which "
            "Liger's fused cross-entropy kernels replace by a loss. Leave them off (RMSNorm, SwiGLU and RoPE "
            "are patched)."
        )
    if compiled:
        config.setdefault("rope", False)
    return {**config, **{k: False for k in _LIGER_FORCED_OFF}}


def _liger_module_count(model: nn.Module) -> int:
    """Modules whose forward is one of Liger's (instance-patched, or built from a Liger class)."""
    n = 0
    for m in model.modules():
        func = getattr(getattr(m, "forward", None), "__func__", None)
        if getattr(func, "__module__", "").startswith("liger_kernel."):
            n += 1
    return n


def apply_liger(
    models: dict[str, nn.Module | None], config: dict | None, patches: KernelPatches, compiled: bool = False
) -> None:
    """Patch each distinct transformers model in ``models`` (role -> model) with Liger's kernels, once
    (``compiled``: the layers will be compiled, see :func:`liger_kwargs`).

    A model whose modules already run Liger's kernels (patched before, by this trainer or by the user)
    is left as it is. Records in ``patches`` which instance ``forward`` changed.

    Raises:
        ValueError: a model type Liger has no kernels for, or a model without ``config.model_type``.
        RuntimeError: Liger's patch function ran but no module runs a Liger kernel afterwards.
    """
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    kwargs = liger_kwargs(config, compiled)
    targets = distinct_models(models)
    for role, base in targets.items():  # every check before the first patch
        model_type = getattr(getattr(base, "config", None), "model_type", None)
        if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            raise ValueError(
                f"use_liger_kernel=True: liger-kernel has no kernels for the {role} ({type(base).__name__}, "
                f"model_type={model_type!r}); supported: {sorted(k for k in MODEL_TYPE_TO_APPLY_LIGER_FN if k)}. "
                "Set use_liger_kernel=False."
            )
    for role, base in targets.items():
        model_type = base.config.model_type
        already = _liger_module_count(base)
        if already:
            logger.info("rapidfire: the %s already runs %d Liger modules; not patched again", role, already)
            patches.liger[role] = {
                "model_type": model_type,
                "liger_modules": already,
                "already_patched": True,
            }
            continue
        before = {m: m.__dict__.get("forward") for m in base.modules()}
        apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
        accepted = inspect.signature(apply_fn).parameters
        apply_fn(model=base, **{k: v for k, v in kwargs.items() if k in accepted})
        count = _liger_module_count(base)
        if count == 0:
            raise RuntimeError(
                f"use_liger_kernel=True: liger-kernel's {apply_fn.__name__} patched no module of the {role} "
                f"({type(base).__name__}); options {kwargs}."
            )
        for m, fwd in before.items():
            after = m.__dict__.get("forward")
            if after is not fwd:
                patches._forwards.append((m, fwd, after))
        patches.liger[role] = {
            "model_type": model_type,
            "liger_modules": count,
            "already_patched": False,
            "options": {k: v for k, v in kwargs.items() if k in accepted},
        }
        logger.info("rapidfire: Liger kernels on the %s (%s): %d modules", role, model_type, count)


# ------------------------------------------------------------------ torch.compile
def decoder_layers(model: nn.Module, role: str) -> nn.ModuleList:
    """The repeated decoder blocks of ``model`` (:func:`rapidfire_hf.models.decoder_layers`), checked for
    ``torch_compile``.

    Raises:
        TypeError: no non-empty ``layers`` ModuleList under the model's backbone.
    """
    try:
        layers = _decoder_layers(model)
    except TypeError:
        layers = None
    if layers is None or len(layers) == 0:
        raise TypeError(
            f"torch_compile=True compiles each decoder layer, but the {role} ({type(unwrap_peft(model)).__name__}) "
            "has no `layers` ModuleList under its backbone. Set torch_compile=False."
        )
    return layers


def compile_layers(
    models: dict[str, nn.Module | None], backend: str | None, mode: str | None, patches: KernelPatches
) -> None:
    """``layer.compile(backend, mode)`` for every decoder layer of each distinct model; a layer already
    compiled (e.g. a model reused by a second trainer) is left as it is."""
    targets = distinct_models(models)
    layer_lists = {role: decoder_layers(base, role) for role, base in targets.items()}  # checks first
    _raise_recompile_limit(RECOMPILE_LIMIT)
    options = {k: v for k, v in (("backend", backend), ("mode", mode)) if v is not None}
    for role, layers in layer_lists.items():
        n = 0
        for layer in layers:
            if layer._compiled_call_impl is None:
                layer.compile(**options)
                n += 1
            patches._layers.append((layer, layer._compiled_call_impl))
        patches.compiled[role] = n
        logger.info("rapidfire: compiled %d decoder layers of the %s (%s)", n, role, options or "inductor")


def all_sdpa(models: dict[str, nn.Module | None]) -> bool:
    """Whether every model attends through SDPA (the models :func:`sequence_inputs`' full mask is for)."""
    kinds = {
        role: getattr(getattr(base, "config", None), "_attn_implementation", None)
        for role, base in distinct_models(models).items()
    }
    if any(k != "sdpa" for k in kinds.values()):
        logger.info(
            "rapidfire: compiled layers with attention %s: batches with and without padding compile "
            "separate graphs (transformers drops the mask of unpadded batches)",
            kinds,
        )
        return False
    return True


def _raise_recompile_limit(limit: int) -> None:
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # the newer name first; old torch has the other
        if hasattr(dynamo_config, name):
            if getattr(dynamo_config, name) < limit:
                setattr(dynamo_config, name, limit)
            return
