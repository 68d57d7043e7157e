"""Timing with warm-up: a synchronising timer and the median / min / max of the timed repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer:
    """``with Timer(device) as t: ...`` then ``t.seconds``; waits for the device on entry and exit."""

    def __init__(self, device="cpu"):
        self.device = device
        self.seconds: float | None = None

    def __enter__(self) -> Timer:
        _sync(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync(self.device)
        self.seconds = time.perf_counter() - self._t0


def summarize(samples: list[float], warmup: int = 0) -> dict:
    """Median, min and max of ``samples[warmup:]`` (the warm-up samples are reported, not counted).

    Raises:
        ValueError: when no sample is left after the warm-up.
    """
    timed_samples = list(samples[warmup:])
    if not timed_samples:
        raise ValueError(f"{len(samples)} samples with warmup={warmup}: nothing left to summarize")
    return {
        "median": statistics.median(timed_samples),
        "min": min(timed_samples),
        "max": max(timed_samples),
        "n": len(timed_samples),
        "warmup": list(samples[:warmup]),
    }


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1, device="cpu") -> dict:
    """Call ``fn`` ``warmup + repeats`` times and ``summarize`` the seconds of the last ``repeats``."""
    samples = []
    for _ in range(warmup + repeats):
        with Timer(device) as t:
            fn()
        samples.append(t.seconds)
    return {**summarize(samples, warmup), "samples": samples[warmup:]}
