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

An op whose output costs at least the policy's threshold per byte is kept (``MUST_SAVE``); a cheaper one
is recomputed in backward (``PREFER_RECOMPUTE``). The policies, least recompute first:

- ``none`` (level name ``conservative``): no checkpointing (nothing recomputed).
- ``elementwise`` (``balanced``): recompute below 16 FLOPs/byte: the element-wise work only; every
  matmul and attention output is kept (a matmul with ``K >= 32`` in fp32, ``K >= 16`` in bf16, is above it).
- ``matmuls`` (``aggressive``): recompute below 4096 FLOPs/byte: also the matmuls with a short contraction
  and attention over short sequences. On a 1.1B Llama in bf16 (hidden 2048, MLP 5632) that recomputes the
  q/k/v/o, gate and up projections (2048 FLOPs/byte) and keeps the down projection (5632) and attention
  from 2048 tokens on; on a small model it recomputes every op (full checkpointing of each layer).

Which policy a run gets is not the level's to order: ``memory.optimization`` is a target
(``rapidfire_hf.memory.planner``) and :func:`auto_checkpointing` applies the least recompute whose
measured activation bytes (:func:`activation_bytes` on one row, times the rows of a micro-batch) fit the
level's share of the device, less what the run holds and what its first optimizer step still allocates.
Measured at 1.1B, rollout batch 64 on one H200 (issue 27): checkpointing that fit without it made a PPO
update 1.6-1.7x slower to save at most 5 GiB. ``memory.checkpointing`` forces a policy.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from rapidfire_hf.config.schema import to_plain
from rapidfire_hf.memory.levels import MEMORY_LEVELS
from rapidfire_hf.memory.planner import LEVEL_POLICY, POLICY_LEVEL, TRAIN_PEAK_FACTOR, Budget, level_target
from rapidfire_hf.models import unwrap_peft
from rapidfire_hf.utils.device_memory import device_capacity_bytes, device_free_bytes

logger = logging.getLogger(__name__)

# Recompute an op when its output costs fewer FLOPs than this per byte kept (see the module docstring).
RECOMPUTE_BELOW = {n: lv.recompute_below for n, lv in MEMORY_LEVELS.items() if lv.recompute_below is not None}
LEVELS = tuple(MEMORY_LEVELS)
ORDER = tuple(LEVEL_POLICY)  # the levels that name a policy, least recompute first
FALLBACK_LEVEL = "conservative"  # what `auto` applies when its measurement fails: no recompute, as stock

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
    level = POLICY_LEVEL.get(to_plain(level), to_plain(level))
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


def choose_level(bytes_per_row: dict[str, int], rows: int, budget: int, allowed=ORDER) -> str:
    """The first of ``allowed`` (least recompute first) whose planned training peak for ``rows`` rows
    (``TRAIN_PEAK_FACTOR`` x activation bytes) fits ``budget``; the last of ``allowed`` when none does."""
    return next((lv for lv in allowed if TRAIN_PEAK_FACTOR * bytes_per_row[lv] * rows <= budget), allowed[-1])


