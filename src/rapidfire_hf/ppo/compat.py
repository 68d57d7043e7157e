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
        warnings.warn(
            f"PPOTrainer({old}=...) is the old TRL spelling: use {new}=", FutureWarning, stacklevel=3
        )
        given[new] = legacy[old]
    if given["args"] is None:
        raise TypeError("PPOTrainer needs args=PPOConfig(...)")
    if model is None:
        raise TypeError("PPOTrainer needs model= (the policy: a causal LM or a value-head model)")
    return given["args"], given["processing_class"]


# pre-1.0 TRL PPOConfig name -> current name (same meaning)
_RENAMED_CONFIG_FIELDS = {
    "model_name": "sft_model_path",
    "ppo_epochs": "num_ppo_epochs",
    "init_kl_coef": "kl_coef",
    "log_with": "report_to",
    "tracker_project_name": "run_name",
}
# pre-1.0 TRL PPOConfig names with no counterpart here, and what to use instead
_DROPPED_CONFIG_FIELDS = {
    "adap_kl_ctrl": "an adaptive KL controller is not implemented: set a fixed kl_coef",
    "target": "an adaptive KL controller is not implemented: set a fixed kl_coef",
    "horizon": "an adaptive KL controller is not implemented: set a fixed kl_coef",
    "target_kl": "use approx_kl_limit with a RapidFireOptimizer (a window above it is rolled back)",
    "early_stopping": "use approx_kl_limit with a RapidFireOptimizer",
    "forward_batch_size": "use local_rollout_forward_batch_size",
    "steps": "use total_episodes (prompts) or max_steps (PPO updates)",
    "query_dataset": "pass train_dataset to PPOTrainer",
    "reward_model": "pass reward_model or reward_funcs to PPOTrainer",
    "tracker_kwargs": "use report_to and the trackers' environment variables",
    "accelerator_kwargs": "use accelerate's config (accelerate launch) or PPOConfig's own fields",
    "optimize_cuda_cache": "memory is managed by rapidfire_hf.MemoryCompactionCallback (memory_management)",
    "optimize_device_cache": "memory is managed by rapidfire_hf.MemoryCompactionCallback (memory_management)",
    "kl_penalty": "use kl_estimator ('k1' or 'k3')",
}


def translate_legacy_config(kwargs: dict) -> dict:
    """Map pre-1.0 TRL ``PPOConfig`` keywords to the current fields, each with a ``FutureWarning`` naming the
    new name; old names that have no counterpart raise ``TypeError`` saying what to use.

    The old batch sizes (``batch_size`` prompts per rollout, ``mini_batch_size`` rows per backward, with
    ``gradient_accumulation_steps`` backwards per optimizer step) become ``per_device_train_batch_size =
    mini_batch_size``, ``gradient_accumulation_steps = batch_size / mini_batch_size`` and
    ``num_mini_batches = batch_size / (mini_batch_size * old gradient_accumulation_steps)``.
    """
    import warnings

    if not any(
        k in kwargs
        for k in (*_RENAMED_CONFIG_FIELDS, *_DROPPED_CONFIG_FIELDS, "batch_size", "mini_batch_size")
    ):
        return kwargs
    out = dict(kwargs)
    dropped = {k: v for k, v in _DROPPED_CONFIG_FIELDS.items() if k in out}
    if dropped:
        raise TypeError(
            "PPOConfig got old TRL argument(s) without a counterpart: "
            + "; ".join(f"{k}: {hint}" for k, hint in dropped.items())
        )
    for old, new in _RENAMED_CONFIG_FIELDS.items():
        if old in out:
            if new in out:
                raise TypeError(f"PPOConfig got both {old}= (old TRL name) and {new}=: pass {new}= only")
            warnings.warn(
                f"PPOConfig({old}=...) is the old TRL name: use {new}=", FutureWarning, stacklevel=3
            )
            out[new] = out.pop(old)
    if "batch_size" in out or "mini_batch_size" in out:
        batch = int(out.pop("batch_size", 128))
        mini = int(out.pop("mini_batch_size", min(batch, 128)))
        accumulate = int(out.pop("gradient_accumulation_steps", 1))
        if min(batch, mini, accumulate) < 1 or batch % (mini * accumulate):
            raise ValueError(
                f"old TRL batch sizes batch_size={batch}, mini_batch_size={mini}, gradient_accumulation_steps="
                f"{accumulate}: batch_size must be a multiple of mini_batch_size * gradient_accumulation_steps"
            )
        for name in ("per_device_train_batch_size", "num_mini_batches"):
            if name in out:
                raise TypeError(
                    f"PPOConfig got the old batch_size/mini_batch_size and {name}=: use one spelling"
                )
        out.update(
            per_device_train_batch_size=mini,
            gradient_accumulation_steps=batch // mini,
            num_mini_batches=batch // (mini * accumulate),
        )
        warnings.warn(
            f"PPOConfig(batch_size={batch}, mini_batch_size={mini}) is the old TRL spelling: use "
            f"per_device_train_batch_size={mini}, gradient_accumulation_steps={batch // mini}, "
            f"num_mini_batches={batch // (mini * accumulate)}",
            FutureWarning,
            stacklevel=3,
        )
    return out


def optimizer_precision(args, optimizer) -> str:
    """accelerate's ``mixed_precision`` for a trainer: PPOConfig's ``bf16``/``fp16``, or the ``precision``
    of a ``RapidFireOptimizer(precision=...)`` passed to it; the two must agree when both are set."""
    from rapidfire_hf.config.errors import ConfigError

    configured = "bf16" if args.bf16 else ("fp16" if args.fp16 else "no")
    wanted = getattr(optimizer, "precision", None)
    if wanted is None:
        return configured
    if configured not in ("no", wanted):
        raise ConfigError(
            f"the optimizer asks for precision={wanted!r} but PPOConfig sets {configured}: set one of them",
            key="precision",
            value=wanted,
            allowed=f"{configured!r} (as PPOConfig) or None",
        )
    return wanted


def fused_kernels_requested(optimizer, device) -> bool:
    """Whether ``RapidFireOptimizer(enable_fused_kernels=True)`` switches the trainer's Liger kernels on:
    only with liger-kernel installed and a CUDA device. Logs what the request enabled."""
    import importlib.util
    import logging

    if getattr(optimizer, "_fused", None) is not True:
        return False
    log = logging.getLogger("rapidfire_hf.ppo")
    if device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None:
        log.info("enable_fused_kernels: fused AdamW and Liger kernels (RMSNorm, SwiGLU, RoPE) on %s", device)
        return True
    reason = (
        "liger-kernel is not installed" if device.type == "cuda" else f"no Liger kernels on {device.type}"
    )
    log.info("enable_fused_kernels: the fused AdamW kernel where torch has one; %s", reason)
    return False
