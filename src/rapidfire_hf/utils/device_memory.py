"""The size of the card a run may use, and what it can still allocate there: the one place that reads the
device's capacity, so that a per-process cap (``torch.cuda.set_per_process_memory_fraction``) is honoured by
every plan and budget, not only by the caching allocator that enforces it."""

from __future__ import annotations

import torch


def _cuda(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


def device_capacity_bytes(device=None) -> int:
    """Bytes this process may hold on a CUDA ``device``: the card's memory times the per-process fraction
    set with ``torch.cuda.set_per_process_memory_fraction`` (1.0 unless set). A run capped to 80 GiB of a
    141 GB card thus plans for 80 GiB instead of planning past what the allocator will give."""
    device = _cuda(device)
    total = torch.cuda.get_device_properties(device).total_memory
    read = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # an older torch cannot read the cap
    fraction = float(read(device)) if read is not None else 1.0
    return int(total * min(fraction, 1.0))


def device_free_bytes(device=None) -> int:
    """Bytes a new allocation on a CUDA ``device`` can still get: the driver's free memory plus the caching
    allocator's reserved-but-unallocated bytes, never more than the per-process cap leaves
    (:func:`device_capacity_bytes` minus what the allocator has reserved)."""
    device = _cuda(device)
    free, _ = torch.cuda.mem_get_info(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    return int(max(0, min(free, device_capacity_bytes(device) - reserved)) + reserved - allocated)
