"""OOM recovery: on ``torch.OutOfMemoryError`` in a micro-batch, compact, split it in halves and retry.

The contract that keeps the optimizer update identical: ``step_fn(chunk, weight)`` runs forward and
backward of ``weight * loss(chunk)``, where ``loss(chunk)`` is normalised the way the full micro-batch's
loss is (usually a mean over the chunk's samples) and returns the unweighted loss. The default weight is
``len(chunk) / len(micro_batch)``, so the gradients of the halves add up to the gradient of the whole
(a sum of means weighted by their share is the mean). For a loss already normalised by a fixed count
(e.g. the tokens of the whole accumulation window, ``num_items_in_batch``) pass
``weight_fn=lambda chunk, batch_size: 1.0``; for a per-token mean inside the micro-batch pass a weight
that is the chunk's share of tokens.

A retry is exact only when the failed attempt left no gradient behind. Before each attempt the wrapper
notes every parameter's ``.grad`` (object and version counter); after an OOM, gradients that did not exist
before are dropped again (exact), and an OOM after backward had already added into existing gradients, or
after an optimizer step changed parameters inside backward, is not retried (it would count a part twice):
it raises :class:`OOMRecoveryError` saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from rapidfire_hf.memory.stats import MiB, release_cached_memory

logger = logging.getLogger(__name__)


class OOMRecoveryError(RuntimeError):
    """Raised when an out-of-memory error cannot be recovered by splitting the micro-batch."""


def batch_size(batch: Any) -> int:
    """Number of samples along dim 0 of a tensor, a mapping of tensors/lists, or a list of samples."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        for value in batch.values():
            if isinstance(value, (torch.Tensor, list, tuple)):
                return batch_size(value)
        raise TypeError("cannot tell the batch size of a mapping without tensor or list values")
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return len(batch)
    raise TypeError(f"cannot split a batch of type {type(batch).__name__}: pass split_fn and size_fn")


def split_batch(batch: Any) -> tuple[Any, Any]:
    """Split a batch in two halves along dim 0 (the first half gets the odd sample).

    Tensors and lists of the batch's length in a mapping are split; other values (scalars, ``None``,
    tensors of another length) are given to both halves. The mapping type is kept when it can be built
    from a dict (``dict``, ``BatchEncoding``).
    """
    n = batch_size(batch)
    cut = (n + 1) // 2
    if isinstance(batch, Mapping):
        first, second = {}, {}
        for key, value in batch.items():
            if isinstance(value, (torch.Tensor, list, tuple)) and len(value) == n:
                first[key], second[key] = value[:cut], value[cut:]
            else:
                first[key] = second[key] = value
        try:
            return type(batch)(first), type(batch)(second)
        except Exception:  # a mapping type that cannot be rebuilt from a dict
            return first, second
    return batch[:cut], batch[cut:]


def _share(chunk: Any, total: int) -> float:
    return batch_size(chunk) / total


