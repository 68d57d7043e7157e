"""Selective activation checkpointing for Hugging Face models, chosen by recompute cost, without editing
their code.

HF decoder layers (``GradientCheckpointingLayer``) run through ``torch.utils.checkpoint.checkpoint`` with
the keyword arguments given to ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before
transformers 5.2x). We pass a ``context_fn`` built with torch's selective-checkpoint API
(``create_selective_checkpoint_contexts``) whose policy looks at each op inside a layer and asks what it
costs to recompute one byte of its output: ``FLOPs per output element / bytes per element``.

- a matmul ``[M, K] x [K, N]`` costs ``2K`` FLOPs per output element (``mm``, ``addmm``, ``bmm``, ...);
- attention (``scaled_dot_product_*``) costs about ``4 * L_kv`` per output element (``Q K^T`` and ``P V``);
- everything else (norms, activations, rotary embeddings, casts, element-wise ops) costs O(1).

An op whose output costs at least the level's threshold per byte is kept (``MUST_SAVE``); a cheaper one
is recomputed in backward (``PREFER_RECOMPUTE``). ``memory.optimization`` sets the threshold:

- ``conservative``: no checkpointing (nothing recomputed).
- ``balanced``: recompute below 16 FLOPs/byte: the element-wise work only; every matmul and attention
  output is kept (a matmul with ``K >= 32`` in fp32, ``K >= 16`` in bf16, is above it).
- ``aggressive``: recompute below 4096 FLOPs/byte: also the matmuls with a short contraction and attention
  over short sequences. On a 1.1B Llama in bf16 (hidden 2048, MLP 5632) that recomputes the q/k/v/o,
  gate and up projections (2048 FLOPs/byte) and keeps the down projection (5632) and attention from
  2048 tokens on; on a small model it recomputes every op (full checkpointing of each layer).
- ``auto``: the least recompute that fits: :func:`choose_level` picks the first of conservative,
  balanced, aggressive whose measured activation bytes (:func:`activation_bytes` on one row, times the
  rows of a micro-batch) fit in the free memory of the device (``torch.cuda.mem_get_info`` plus the
  allocator's cached free blocks on CUDA; ``psutil.virtual_memory().available`` on a CPU, whose "device"
  memory is host RAM), less a reserve for what the first optimizer step still allocates.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from rapidfire_hf.models import unwrap_peft

logger = logging.getLogger(__name__)

# Recompute an op when its output costs fewer FLOPs than this per byte kept (see the module docstring).
RECOMPUTE_BELOW = {"balanced": 16.0, "aggressive": 4096.0}
LEVELS = ("conservative", "balanced", "aggressive", "auto")
ORDER = ("conservative", "balanced", "aggressive")  # least recompute first
# share of the free memory `auto` lets activations take (the rest absorbs fragmentation and temporaries)
AUTO_HEADROOM = 0.8
FALLBACK_LEVEL = "balanced"  # what `auto` applies when its measurement fails

# (op name, index of the argument whose last dimension is the contraction)
_MATMULS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1, "_scaled_mm": 0, "matmul": 0}
_ATTENTION_PREFIXES = ("_scaled_dot_product", "_flash_attention_forward", "_efficient_attention_forward")


def _first_tensor(args) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def recompute_flops_per_byte(op, args) -> float:
    """FLOPs it takes to recompute one byte of ``op``'s output, from its arguments' shapes.

    Args:
        op: an aten ``OpOverload`` (what a selective-checkpoint policy receives).
        args: its positional arguments.

    Returns:
        ``2K / itemsize`` for a matmul contracting ``K``, ``4 L_kv / itemsize`` for attention over ``L_kv``
        keys, ``1 / itemsize`` for any other op.
    """
    name = op.overloadpacket.__name__
    ref = _first_tensor(args)
    itemsize = ref.element_size() if ref is not None else 4
    if name in _MATMULS:
        a = args[_MATMULS[name]]
        return 2.0 * a.shape[-1] / itemsize if isinstance(a, torch.Tensor) and a.dim() else 1.0
    if name.startswith(_ATTENTION_PREFIXES) and "backward" not in name:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) >= 2 and tensors[1].dim() >= 2:
            return 4.0 * tensors[1].shape[-2] / itemsize  # key: [B, H, L_kv, D]
    return 1.0 / itemsize


def cost_policy(threshold: float) -> Callable:
    """A selective-checkpoint policy keeping the outputs that cost at least ``threshold`` FLOPs per byte."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if recompute_flops_per_byte(op, args) >= threshold:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _contexts(threshold: float):
    return create_selective_checkpoint_contexts(cost_policy(threshold))


