"""What ``PPOTrainer`` does with ``memory.optimization`` and ``memory.prefetch_window``.

- :func:`setup_checkpointing`: selective activation checkpointing of the trained models (the policy and a
  separate value model) for the training forwards, applied at the first PPO epoch (so a config given
  later through ``enable_rapidfire`` counts too); ``auto`` is measured there on one row of the rollout.
- :class:`PromptPrefetch`: the prompt batches of the coming updates, collated and copied to the device
  ``prefetch_window`` updates ahead (``rapidfire_hf.memory.BatchPrefetcher``), in the order and with the
  contents ``PPOTrainer.next_prompts`` gives.
"""

from __future__ import annotations

import logging

import torch

from rapidfire_hf.memory.checkpointing import auto_checkpointing, configure_checkpointing
from rapidfire_hf.memory.prefetch import BatchPrefetcher

logger = logging.getLogger(__name__)


def _memory_config(trainer):
    cfg = getattr(trainer, "rf_config", None)
    return None if cfg is None else cfg.memory


def _first_step_reserve(trainer) -> int:
    """Bytes the first backward and optimizer step still allocate: gradients, and AdamW's two moments
    (fp32) while the optimizer holds no state yet."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in params if p.grad is None)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    has_state = bool(getattr(inner, "state", None))
    return grads + (0 if has_state else 2 * 4 * sum(p.numel() for p in params))


def setup_checkpointing(trainer, query_responses: torch.Tensor, context_length: int) -> str | None:
    """Apply ``memory.optimization`` to the trainer's policy and value model once; returns what was
    applied (see ``configure_checkpointing``; ``auto`` resolves to a level) and stores it as
    ``trainer.checkpointing``. Without a rapidfire config nothing is applied."""
    trainer._checkpointing_set = True
    memory = _memory_config(trainer)
    if memory is None:
        trainer.checkpointing = None
        return None
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    models = [m for m in (unwrapped.policy, unwrapped.value_model) if m is not None]
    applied = configure_checkpointing(models, memory.optimization, trainer.args)
    if applied == "auto":
        row = query_responses[:1]

        def probe():  # one row of the training forward, through the unwrapped module (no DDP hooks)
            with trainer.accelerator.autocast():
                return unwrapped(
                    row, trainer.pad_token_id, context_length, trainer.args.temperature, with_entropy=True
                )

        applied, _ = auto_checkpointing(
            models,
            probe,
            trainer.args.per_device_train_batch_size,
            trainer.accelerator.device,
            reserve_bytes=_first_step_reserve(trainer),
        )
    trainer.checkpointing = applied
    logger.info("rapidfire: activation checkpointing of the PPO training forwards: %s", applied or "none")
    return applied


class PromptPrefetch:
    """The prompt batches of updates ``start, start+1, ...`` prepared ``window`` updates ahead.

    Args:
        trainer: the ``PPOTrainer`` (its ``next_prompts`` collates a batch).
        start: the first update index.
        window: batches prepared ahead (``memory.prefetch_window``); 0 collates each batch when taken.
        device: where the prompt tensors go (pinned, non-blocking side-stream copies on CUDA).
    """

    def __init__(self, trainer, start: int, window: int, device):
        self.trainer = trainer
        self.window = window
        self.fetched = 0  # batches collated so far (how far ahead the prefetcher ran)
        source = self._batches(start, trainer.num_updates)
        self._it = iter(BatchPrefetcher(source, window=window, device=device))

    @classmethod
    def for_trainer(cls, trainer, start: int) -> PromptPrefetch:
        """A prefetcher with the trainer's ``memory.prefetch_window`` (0 without a rapidfire config)."""
        memory = _memory_config(trainer)
        window = memory.prefetch_window if memory is not None else 0
        return cls(trainer, start, window, trainer.accelerator.device)

    def _batches(self, start: int, stop: int):
        for update in range(start, stop):
            batch = self.trainer.next_prompts(update)
            self.fetched += 1
            yield update, batch

    def take(self, update: int) -> dict:
        """The batch of ``update`` (taken in order; an out-of-order request is collated on the spot)."""
        try:
            index, batch = next(self._it)
        except StopIteration:
            index, batch = None, None
        if index != update:
            logger.warning("rapidfire: prompt batch %s requested out of order; collating it now", update)
            return self.trainer.next_prompts(update)
        return batch