def free_device_bytes(device: torch.device | str | None) -> int:
    """Memory a new allocation can still get: on CUDA the driver's free memory plus the caching
    allocator's reserved-but-unallocated bytes; on a CPU the host's available RAM."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return device_free_bytes(device)
    import psutil

    return int(psutil.virtual_memory().available)


def level_budget(device, level, reserve_bytes: int = 0, free_bytes: int | None = None):
    """The :class:`rapidfire_hf.memory.planner.Budget` of ``level`` on ``device``: the level's share of the
    device (on a CPU, of the RAM available now), what the run holds there now, and ``reserve_bytes``.
    ``free_bytes`` (tests) replaces the measurement: the target is then that many bytes, nothing held."""
    share = level_target(level).device_share
    if free_bytes is not None:
        return Budget(target_bytes=int(share * free_bytes), held_bytes=0, reserve_bytes=reserve_bytes)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        total = device_capacity_bytes(device)
        held = int(torch.cuda.memory_allocated(device))
        # never plan with more than the driver can still give (another process may hold memory)
        target = min(int(share * total), held + free_device_bytes(device))
        return Budget(target_bytes=target, held_bytes=held, reserve_bytes=reserve_bytes)
    return Budget(
        target_bytes=int(share * free_device_bytes(device)), held_bytes=0, reserve_bytes=reserve_bytes
    )


def allowed_levels(level, checkpointing="auto") -> tuple[str, ...]:
    """The cost-policy levels a run may apply: the one ``memory.checkpointing`` forces, else none and
    (when ``memory.optimization`` allows recompute) the two recompute levels, least recompute first."""
    forced = to_plain(checkpointing)
    if forced != "auto":
        return (POLICY_LEVEL[forced],)
    return ORDER if level_target(level).recompute else ("conservative",)


def auto_checkpointing(
    models: list,
    probe: Callable[[], object],
    rows: int,
    device: torch.device | str | None,
    reserve_bytes: int = 0,
    free_bytes: int | None = None,
    level="balanced",
    checkpointing="auto",
) -> tuple[str, dict[str, int]]:
    """Resolve the checkpointing of ``memory.optimization=level``: measure, choose, apply.

    Each policy the level allows is applied to ``models`` in turn and :func:`activation_bytes` measures
    ``probe()`` (one training forward of a single row); the least recompute whose ``rows`` rows fit the
    level's budget (:func:`level_budget`) is then applied.

    Args:
        models: the models whose decoder layers are checkpointed (e.g. the policy and the value model).
        probe: a one-row training forward through them.
        rows: rows of a training micro-batch.
        device: where training runs (its memory sets the budget).
        reserve_bytes: memory still to come before the first backward (e.g. gradients and optimizer state).
        free_bytes: the memory to budget against (default: measured on ``device``).
        level: the ``memory.optimization`` level (its target and whether it may recompute).
        checkpointing: ``memory.checkpointing`` (a forced policy is applied without measuring).

    Returns:
        ``(level, activation bytes per row by level)``; ``FALLBACK_LEVEL`` and what was measured when a
        measurement raised (logged as a warning).
    """
    allowed = allowed_levels(level, checkpointing)
    if len(allowed) == 1:
        for m in models:
            apply_selective_checkpointing(m, allowed[0])
        return allowed[0], {}
    measured = {}
    try:
        for lv in allowed:
            for m in models:
                apply_selective_checkpointing(m, lv)
            measured[lv] = activation_bytes(probe)
    except Exception as err:  # e.g. a model whose forward refuses the measuring dispatch mode
        logger.warning(
            "rapidfire: memory.optimization=%s could not measure activations (%s); no checkpointing",
            to_plain(level),
            err,
        )
        for m in models:
            apply_selective_checkpointing(m, FALLBACK_LEVEL)
        return FALLBACK_LEVEL, measured
    budget = level_budget(device, level, reserve_bytes, free_bytes)
    chosen = choose_level(measured, rows, budget.train_bytes, allowed)
    for m in models:
        apply_selective_checkpointing(m, chosen)
    logger.info(
        "rapidfire: memory.optimization=%s chose checkpointing %s (activation bytes per row %s x %d rows, "
        "room %d)",
        to_plain(level),
        LEVEL_POLICY[chosen],
        measured,
        rows,
        budget.train_bytes,
    )
    return chosen, measured


def user_checkpointing(args) -> bool:
    """True when trainer arguments ask for HF's own (full) activation checkpointing."""
    names = ("activation_checkpointing", "gradient_checkpointing")
    return any(bool(getattr(args, name, False)) for name in names)


# what configure_checkpointing reports when the trainer's own argument already checkpoints
USER_CHECKPOINTING = "gradient_checkpointing"


def configure_checkpointing(models: list, level, args=None, checkpointing="auto") -> str | None:
    """What the trainers call with ``memory.optimization``: apply a forced policy now, or defer.

    Args:
        models: the trained models whose decoder layers to checkpoint.
        level: a ``memory.optimization`` value (validated here).
        args: the trainer's ``TrainingArguments``: with ``gradient_checkpointing=True`` (HF's full
            checkpointing of every layer, already enabled by the trainer) nothing is changed.
        checkpointing: ``memory.checkpointing``: ``auto`` (the level's rule, resolved by measuring),
            ``off``, ``elementwise`` or ``matmuls`` (applied now).

    Returns:
        ``USER_CHECKPOINTING`` when the user's own checkpointing is kept, ``None`` for no checkpointing,
        the level applied, or ``"auto"`` (nothing applied yet: the caller resolves it with
        :func:`auto_checkpointing` once a training forward can be measured). A level that may not
        recompute (``conservative``) turns checkpointing off at once.
    """
    level = to_plain(level)
    if level not in LEVELS:
        raise ValueError(f"memory.optimization={level!r}: expected one of {', '.join(LEVELS)}")
    if args is not None and user_checkpointing(args):
        logger.info(
            "rapidfire: memory.optimization=%s leaves checkpointing to gradient_checkpointing=True (every "
            "layer fully recomputed); set gradient_checkpointing=False to let memory.optimization choose",
            level,
        )
        return USER_CHECKPOINTING
    allowed = allowed_levels(level, checkpointing)
    if len(allowed) > 1:
        return "auto"
    applied = None
    for m in models:
        applied = apply_selective_checkpointing(m, allowed[0])
    return applied