def selective_context_fn(level: str) -> Callable:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` with the cost policy of ``level``."""
    return functools.partial(_contexts, RECOMPUTE_BELOW[level])


def _plain(level) -> str:
    return getattr(level, "value", level)


def _set(model, kwargs: dict | None) -> None:
    """Enable HF checkpointing with ``kwargs`` (``None``: disable it)."""
    target = unwrap_peft(model)
    names = ("activation_checkpointing", "gradient_checkpointing")
    if kwargs is None:
        for name in names:
            if hasattr(target, f"{name}_disable"):
                getattr(target, f"{name}_disable")()
                return
        return
    # transformers >= 5.2x renamed the method; the GPU machine's 5.17 has only the old name.
    if hasattr(target, "activation_checkpointing_enable"):
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(target, "gradient_checkpointing_enable"):
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise TypeError(
            f"{type(target).__name__} has no activation_checkpointing_enable/gradient_checkpointing_enable: "
            "selective checkpointing needs a transformers PreTrainedModel"
        )


def apply_selective_checkpointing(model, level: str) -> str | None:
    """Set the activation checkpointing of ``model``'s decoder layers for a fixed ``memory.optimization``
    level (``auto`` is resolved by :func:`auto_checkpointing`, which needs a forward to measure).

    Call it before training starts, and leave ``TrainingArguments.gradient_checkpointing`` off: the
    Trainer would otherwise re-enable plain checkpointing over ours at ``train()``. PEFT models are
    handled through their base model. ``conservative`` turns checkpointing off.

    Args:
        model: A ``transformers.PreTrainedModel`` (or a PEFT wrapper of one).
        level: ``conservative``, ``balanced`` or ``aggressive``.

    Returns:
        ``None`` for ``conservative``, else the level applied.

    Raises:
        ValueError: For an unknown level, or ``auto``.
        TypeError: For a model without HF checkpointing support.
    """
    level = _plain(level)
    if level not in ORDER:
        allowed = ", ".join(ORDER)
        raise ValueError(
            f"memory.optimization={level!r}: expected one of {allowed} (auto: auto_checkpointing)"
        )
    if level == "conservative":
        _set(model, None)
        return None
    # use_reentrant=False: the selective API and kwargs-only layer inputs need the non-reentrant form.
    # use_cache is left alone: the layers drop the cache only when they checkpoint (training with grad),
    # so generation from the same model in the rollout keeps its KV cache.
    _set(model, {"use_reentrant": False, "context_fn": selective_context_fn(level)})
    return level


class _StorageTracker(TorchDispatchMode):
    """Records a weak reference to the storage of every tensor an op creates."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in _tensors((args, kwargs or {}))}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                # views share their input's storage (a parameter's `t()`, a reshape): not new memory
                if key not in self.storages and key not in inputs:
                    from torch.multiprocessing.reductions import StorageWeakRef

                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
        return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(value) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif hasattr(value, "values") and callable(value.values):  # ModelOutput
        for v in value.values():
            yield from _tensors(v)


def activation_bytes(forward: Callable[[], object]) -> int:
    """Bytes of activations the autograd graph of ``forward()`` keeps for backward.

    Every storage created while ``forward`` runs is tracked by a weak reference; what is still alive
    once ``forward`` returned, its returned tensors excepted, is held by the graph: tensors autograd
    saved, the outputs a selective-checkpoint policy kept and the inputs checkpointed layers recompute
    from. (``saved_tensors_hooks`` alone does not see the last two: inside a checkpointed region the
    checkpoint's own hooks take the tensors.) The graph is freed before returning.

    Args:
        forward: runs one forward with grad enabled and returns its outputs.

    Returns:
        The bytes, on whatever device the forward ran.
    """
    tracker = _StorageTracker()
    with tracker:
        out = forward()
    gc.collect()  # the forward's temporaries; the graph lives on through `out`
    returned = {_key(t) for t in _tensors(out)}
    held = sum(
        nbytes for key, (ref, nbytes) in tracker.storages.items() if key not in returned and not ref.expired()
    )
    tracker.storages.clear()
    del out
    return held


def choose_level(bytes_per_row: dict[str, int], rows: int, budget: int) -> str:
    """The first of conservative, balanced, aggressive whose ``rows`` x activation bytes fit ``budget``
    (aggressive when none does)."""
    return next((lv for lv in ORDER if bytes_per_row[lv] * rows <= budget), "aggressive")


def free_device_bytes(device: torch.device | str | None) -> int:
    """Memory a new allocation can still get: on CUDA the driver's free memory plus the caching
    allocator's reserved-but-unallocated bytes; on a CPU the host's available RAM."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.virtual_memory().available)


def auto_checkpointing(
    models: list,
    probe: Callable[[], object],
    rows: int,
    device: torch.device | str | None,
    reserve_bytes: int = 0,
    free_bytes: int | None = None,
) -> tuple[str, dict[str, int]]:
    """Resolve ``memory.optimization: auto``: measure, choose, apply.

    Each level is applied to ``models`` in turn and :func:`activation_bytes` measures ``probe()`` (one
    training forward of a single row); the level chosen by :func:`choose_level` for ``rows`` rows and a
    budget of ``AUTO_HEADROOM * free - reserve_bytes`` is then applied.

    Args:
        models: the models whose decoder layers are checkpointed (e.g. the policy and the value model).
        probe: a one-row training forward through them.
        rows: rows of a training micro-batch.
        device: where training runs (its free memory sets the budget).
        reserve_bytes: memory still to come before the first backward (e.g. gradients and optimizer state).
        free_bytes: the free memory to budget against (default: :func:`free_device_bytes`).

    Returns:
        ``(level, activation bytes per row by level)``; ``FALLBACK_LEVEL`` and what was measured when a
        measurement raised (logged as a warning).
    """
    measured = {}
    try:
        for level in ORDER:
            for m in models:
                apply_selective_checkpointing(m, level)
            measured[level] = activation_bytes(probe)
    except Exception as err:  # e.g. a model whose forward refuses the measuring dispatch mode
        logger.warning("rapidfire: memory.optimization=auto could not measure (%s); using balanced", err)
        for m in models:
            apply_selective_checkpointing(m, FALLBACK_LEVEL)
        return FALLBACK_LEVEL, measured
    free = free_device_bytes(device) if free_bytes is None else free_bytes
    budget = int(AUTO_HEADROOM * free) - reserve_bytes
    level = choose_level(measured, rows, budget)
    for m in models:
        apply_selective_checkpointing(m, level)
    logger.info(
        "rapidfire: memory.optimization=auto chose %s (activation bytes per row %s x %d rows, budget %d)",
        level,
        measured,
        rows,
        budget,
    )
    return level, measured


def user_checkpointing(args) -> bool:
    """True when trainer arguments ask for HF's own (full) activation checkpointing."""
    names = ("activation_checkpointing", "gradient_checkpointing")
    return any(bool(getattr(args, name, False)) for name in names)


# what configure_checkpointing reports when the trainer's own argument already checkpoints
USER_CHECKPOINTING = "gradient_checkpointing"


def configure_checkpointing(models: list, level, args=None) -> str | None:
    """What the trainers call with ``memory.optimization``: apply a fixed level to ``models`` now.

    Args:
        models: the trained models whose decoder layers to checkpoint.
        level: a ``memory.optimization`` value.
        args: the trainer's ``TrainingArguments``: with ``gradient_checkpointing=True`` (HF's full
            checkpointing of every layer, already enabled by the trainer) nothing is changed.

    Returns:
        ``USER_CHECKPOINTING`` when the user's own checkpointing is kept, ``None`` for conservative, the
        level applied, or ``"auto"`` (nothing applied yet: the caller resolves it with
        :func:`auto_checkpointing` once a training forward can be measured).
    """
    level = _plain(level)
    if level not in LEVELS:
        raise ValueError(f"memory.optimization={level!r}: expected one of {', '.join(LEVELS)}")
    if args is not None and user_checkpointing(args):
        logger.info(
            "rapidfire: memory.optimization=%s leaves checkpointing to gradient_checkpointing=True (every "
            "layer fully recomputed); set gradient_checkpointing=False to let memory.optimization choose",
            level,
        )
        return USER_CHECKPOINTING
    if level == "auto":
        return "auto"
    applied = None
    for m in models:
        applied = apply_selective_checkpointing(m, level)
    return applied