class OOMRecovery:
    """Runs micro-batches and splits the ones that run out of memory.

    After a split succeeds, later micro-batches are split the same number of times up front (a batch
    that ran out of memory once would again), until :meth:`reset`.

    Args:
        max_splits: Most halvings of one micro-batch (3: down to an eighth) before giving up.
        params: Parameters whose gradients the step accumulates; lets the wrapper check that a retry is
            exact. Without them the caller guarantees that an OOM never happens after backward started.
        split_fn: ``batch -> (first_half, second_half)``; default :func:`split_batch`.
        size_fn: ``batch -> int``; default :func:`batch_size`.
        weight_fn: ``(chunk, full_size) -> float``; default the chunk's share of samples.
        telemetry: A ``TelemetryWriter`` to record ``oom_split`` events in (optional).

    Example:
        >>> recover = OOMRecovery(max_splits=3, params=model.parameters())        # doctest: +SKIP
        >>> def step(chunk, weight):                                              # doctest: +SKIP
        ...     loss = model(**chunk).loss                                        # mean over the chunk
        ...     (loss * weight).backward()
        ...     return loss
        >>> loss = recover(step, micro_batch)  # equals the whole micro-batch's loss  # doctest: +SKIP
    """

    def __init__(
        self,
        max_splits: int = 3,
        params: Iterable[torch.nn.Parameter] | None = None,
        split_fn: Callable[[Any], tuple[Any, Any]] = split_batch,
        size_fn: Callable[[Any], int] = batch_size,
        weight_fn: Callable[[Any, int], float] | None = None,
        telemetry=None,
    ):
        if max_splits < 0:
            raise ValueError(f"max_splits={max_splits!r}: expected an integer >= 0")
        self.max_splits = max_splits
        self.params = list(params) if params is not None else None
        self.split_fn, self.size_fn = split_fn, size_fn
        self.weight_fn = weight_fn or (lambda chunk, total: self.size_fn(chunk) / total)
        self.telemetry = telemetry
        self.splits = 0  # halvings applied up front to every micro-batch
        self.events: list[dict] = []
        self.step: int | None = None  # set by the trainer, for the telemetry record

    def reset(self) -> None:
        """Stop splitting micro-batches up front (e.g. after a phase that freed memory)."""
        self.splits = 0

    def __call__(self, step_fn: Callable[[Any, float], torch.Tensor | float], batch: Any):
        """Run ``step_fn`` on ``batch``, splitting on OOM; return the weighted sum of the chunk losses."""
        return self._run(step_fn, batch, self.size_fn(batch), depth=0)

    def _run(self, step_fn, chunk, total: int, depth: int):
        if depth < self.splits and self.size_fn(chunk) > 1:
            return self._split_and_run(step_fn, chunk, total, depth)
        before = self._grad_state()
        message = None
        try:
            weight = self.weight_fn(chunk, total)
            loss = step_fn(chunk, weight)
            return loss.detach() * weight if isinstance(loss, torch.Tensor) else loss * weight
        except torch.OutOfMemoryError as err:
            # Keep only the text: the traceback's frames hold the failed attempt's activations.
            message = str(err).splitlines()[0] if str(err) else "CUDA out of memory"
        self._restore_or_raise(before, message)
        returned = release_cached_memory(collect_garbage=True)
        size = self.size_fn(chunk)
        if depth >= self.max_splits or size < 2:
            raise OOMRecoveryError(
                f"out of memory on a chunk of {size} sample(s) after splitting the micro-batch {depth} time(s) "
                f"(max_splits={self.max_splits}): {message}. Lower the micro-batch size, raise "
                "memory.optimization (activation checkpointing), or shorten the sequences."
            )
        event = {
            "step": self.step,
            "depth": depth + 1,
            "chunk_size": size,
            "bytes_returned": returned,
            "error": message,
        }
        self.events.append(event)
        if self.telemetry is not None:
            self.telemetry.event("oom_split", **event)
        logger.warning(
            "rapidfire: OOM on %d samples; released %.0f MiB and split in two", size, returned / MiB
        )
        self.splits = max(self.splits, depth + 1)
        return self._split_and_run(step_fn, chunk, total, depth)

    def _split_and_run(self, step_fn, chunk, total: int, depth: int):
        first, second = self.split_fn(chunk)
        return self._run(step_fn, first, total, depth + 1) + self._run(step_fn, second, total, depth + 1)

    def _grad_state(self):
        if self.params is None:
            return None
        return [(p, p._version, p.grad, None if p.grad is None else p.grad._version) for p in self.params]

    def _restore_or_raise(self, before, message: str | None) -> None:
        if before is None:
            return
        fresh = []
        for p, p_version, grad, grad_version in before:
            if p._version != p_version:
                raise OOMRecoveryError(
                    f"out of memory after parameters were updated inside backward ({message}); a retry would "
                    "apply part of the update twice. Turn the gradient pipeline off for OOM recovery."
                )
            if grad is None:
                if p.grad is not None:
                    fresh.append(p)
            elif p.grad is not grad or p.grad._version != grad_version:
                raise OOMRecoveryError(
                    f"out of memory in backward after gradients were added into existing .grad ({message}); "
                    "a retry would count them twice. Lower the micro-batch size instead."
                )
        for p in fresh:  # gradients the failed attempt created: drop them, as if it never ran
            p.grad = None


def run_with_oom_recovery(step_fn, batch, max_splits: int = 3, params=None, **kwargs):
    """One-shot form of :class:`OOMRecovery` (no memory of earlier splits). Same arguments."""
    return OOMRecovery(max_splits=max_splits, params=params, **kwargs)(step_fn, batch)
