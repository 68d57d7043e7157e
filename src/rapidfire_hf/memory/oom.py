"""OOM recovery: on ``torch.OutOfMemoryError`` in a micro-batch, compact, split it in halves and retry.

The contract that keeps the optimizer update identical: ``step_fn(chunk, weight)`` runs forward and
backward of ``weight * loss(chunk)``, where ``loss(chunk)`` is normalised the way the full micro-batch's
loss is (usually a mean over the chunk's samples) and returns the unweighted loss. The default weight is
``len(chunk) / len(micro_batch)``, so the gradients of the halves add up to the gradient of the whole
(a sum of means weighted by their share is the mean). For a loss already normalised by a fixed count
(e.g. the tokens of the whole accumulation window, ``num_items_in_batch``) pass
``weight_fn=lambda chunk, batch_size: 1.0``; for a per-token mean inside the micro-batch pass a weight
that is the chunk's share of tokens.

One micro-batch is one backward of the accumulation window, however many pieces it is cut into. When it
closes the window (``sync_gradients``), only its last piece may close it: every earlier piece runs inside
``hold()`` (for accelerate, :func:`accelerate_hold`: ``sync_gradients`` False and DDP's ``no_sync``), so
a gradient pipeline's hooks, DeepSpeed's step and DDP's all-reduce run once, on the last piece, over the
complete gradient.

A retry is exact only when the failed attempt left no gradient behind. Before each attempt the wrapper
notes every parameter's ``.grad`` (object and version counter); after an OOM, gradients that did not exist
before are dropped again (exact), and an OOM after backward had already added into existing gradients, or
after an optimizer step changed parameters inside backward, is not retried (it would count a part twice):
it raises :class:`OOMRecoveryError` saying so. With a gradient pipeline on (``optimizer=`` given), an OOM
in a backward that may close the window and had created gradients is refused too: the pipeline's hooks
may already have counted them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from rapidfire_hf.memory.stats import MiB, release_cached_memory

logger = logging.getLogger(__name__)

DEFAULT_ADVICE = "Lower the micro-batch size or the sequence length, or allow more splits (max_splits)."


class OOMRecoveryError(RuntimeError):
    """Raised when an out-of-memory error cannot be recovered by splitting the micro-batch."""


def batch_size(batch: Any) -> int:
    """Number of samples along dim 0 of a tensor, a mapping of tensors/lists, or a list of samples."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        for value in batch.values():
            if isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() > 0):
                return batch_size(value)
        raise TypeError("cannot tell the batch size of a mapping without tensor or list values")
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return len(batch)
    raise TypeError(f"cannot split a batch of type {type(batch).__name__}: pass split_fn and size_fn")


def unit_weight(chunk: Any, total: int) -> float:
    """``weight_fn`` of a step that normalises every piece by the whole micro-batch itself (its loss takes
    the whole's counts): each piece weighs 1."""
    return 1.0


def split_batch(batch: Any) -> tuple[Any, Any]:
    """Split a batch in two halves along dim 0 (the first half gets the odd sample).

    Tensors and lists of the batch's length in a mapping are split; other values (scalars, ``None``,
    0-d tensors, tensors of another length) are given to both halves. The mapping type is kept when it can be built
    from a dict (``dict``, ``BatchEncoding``).
    """
    n = batch_size(batch)
    cut = (n + 1) // 2
    if isinstance(batch, Mapping):
        first, second = {}, {}
        for key, value in batch.items():
            rows = isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() > 0)
            if rows and len(value) == n:
                first[key], second[key] = value[:cut], value[cut:]
            else:
                first[key] = second[key] = value
        try:
            return type(batch)(first), type(batch)(second)
        except Exception:  # a mapping type that cannot be rebuilt from a dict
            return first, second
    return batch[:cut], batch[cut:]


@contextlib.contextmanager
def accelerate_hold(accelerator, model=None):
    """Backwards inside do not close accelerate's accumulation window.

    ``sync_gradients`` is False inside (the gradient pipeline's hooks wait, DeepSpeed does not step) and
    ``model`` skips DDP's all-reduce (``accelerator.no_sync``); both are as before afterwards. A no-op
    when the window is not closing anyway.
    """
    state = accelerator.gradient_state
    if not state.sync_gradients:
        yield
        return
    state._set_sync_gradients(False)
    try:
        with accelerator.no_sync(model) if model is not None else contextlib.nullcontext():
            yield
    finally:
        state._set_sync_gradients(True)


