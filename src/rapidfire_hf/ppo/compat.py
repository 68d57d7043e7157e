"""Helpers under the names TRL 1.12's PPO module gave them, for scripts that import them.

``batch_generation`` is ``model.generate`` in chunks of rows that also returns the per-step processed
scores. The trainer itself does not use it: its rollout engine never holds ``[B, R, V]`` scores.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationConfig

from rapidfire_hf.ppo.core import masked_mean, masked_var, masked_whiten

__all__ = ["batch_generation", "masked_mean", "masked_var", "masked_whiten"]


def _pad_right(tensors: list[torch.Tensor], value: float) -> torch.Tensor:
    """Stack tensors ``[b_i, n_i, ...]`` into ``[sum b_i, max n_i, ...]``, filling the tail with ``value``."""
    width = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), value)
        out.append(torch.cat([t, pad], dim=1))
    return torch.cat(out, dim=0)


@torch.no_grad()
def batch_generation(
    model: nn.Module,
    queries: torch.Tensor,
    local_rollout_forward_batch_size: int,
    pad_token_id: int,
    generation_config: GenerationConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate from left-padded ``queries`` ``[B, P]`` in chunks of rows.

    Args:
        model: a causal LM (or anything with ``generate``).
        queries: prompt token ids, padded on the left with ``pad_token_id``.
        local_rollout_forward_batch_size: rows per ``generate`` call (must be >= 1).
        pad_token_id: the padding id of ``queries``; also fills the tail of shorter chunks.
        generation_config: passed to ``generate``.

    Returns:
        ``(query_responses [B, P + N], scores [B, N, V])``: prompt and completion tokens, and the processed
        next-token scores of every generated position (``N`` = the longest completion; shorter chunks are
        padded with ``pad_token_id`` tokens and zero scores).
    """
    if int(local_rollout_forward_batch_size) < 1:
        raise ValueError(
            f"local_rollout_forward_batch_size must be >= 1, got {local_rollout_forward_batch_size}"
        )
    context_length = queries.shape[1]
    sequences, scores = [], []
    for start in range(0, queries.shape[0], local_rollout_forward_batch_size):
        chunk = queries[start : start + local_rollout_forward_batch_size]
        out = model.generate(
            input_ids=chunk,
            attention_mask=chunk != pad_token_id,
            generation_config=generation_config,
            return_dict_in_generate=True,
            output_scores=True,
        )
        sequences.append(torch.cat([chunk, out.sequences[:, context_length:]], dim=1))
        scores.append(torch.stack(out.scores, dim=1))
    return _pad_right(sequences, pad_token_id), _pad_right(scores, 0.0)


_OLD_TRAINER_NAMES = {"config": "args", "tokenizer": "processing_class"}


def legacy_trainer_arguments(args, processing_class, model, legacy: dict):
    """``(args, processing_class)`` from the pre-1.0 TRL keywords ``config=`` and ``tokenizer=``, with a
    ``FutureWarning`` naming the current keyword; any other unknown keyword is a ``TypeError``."""
    import warnings

    unknown = sorted(set(legacy) - set(_OLD_TRAINER_NAMES))
    if unknown:
        raise TypeError(f"PPOTrainer got unexpected keyword argument(s) {unknown}")
    given = {"args": args, "processing_class": processing_class}
    for old, new in _OLD_TRAINER_NAMES.items():
        if old not in legacy:
            continue
        if given[new] is not None:
            raise TypeError(f"PPOTrainer got both {old}= and {new}=: pass {new}= only")
        warnings.warn(f"PPOTrainer({old}=...) is the old TRL spelling: use {new}=", FutureWarning, stacklevel=3)
        given[new] = legacy[old]
    if given["args"] is None:
        raise TypeError("PPOTrainer needs args=PPOConfig(...)")
    if model is None:
        raise TypeError("PPOTrainer needs model= (the policy: a causal LM or a value-head model)")
    return given["args"], given["processing_class"]
