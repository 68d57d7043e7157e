"""``memory.optimization`` and ``memory.prefetch_window`` in a ``transformers.Trainer`` / TRL trainer.

- :func:`install_checkpointing`: selective activation checkpointing of ``trainer.model``'s decoder layers
  (``rapidfire_hf.memory.checkpointing``) only where the level's target needs it. A trainer whose
  ``gradient_checkpointing`` is on keeps HF's full checkpointing (TRL's configs default to ``True``: set it
  ``False`` to let ``memory.optimization`` choose); ``memory.lowmem`` brings its own checkpointing. The
  least recompute that fits is measured at ``on_train_begin`` on
  a one-row forward of random token ids at the trainer's sequence length (``max_length``, else
  ``max_prompt_length + max_completion_length``, else 512).
- :func:`install_prefetch`: the training loop takes its batches through a ``BatchPrefetcher``
  (``trainer.get_batch_samples`` is wrapped), so the next ``prefetch_window`` batches are fetched from the
  DataLoader (collated) before the current one trains. On CUDA the prefetcher, not accelerate, moves them
  to the device: pinned and non-blocking on a side stream, overlapping the step. Order and contents are
  the DataLoader's.
"""

from __future__ import annotations

import functools
import logging

import torch
from transformers import TrainerCallback

from rapidfire_hf.memory.checkpointing import (
    USER_CHECKPOINTING,
    auto_checkpointing,
    configure_checkpointing,
)
from rapidfire_hf.memory.prefetch import BatchPrefetcher
from rapidfire_hf.models.plumbing import decoder_layers

logger = logging.getLogger(__name__)

DEFAULT_PROBE_LENGTH = 512


def probe_length(args) -> int:
    """Tokens per row of the trainer's training forward, from its arguments."""
    length = getattr(args, "max_length", None)
    if length:
        return int(length)
    prompt, completion = (getattr(args, k, None) for k in ("max_prompt_length", "max_completion_length"))
    if prompt and completion:
        return int(prompt + completion)
    return DEFAULT_PROBE_LENGTH


class AutoCheckpointingCallback(TrainerCallback):
    """Resolves ``memory.optimization: auto`` once the model sits on its training device."""

    def __init__(self, trainer, memory):
        self.trainer = trainer
        self.memory = memory  # the MemoryConfig: its level (target) and checkpointing
        self.level: str | None = None
        self.measured: dict[str, int] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        if self.level is not None:
            return
        model = self.trainer.model
        device = next(model.parameters()).device
        vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
        ids = torch.randint(0, vocab, (1, probe_length(args)), device=device)
        was_training = model.training
        model.train()  # HF layers checkpoint only in training mode

        def probe():
            with self.trainer.autocast_smart_context_manager():
                return model(input_ids=ids)

        try:
            self.level, self.measured = auto_checkpointing(
                [model],
                probe,
                args.per_device_train_batch_size,
                device,
                level=self.memory.optimization,
                checkpointing=self.memory.checkpointing,
            )
        finally:
            model.train(was_training)


def _chunked(model) -> bool:
    """True when ``apply_chunked_checkpointing`` already wraps the model's decoder layers."""
    try:
        return any(hasattr(layer, "_rapidfire_chunked_checkpoint") for layer in decoder_layers(model))
    except (AttributeError, TypeError, ValueError):  # not a decoder stack this module knows
        return False


def install_checkpointing(trainer, state) -> None:
    """Apply ``state.config.memory.optimization`` to ``trainer.model`` (recorded in ``state``)."""
    memory = state.config.memory
    level = memory.optimization.value
    if memory.lowmem.value != "off":
        state.skipped.append(
            f"memory.optimization={level} checkpointing (memory.lowmem checkpoints its own way)"
        )
        return
    if _chunked(trainer.model):
        state.skipped.append(
            f"memory.optimization={level} checkpointing (the model's layers already run chunked checkpointing)"
        )
        return
    try:
        applied = configure_checkpointing([trainer.model], level, trainer.args, memory.checkpointing)
    except TypeError as err:
        state.skipped.append(f"memory.optimization={level} checkpointing ({err})")
        return
    if applied == USER_CHECKPOINTING:
        state.skipped.append(
            f"memory.optimization={level} checkpointing (gradient_checkpointing=True already checkpoints every "
            "layer; set it False to let memory.optimization choose)"
        )
    elif applied == "auto":
        callback = AutoCheckpointingCallback(trainer, memory)
        trainer.add_callback(callback)
        state.parts["checkpointing"] = callback
        state.installed.append(
            f"activation checkpointing: the least recompute that fits memory.optimization={level} "
            "(measured at train begin; none when the run fits)"
        )
    else:
        state.parts["checkpointing"] = applied
        state.installed.append(f"selective activation checkpointing ({applied or 'none: conservative'})")


class _Prefetching:
    """Replaces ``trainer.get_batch_samples``: batches come from a prefetcher over the epoch iterator."""

    def __init__(self, trainer, window: int):
        self.get_batch_samples = trainer.get_batch_samples
        self.window = window
        self.device = trainer.args.device
        self.source = None
        self.prefetched = None

    def __call__(self, epoch_iterator, *args, **kwargs):
        if epoch_iterator is not self.source:  # a new epoch (or a resumed one)
            self.source = epoch_iterator
            self.prefetched = iter(BatchPrefetcher(epoch_iterator, window=self.window, device=self.device))
        return self.get_batch_samples(self.prefetched, *args, **kwargs)


def install_prefetch(trainer, state) -> None:
    """Route the training loop's batches through a ``BatchPrefetcher`` of ``memory.prefetch_window``."""
    window = state.config.memory.prefetch_window
    if window == 0:
        return
    if not hasattr(trainer, "get_batch_samples"):
        state.skipped.append("batch prefetch (this transformers has no Trainer.get_batch_samples)")
        return
    prefetching = _Prefetching(trainer, window)
    trainer.get_batch_samples = prefetching
    if trainer.args.device.type == "cuda":  # the prefetcher places batches: pinned, non-blocking
        get_train_dataloader = trainer.get_train_dataloader

        @functools.wraps(get_train_dataloader)
        def without_placement(*args, **kwargs):
            loader = get_train_dataloader(*args, **kwargs)
            if getattr(loader, "device", None) is not None:
                loader.device = None
            return loader

        trainer.get_train_dataloader = without_placement
    state.parts["prefetch"] = prefetching
    state.installed.append(f"batch prefetch ({window} batches ahead)")