def pipeline_state(optimizer) -> tuple[bool, bool]:
    """``(pipeline on, counts backwards itself)`` of the RapidFireOptimizer inside ``optimizer`` (any
    wrapping through ``.optimizer``, e.g. accelerate's); ``(False, False)`` for other optimizers."""
    seen = 0
    while optimizer is not None and seen < 8:
        if hasattr(optimizer, "pipeline_enabled"):
            on = bool(optimizer.pipeline_enabled)
            return on, on and getattr(optimizer, "accumulation_steps", None) is not None
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return False, False


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
        combine: ``(first_result, second_result) -> result`` for a ``step_fn`` whose result is not a
            loss to weight (e.g. a dataclass of statistics already normalised by the whole micro-batch);
            default: the weighted sum of the chunk losses.
        hold: A context manager factory in which a backward does not close the accumulation window
            (e.g. ``lambda: accelerate_hold(accelerator, model)``); every piece of a split micro-batch
            but the last runs inside it. Without it, a gradient pipeline or DeepSpeed would step on each
            piece of a window's closing micro-batch.
        release: Returns cached memory to the device after an OOM and the bytes it gave back; default
            ``release_cached_memory(collect_garbage=True)``.
        optimizer: The optimizer (a ``RapidFireOptimizer``, possibly wrapped), to refuse what its
            gradient pipeline makes unrecoverable.
        advice: The sentence of the final error that says which settings lower memory (name only
            settings of the caller that act).

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
        *,
        combine: Callable[[Any, Any], Any] | None = None,
        hold: Callable[[], contextlib.AbstractContextManager] | None = None,
        release: Callable[[], int] | None = None,
        optimizer=None,
        advice: str = DEFAULT_ADVICE,
    ):
        if isinstance(max_splits, bool) or not isinstance(max_splits, int) or max_splits < 0:
            raise ValueError(f"max_splits={max_splits!r}: expected an integer >= 0")
        self.max_splits = max_splits
        self.params = list(params) if params is not None else None
        self.split_fn, self.size_fn = split_fn, size_fn
        self.weight_fn = weight_fn or (lambda chunk, total: self.size_fn(chunk) / total)
        self.telemetry = telemetry
        self.combine = combine
        self.hold = hold
        self.release = release or (lambda: release_cached_memory(collect_garbage=True))
        self.optimizer = optimizer
        self.advice = advice
        self.splits = 0  # halvings applied up front to every micro-batch
        # halvings a plan asked for (the micro-batch does not fit whole): applied up front from the start and
        # after every reset, never counted as OOM events; max_splits counts the OOM halvings beyond them
        self.planned_splits = 0
        self.events: list[dict] = []
        self.step: int | None = None  # set by the trainer, for the telemetry record
        self._held = 0  # depth of hold() contexts the current attempt runs in

    def reset(self) -> None:
        """Split micro-batches up front only as planned (e.g. after a phase that freed memory)."""
        self.splits = self.planned_splits

    def plan_splits(self, halvings: int) -> None:
        """Halve every micro-batch ``halvings`` times up front from now on (a plan's split; not an OOM)."""
        self.planned_splits = halvings
        self.splits = max(self.splits, halvings)

    def __call__(self, step_fn: Callable[[Any, float], Any], batch: Any):
        """Run ``step_fn`` on ``batch``, splitting on OOM; return the combined result of the chunks."""
        return self._run(step_fn, batch, self.size_fn(batch), depth=0)

    def _run(self, step_fn, chunk, total: int, depth: int):
        if depth < self.splits and self.size_fn(chunk) > 1:
            return self._split_and_run(step_fn, chunk, total, depth)
        before = self._grad_state()
        message = None
        try:
            weight = self.weight_fn(chunk, total)
            result = step_fn(chunk, weight)
            if self.combine is not None:
                return result
            return result.detach() * weight if isinstance(result, torch.Tensor) else result * weight
        except torch.OutOfMemoryError as err:
            # Keep only the text: the traceback's frames hold the failed attempt's activations.
            message = str(err).splitlines()[0] if str(err) else "CUDA out of memory"
        self._restore_or_raise(before, message)
        returned = self.release()
        size = self.size_fn(chunk)
        if depth >= self.max_splits + self.planned_splits or size < 2:
            raise OOMRecoveryError(
                f"out of memory on a chunk of {size} sample(s) after splitting the micro-batch {depth} time(s) "
                f"(max_splits={self.max_splits}): {message}. {self.advice}"
            )
        if pipeline_state(self.optimizer)[1]:
            raise OOMRecoveryError(
                f"out of memory in a micro-batch ({message}) with a gradient pipeline that counts backwards "
                "itself (RapidFireOptimizer(accumulation_steps=...)): the pieces of a split would be counted "
                "as micro-batches. Let accelerate mark the window (accumulation_steps=None). " + self.advice
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
            "rapidfire: OOM on a micro-batch chunk of %d samples; released %.0f MiB and split it in two",
            size,
            returned / MiB,
        )
        self.splits = max(self.splits, depth + 1)
        return self._split_and_run(step_fn, chunk, total, depth)

    def _split_and_run(self, step_fn, chunk, total: int, depth: int):
        first, second = self.split_fn(chunk)
        with self._holding():  # the first half never closes the window: the second (or its last piece) does
            a = self._run(step_fn, first, total, depth + 1)
        b = self._run(step_fn, second, total, depth + 1)
        return self.combine(a, b) if self.combine is not None else a + b

    @contextlib.contextmanager
    def _holding(self):
        self._held += 1
        try:
            with self.hold() if self.hold is not None else contextlib.nullcontext():
                yield
        finally:
            self._held -= 1

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
                    f"a retry would count them twice. {self.advice}"
                )
        if fresh and not self._held and pipeline_state(self.optimizer)[0]:
            raise OOMRecoveryError(
                f"out of memory in a backward that a gradient pipeline steps during ({message}); its hooks "
                "may have counted the partial gradients, so a retry is not exact. Turn the gradient pipeline "
                f"off (gradient.pipeline: false) for OOM recovery in backward. {self.advice}"
            )
        for p in fresh:  # gradients the failed attempt created: drop them, as if it never ran
            p.grad = None


