"""Memory measurement: one ``MemorySample`` per step or phase boundary, and the compaction decision.

Everything here reads host-side counters only (``torch.cuda.memory_stats`` is kept by the caching
allocator on the CPU), so taking a sample never synchronises with the GPU.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from rapidfire_hf.utils.units import MIB as MiB  # the name memory.oom/callback import


@dataclass
class MemorySample:
    """What the process holds at one moment. CUDA fields are ``None`` on a CPU-only run.

    Attributes:
        t: Unix time of the sample.
        device: ``"cuda:<index>"`` or ``"cpu"``.
        rss_bytes: Resident set size of the process (host memory).
        allocated: Bytes held by live tensors (``allocated_bytes.all.current``).
        reserved: Bytes the caching allocator holds from the driver (``reserved_bytes.all.current``).
        peak_allocated: Highest ``allocated`` since the process started or peaks were last reset.
        peak_reserved: Highest ``reserved`` likewise.
        inactive_split_bytes: Free bytes inside segments that still hold live blocks. The allocator can
            reuse them for requests that fit, ``empty_cache`` cannot return them.
        inactive_split_blocks: How many such free pieces there are (many small ones = fragmented).
        num_alloc_retries: Times a cudaMalloc failed and the allocator freed its cache to retry (each one
            is a full synchronisation: a sign that the cache is fragmented).
        num_ooms: Out-of-memory errors raised by the allocator so far.
        holdings: Bytes by kind: ``parameters``, ``gradients``, ``optimizer_state`` (from the model and
            optimizer when known) and ``activations_and_cache`` (the rest of ``allocated``, CUDA only).
    """

    t: float
    device: str
    rss_bytes: int
    allocated: int | None = None
    reserved: int | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    inactive_split_bytes: int | None = None
    inactive_split_blocks: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    holdings: dict[str, int] = field(default_factory=dict)

    @property
    def fragmentation(self) -> float | None:
        """``1 - allocated/reserved``: the share of reserved memory no tensor uses (0 when nothing is reserved)."""
        if self.reserved is None:
            return None
        if self.reserved <= 0:
            return 0.0
        return max(0.0, 1.0 - self.allocated / self.reserved)

    @property
    def cached_free_bytes(self) -> int | None:
        """Reserved but unused bytes: reusable by later allocations, or returned by a compaction."""
        if self.reserved is None:
            return None
        return max(0, self.reserved - self.allocated)

    def to_dict(self) -> dict:
        """A JSON-ready dict, with the derived ``fragmentation`` and ``cached_free_bytes``."""
        out = asdict(self)
        out["fragmentation"] = self.fragmentation
        out["cached_free_bytes"] = self.cached_free_bytes
        return out


def _rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:  # psutil missing or the platform refuses: RSS is informative only
        return 0


def _tensor_bytes(tensors: Iterable[torch.Tensor], device_type: str) -> int:
    # Tied weights and views share storage: count each (pointer, size) once.
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t is None or t.device.type != device_type or t.is_meta:
            continue
        key = (t.data_ptr(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _optimizer_tensors(optimizer) -> Iterable[torch.Tensor]:
    state = getattr(optimizer, "state", None) or {}
    for per_param in state.values():
        if isinstance(per_param, dict):
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    yield value


def holdings(model=None, optimizer=None, device_type: str = "cuda") -> dict[str, int]:
    """Bytes held by parameters, gradients and optimizer state on ``device_type``.

    Args:
        model: A ``torch.nn.Module`` (or ``None``).
        optimizer: A ``torch.optim.Optimizer`` or anything with a ``state`` mapping (or ``None``).
        device_type: Count only tensors on this device type.

    Returns:
        A dict with the keys that could be computed.
    """
    out: dict[str, int] = {}
    if model is not None:
        params = list(model.parameters())
        out["parameters"] = _tensor_bytes(params, device_type)
        out["gradients"] = _tensor_bytes((p.grad for p in params), device_type)
    if optimizer is not None:
        out["optimizer_state"] = _tensor_bytes(_optimizer_tensors(optimizer), device_type)
    return out


def cuda_in_use() -> bool:
    """Whether this process has initialised CUDA (sampling must never be the thing that initialises it)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def sample_memory(model=None, optimizer=None, device: int | None = None) -> MemorySample:
    """Take a ``MemorySample`` without synchronising the GPU.

    Args:
        model: Optional model whose parameters and gradients are counted.
        optimizer: Optional optimizer whose state is counted.
        device: CUDA device index (default: the current device).
    """
    now = time.time()
    if not cuda_in_use():
        return MemorySample(
            t=now, device="cpu", rss_bytes=_rss_bytes(), holdings=holdings(model, optimizer, "cpu")
        )
    index = torch.cuda.current_device() if device is None else device
    stats = torch.cuda.memory_stats(index)
    kinds = holdings(model, optimizer, "cuda")
    sample = MemorySample(
        t=now,
        device=f"cuda:{index}",
        rss_bytes=_rss_bytes(),
        allocated=int(stats.get("allocated_bytes.all.current", 0)),
        reserved=int(stats.get("reserved_bytes.all.current", 0)),
        peak_allocated=int(stats.get("allocated_bytes.all.peak", 0)),
        peak_reserved=int(stats.get("reserved_bytes.all.peak", 0)),
        inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
        inactive_split_blocks=int(stats.get("inactive_split.all.current", 0)),
        num_alloc_retries=int(stats.get("num_alloc_retries", 0)),
        num_ooms=int(stats.get("num_ooms", 0)),
        holdings=kinds,
    )
    known = sum(kinds.values())
    kinds["activations_and_cache"] = max(0, sample.allocated - known)
    return sample


