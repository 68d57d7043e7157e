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


class Fake8bitAdamW(torch.optim.AdamW):
    """A 32-bit optimizer whose class name says 8bit: a name probe would get it wrong."""


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_eight_bit_state_is_read_from_the_setting_not_the_class_name():
    """8-bit state is bitsandbytes' ``optim_bits=8``, whatever the class is called, wrapped or not; the
    snapshot estimate counts 1 byte per moment for it."""
    import types

    import bitsandbytes as bnb

    from rapidfire_hf.optim import RapidFireOptimizer
    from rapidfire_hf.optim.bnb import eight_bit_state
    from rapidfire_hf.optim.step_health import eight_bit_optimizer
    from rapidfire_hf.optim.verification import snapshot_bytes

    params = [torch.nn.Parameter(torch.zeros(64))]
    assert eight_bit_state(bnb.optim.Adam(params, lr=0.1, optim_bits=8))  # no "8bit" in the name
    assert not eight_bit_state(bnb.optim.AdamW(params, lr=0.1))  # bitsandbytes' 32-bit AdamW
    assert not eight_bit_state(Fake8bitAdamW(params, lr=0.1))
    assert eight_bit_state(bnb.optim.AdamW8bit(params, lr=0.1))
    rf = RapidFireOptimizer(params, optimizer="adamw8bit", lr=0.1)
    assert rf.eight_bit_state and eight_bit_optimizer(rf)
    assert eight_bit_optimizer(types.SimpleNamespace(optimizer=rf))  # behind accelerate's wrapper
    assert not eight_bit_optimizer(types.SimpleNamespace(optimizer=Fake8bitAdamW(params, lr=0.1)))
    assert not RapidFireOptimizer(optimizer="adamw8bit", lr=0.1).eight_bit_state  # unbound: no state yet
    pbytes = 64 * 4
    assert snapshot_bytes(params, bnb.optim.Adam(params, lr=0.1, optim_bits=8)) == pbytes + 2 * 2 * 64
    assert snapshot_bytes(params, Fake8bitAdamW(params, lr=0.1)) == pbytes + 2 * 2 * pbytes
