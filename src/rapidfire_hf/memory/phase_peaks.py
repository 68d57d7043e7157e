"""The measured memory peak of each phase of an update, next to the plan's prediction of it.

The throughput plan predicts the peak of generation, scoring and training (``Plan.phase_peak_bytes``,
logged once as ``rapidfire/plan/<phase>_peak_gib``). :class:`PhasePeaks` measures the same three on a CUDA
device: the caching allocator's peak is reset before each phase and read after it
(``torch.cuda.max_memory_allocated``), so every update logs ``rapidfire/memory/<phase>_peak_gib`` and the
run's peak across the resets (``rapidfire/memory/peak_gib``). On other devices nothing is measured and
nothing is logged.
"""

from __future__ import annotations

import contextlib

import torch

GIB = 1024**3
PHASES = ("generation", "scoring", "training")


class PhasePeaks:
    """Allocator peak per phase of the last update, and of the run (module docstring).

    Args:
        device: the device the phases run on; only a CUDA device is measured.
    """

    def __init__(self, device):
        device = torch.device(device)
        self.device = device
        self.measured = device.type == "cuda" and torch.cuda.is_available()
        self.last: dict[str, int] = {}  # phase -> its peak in the last update, bytes
        self.overall = 0  # the run's peak across the resets

    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure the allocator's peak while the body runs, as phase ``name``."""
        if name not in PHASES:
            raise ValueError(f"phase {name!r}: expected one of {', '.join(PHASES)}")
        if not self.measured:
            yield
            return
        self.overall = max(self.overall, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            peak = torch.cuda.max_memory_allocated(self.device)
            self.last[name] = peak
            self.overall = max(self.overall, peak)

    def metrics(self) -> dict[str, float]:
        """``rapidfire/memory/<phase>_peak_gib`` of the last update and ``rapidfire/memory/peak_gib``."""
        if not self.last:
            return {}
        out = {f"rapidfire/memory/{p}_peak_gib": round(b / GIB, 3) for p, b in self.last.items()}
        out["rapidfire/memory/peak_gib"] = round(self.overall / GIB, 3)
        return out
