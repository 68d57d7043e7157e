"""Selective activation checkpointing for Hugging Face models, without editing their code.

HF decoder layers (``GradientCheckpointingLayer``) run through ``torch.utils.checkpoint.checkpoint`` with
the keyword arguments given to ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before
transformers 5.2x). We pass a ``context_fn`` built with torch's selective-checkpoint API
(``create_selective_checkpoint_contexts``): matrix multiplications and attention, the expensive ops, keep
their outputs; element-wise work (norms, activations, rotary embeddings, casts) is recomputed in backward.

``memory.optimization`` sets the level:

- ``conservative``: nothing changed (no recompute).
- ``balanced``: selective: recompute only the cheap element-wise ops.
- ``aggressive``: full checkpointing of every decoder layer: only layer inputs are kept.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Ops whose outputs are kept under "balanced": recomputing them would repeat most of the FLOPs.
_SAVED_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


@functools.cache
def saved_ops() -> frozenset:
    """The aten overloads whose outputs selective checkpointing keeps (those this torch build has)."""
    ops = set()
    for name in _SAVED_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


def keep_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: save matmul/attention outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` applying :func:`keep_matmuls_policy`."""
    return create_selective_checkpoint_contexts(keep_matmuls_policy)


LEVELS = {"conservative": None, "balanced": "selective", "aggressive": "full"}


def _enable(model, kwargs: dict) -> None:
    # transformers >= 5.2x renamed the method; the GPU machine's 5.17 has only the old name.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise TypeError(
            f"{type(model).__name__} has no activation_checkpointing_enable/gradient_checkpointing_enable: "
            "selective checkpointing needs a transformers PreTrainedModel"
        )


def apply_selective_checkpointing(model, level: str) -> str | None:
    """Turn on activation checkpointing of ``model``'s decoder layers for a ``memory.optimization`` level.

    Call it before training starts, and leave ``TrainingArguments.gradient_checkpointing`` off: the
    Trainer would otherwise re-enable plain checkpointing over ours at ``train()``. PEFT models are
    handled through their base model.

    Args:
        model: A ``transformers.PreTrainedModel`` (or a PEFT wrapper of one).
        level: ``conservative`` (no change), ``balanced`` (selective) or ``aggressive`` (full).

    Returns:
        ``None``, ``"selective"`` or ``"full"``: what was applied.

    Raises:
        ValueError: For an unknown level.
        TypeError: For a model without HF checkpointing support.
    """
    level = getattr(level, "value", level)
    if level not in LEVELS:
        raise ValueError(f"memory.optimization={level!r}: expected one of {', '.join(LEVELS)}")
    mode = LEVELS[level]
    if mode is None:
        return None
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}  # the selective API and kwargs-only layer inputs need non-reentrant
    if mode == "selective":
        kwargs["context_fn"] = selective_context_fn
    # use_cache is left alone: the layers drop the cache only when they checkpoint (training with grad),
    # so generation from the same model in the rollout keeps its KV cache.
    _enable(target, kwargs)
    return mode
