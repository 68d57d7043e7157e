"""PPOTrainer's default optimizer and LR schedule, built from PPOConfig: torch AdamW with its kernel choice and
transformers' schedule. PPOTrainer builds them when given no optimizer, and every sweep trial builds its own
with the same functions (one rule for both)."""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType
from transformers.optimization import get_scheduler


def default_adamw(args, params, **kernel) -> torch.optim.AdamW:
    """torch AdamW over ``params`` with the PPOConfig's learning rate, betas, eps and weight decay;
    ``kernel`` picks torch's implementation (``fused=True``, or nothing for torch's default)."""
    return torch.optim.AdamW(
        params,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        **kernel,
    )


def default_adamw_kernel(device: torch.device, distributed_type=DistributedType.NO) -> dict:
    """``fused=True`` for the default AdamW on one GPU or under DDP, as transformers' Trainer defaults
    to (``adamw_torch_fused``). torch's default there is the foreach kernel, whose temporaries (e.g.
    ``_foreach_sqrt`` of every second moment) hold a copy of the optimizer state during step(): on
    the 7B shape with a separate value model (13.3B trainable parameters, bf16) that was the
    difference between an OOM at 136.6 GiB and training (benchmarks/ppo_vs_trl, size7b). Sharded
    engines (DeepSpeed, FSDP) keep torch's default. PPOTrainer's (its accelerator's device and
    distributed type) and every sweep trial's (its parameters' device)."""
    plain = distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)
    return {"fused": True} if plain and torch.device(device).type == "cuda" else {}


def default_scheduler(args, optimizer, num_updates: int):
    """PPOConfig's LR schedule (``lr_scheduler_type``, warm-up, ``lr_scheduler_kwargs``) over ``num_updates``
    optimizer-update steps, as transformers' Trainer builds it; PPOTrainer's and every sweep trial's."""
    return get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=args.get_warmup_steps(num_updates),
        num_training_steps=num_updates,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or None,
    )
