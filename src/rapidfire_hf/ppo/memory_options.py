"""What ``PPOTrainer`` does with ``memory.prefetch_window`` (``memory.optimization``: ``ppo/planning.py``).

- :class:`PromptPrefetch`: the prompt batches of the coming updates, collated and copied to the device
  ``prefetch_window`` updates ahead (``rapidfire_hf.memory.BatchPrefetcher``), in the order and with the
  contents ``PPOTrainer.next_prompts`` gives.
"""

from __future__ import annotations

import logging

from rapidfire_hf.memory.prefetch import BatchPrefetcher

logger = logging.getLogger(__name__)


def _memory_config(trainer):
    cfg = getattr(trainer, "rf_config", None)
    return None if cfg is None else cfg.memory


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
