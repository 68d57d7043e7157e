"""``BatchPrefetcher``: prepare the next ``window`` batches while the current one trains.

On CUDA each upcoming batch is pinned and copied to the GPU on a side stream, so the host-to-device copy
overlaps compute; the training stream waits on the copy's event only when it takes the batch. On CPU it
is a plain look-ahead iterator (the order and the values are unchanged either way).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch


def map_tensors(batch: Any, fn) -> Any:
    """Apply ``fn`` to every tensor in a nested tensor / mapping / list / tuple; keep the structure."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(mapped)
        except Exception:  # a mapping type that cannot be rebuilt from a dict
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


class BatchPrefetcher:
    """Iterate over ``iterable`` with the next ``window`` batches already on their way to ``device``.

    Args:
        iterable: Batches (a DataLoader or any iterable of tensors / dicts / lists of tensors).
        window: Batches prepared ahead (``memory.prefetch_window``); 0 yields batches as they come.
        device: Target device. ``None`` or a CPU device: no copy, look-ahead only.
        pin_memory: Pin host tensors before the copy (default: ``True`` for a CUDA target). A DataLoader
            with ``pin_memory=True`` already pins; pinned tensors are not copied again.

    Example:
        >>> for batch in BatchPrefetcher(loader, window=2, device="cuda"):  # doctest: +SKIP
        ...     loss = model(**batch).loss
    """

    def __init__(
        self,
        iterable: Iterable,
        window: int = 2,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
    ):
        if window < 0:
            raise ValueError(f"prefetch window={window!r}: expected an integer >= 0")
        self.iterable = iterable
        self.window = window
        self.device = torch.device(device) if device is not None else None
        self.cuda = self.device is not None and self.device.type == "cuda"
        self.pin_memory = self.cuda if pin_memory is None else pin_memory

    def __len__(self) -> int:
        return len(self.iterable)

    def __iter__(self) -> Iterator:
        source = iter(self.iterable)
        stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        queue: deque = deque()

        def fill():
            while len(queue) < max(1, self.window):
                try:
                    batch = next(source)
                except StopIteration:
                    return
                queue.append(self._start_copy(batch, stream))

        fill()
        while queue:
            entry = queue.popleft()
            if self.window:
                fill()  # start the following copies before handing this batch over
            yield self._finish(entry)
            if not self.window:
                fill()

    def _start_copy(self, batch, stream):
        if self.device is None or self.device.type == "cpu":
            return batch, None
        if not self.cuda:
            return map_tensors(batch, lambda t: t.to(self.device)), None

        def copy(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu" and self.pin_memory and not t.is_pinned():
                t = t.pin_memory()
            return t.to(self.device, non_blocking=True)

        # the copies must follow whatever produced the host data on the current stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            moved = map_tensors(batch, copy)
            done = torch.cuda.Event()
            done.record(stream)
        return moved, done

    def _finish(self, entry):
        moved, done = entry
        if done is None:
            return moved
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)

        def hand_over(t: torch.Tensor) -> torch.Tensor:
            # tell the caching allocator the training stream uses this memory now (it was allocated on
            # the side stream and would otherwise be reused as soon as the side stream moves on)
            if t.is_cuda:
                t.record_stream(current)
            return t

        return map_tensors(moved, hand_over)
