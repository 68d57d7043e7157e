"""optim.bnb.skip_bitsandbytes_sync_on_default_stream: installed once, the sync kept off the default stream only."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rapidfire_hf.optim.bnb import skip_bitsandbytes_sync_on_default_stream


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_skip_bitsandbytes_sync_keeps_other_streams_and_cpu_syncing():
    """The wrapper is installed once, passes CPU tensors (and, on CUDA, a non-default current stream) to
    bitsandbytes' own sync_gpu, and an 8-bit AdamW step through it gives the same result as before."""
    import bitsandbytes.optim.optimizer as bnb_optimizer

    original = bnb_optimizer.sync_gpu
    seen = []
    try:
        bnb_optimizer.sync_gpu = lambda t: seen.append(
            t.device.type
        )  # stands for the real sync: record calls
        assert skip_bitsandbytes_sync_on_default_stream() is True
        wrapped = bnb_optimizer.sync_gpu
        assert skip_bitsandbytes_sync_on_default_stream() is True and bnb_optimizer.sync_gpu is wrapped
        wrapped(torch.zeros(1))
        assert seen == ["cpu"]
        if torch.cuda.is_available():
            t = torch.zeros(1, device="cuda")
            wrapped(t)
            assert seen == ["cpu"]  # default stream: skipped
            with torch.cuda.stream(torch.cuda.Stream()):
                wrapped(t)
            assert seen == ["cpu", "cuda"]
    finally:
        bnb_optimizer.sync_gpu = original