def compaction_reason(
    sample: MemorySample,
    threshold: float,
    steps_since_last: int | None,
    min_interval_steps: int,
    min_release_bytes: int = 64 * MiB,
    min_reserved_bytes: int | None = None,
) -> str | None:
    """Decide whether to release cached blocks now. A pure function of its arguments.

    A compaction costs the allocator fresh cudaMalloc calls on the next step, so it is done only when
    (1) fragmentation is above ``threshold``, (2) at least ``min_interval_steps`` steps have passed since
    the last one (never on every step), and (3) there is at least ``min_release_bytes`` to give back.

    Args:
        sample: The current measurement.
        threshold: ``compaction_threshold`` (fragmentation above which to compact), in (0, 1].
        steps_since_last: Steps since the last compaction, ``None`` when there was none.
        min_interval_steps: Fewest steps between two threshold compactions.
        min_release_bytes: Smallest amount of cached free memory worth a compaction.
        min_reserved_bytes: (4) compact only when the allocator holds at least this much (memory
            pressure); None: no such condition. The callback sets it under expandable segments, where
            a compaction measured on an H200 lowered no peak and cost 12% of the step time
            (benchmarks/memory/results/h200/first_run).

    Returns:
        A human-readable reason to compact, or ``None`` to leave the cache alone.
    """
    frag = sample.fragmentation
    if frag is None or frag <= threshold:
        return None
    if steps_since_last is not None and steps_since_last < min_interval_steps:
        return None
    if (sample.cached_free_bytes or 0) < min_release_bytes:
        return None
    if min_reserved_bytes is not None and (sample.reserved or 0) < min_reserved_bytes:
        return None
    return f"fragmentation {frag:.2f} > threshold {threshold:.2f}"


def release_cached_memory(collect_garbage: bool = False) -> int:
    """Return the allocator's free cached blocks to the driver (``torch.cuda.empty_cache``).

    Args:
        collect_garbage: Run ``gc.collect()`` first, so tensors kept alive only by reference cycles are
            freed too (tens of milliseconds on a large heap: used after an OOM, not on the regular path).

    Returns:
        Bytes of reserved memory given back (0 on CPU).
    """
    if collect_garbage:
        gc.collect()
    if not cuda_in_use():
        return 0
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return max(0, before - torch.cuda.memory_reserved())


def clear_cublas_workspaces() -> bool:
    """Free cuBLAS's per-(handle, stream) workspaces (CUDA only; False where torch has no such call).

    Why: the static rollout engine warms every newly recorded decode graph up on a fresh
    ``torch.cuda.Stream()``; cuBLAS allocates a workspace (32 MiB on Hopper) through the caching allocator
    for each stream it runs a GEMM on, and torch keeps it until this call. With the engine released after
    every rollout (graphs recorded again each time) that is one more workspace per rollout, up to the 32
    streams of torch's stream pool (measured on an H200: ~0.031 GiB more allocated per step at the start of
    generation). Workspaces come back on the next GEMM of each stream. Call only when no recorded CUDA
    graph uses them (after ``RolloutEngine.release()``).
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    clear()
    return True