def run_in_chunks(
    run: Callable[[int, int], Any],
    n: int,
    chunk: int,
    what: str,
    on_oom: Callable[[], None] | None = None,
    device: torch.device | None = None,
    advice: str = "Lower the sequence length.",
    next_stop: Callable[[int, int], int] | None = None,
) -> list:
    """``[run(start, stop) for consecutive chunks of n rows]`` of a no-grad phase, halving the chunk on OOM.

    ``next_stop(start, chunk)`` gives where the chunk that begins at ``start`` ends when chunks are not
    all ``chunk`` rows (at most ``chunk``, e.g. a sweep's scoring packs, cut so that no piece straddles two
    trials); default ``min(n, start + chunk)``.

    After an OOM the chunk is halved, ``on_oom`` runs (e.g. drop a KV cache built for the failed shape),
    cached memory is released, the global RNG (CPU, and ``device`` when it is a CUDA device) is put back
    to where it was before the failed chunk, and the rows of that chunk are run again; the smaller size
    is kept for the rest of the call. Rows are computed independently, so the results are those of a run
    with the smaller chunk from there on (the same as without the OOM unless ``run`` samples). Each retry
    logs a warning.

    Raises:
        OOMRecoveryError: a single row does not fit; says ``advice``.
    """
    out, start = [], 0
    while start < n:
        stop = next_stop(start, chunk) if next_stop is not None else min(n, start + chunk)
        cpu_rng = torch.random.get_rng_state()
        on_cuda = device is not None and torch.device(device).type == "cuda"
        cuda_rng = torch.cuda.get_rng_state(device) if on_cuda else None
        try:
            out.append(run(start, stop))
        except torch.OutOfMemoryError as err:
            message = str(err).splitlines()[0] if str(err) else "CUDA out of memory"
            if stop - start < 2:
                raise OOMRecoveryError(
                    f"out of memory in {what} even on a single row ({message}). {advice}"
                ) from None
            if on_oom is not None:
                on_oom()
            torch.random.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, device)
            returned = release_cached_memory(collect_garbage=True)
            chunk = (stop - start + 1) // 2
            logger.warning(
                "rapidfire: OOM in %s on %d rows (%s); released %.0f MiB, retrying %d rows at a time",
                what,
                stop - start,
                message,
                returned / MiB,
                chunk,
            )
            continue
        start = stop
    return out


def run_with_oom_recovery(step_fn, batch, max_splits: int = 3, params=None, **kwargs):
    """One-shot form of :class:`OOMRecovery` (no memory of earlier splits). Same arguments."""
    return OOMRecovery(max_splits=max_splits, params=params, **kwargs)(step_fn, batch)
