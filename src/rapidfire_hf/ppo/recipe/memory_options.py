"""What ``PPOTrainer`` does with ``memory.prefetch_window`` (``memory.optimization``: ``ppo/recipe/planning.py``).

- :class:`PromptPrefetch`: the prompt batches of the coming updates, collated and copied to the device
  ``prefetch_window`` updates ahead (``rapidfire_hf.memory.BatchPrefetcher``), in the order and with the
  contents ``PPOTrainer.next_prompts`` gives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rapidfire_hf.memory.prefetch import BatchPrefetcher

logger = logging.getLogger("rapidfire_hf.ppo.memory_options")  # the name it had before the recipe folder


def prefetch_window(rf_config) -> int:
    """``memory.prefetch_window`` of a rapidfire config (0 without one: each batch collated when taken)."""
    return 0 if rf_config is None else rf_config.memory.prefetch_window


class PromptPrefetch:
    """The prompt batches of updates ``start, start+1, ...`` prepared ``window`` updates ahead.

    Args:
        next_prompts: collates the prompt batch of an update (``PPOTrainer.next_prompts``).
        start: the first update index.
        stop: the update index after the last (``PPOTrainer.num_updates``).
        window: batches prepared ahead (``memory.prefetch_window``); 0 collates each batch when taken.
        device: where the prompt tensors go (pinned, non-blocking side-stream copies on CUDA).
    """

    def __init__(self, next_prompts: Callable[[int], dict], start: int, stop: int, window: int, device):
        self.next_prompts = next_prompts
        self.window = window
        self.fetched = 0  # batches collated so far (how far ahead the prefetcher ran)
        source = self._batches(start, stop)
        self._it = iter(BatchPrefetcher(source, window=window, device=device))

    def _batches(self, start: int, stop: int):
        for update in range(start, stop):
            batch = self.next_prompts(update)
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
            return self.next_prompts(update)
        return batch
