"""memory.offload.OptimizerStateOffload: the state leaves the device and comes back as the same tensor objects,
and the next optimizer step is the one without offloading (torch AdamW, bitsandbytes' 8-bit AdamW; CPU).
``HostOffloader`` is checked through chunked checkpointing in tests/integrations/test_grpo_lowmem.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rapidfire_hf.memory.offload import OptimizerStateOffload


def _trained_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_state_offload_round_trip_keeps_tensor_objects_and_the_next_step():
    model, opt = _trained_optimizer()
    twin, twin_opt = _trained_optimizer()
    state = {id(p): dict(s) for p, s in opt.state.items()}
    values = {(id(p), k): v.clone() for p, s in opt.state.items() for k, v in s.items()}
    off = OptimizerStateOffload(opt, include_cpu=True)
    moved = off.offload()
    assert moved == sum(v.numel() * v.element_size() for v in values.values())
    assert all(v.untyped_storage().nbytes() == 0 for s in opt.state.values() for v in s.values())
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload()
    off.restore()
    off.wait()
    for p, s in opt.state.items():
        for k, v in s.items():
            assert v is state[id(p)][k]  # the same tensor object the optimizer (or a bucket view) holds
            assert torch.equal(v, values[(id(p), k)])
    for m, o in ((model, opt), (twin, twin_opt)):  # the next step is the one without offloading
        o.zero_grad()
        m(torch.ones(4, 8)).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    # CPU state is left alone unless asked (the benchmark moves GPU state only)
    assert OptimizerStateOffload(opt).offload() == 0


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_optimizer_state_offload_with_bitsandbytes_8bit_state(single_thread):
    import bitsandbytes as bnb

    def trained(offload: bool):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 128))  # >= 4096 elements: 8-bit state (uint8 + absmax + qmap)
        opt = bnb.optim.AdamW([w], lr=1e-2, optim_bits=8)
        for step in range(3):
            w.grad = torch.randn(64, 128, generator=torch.Generator().manual_seed(step))
            opt.step()
            if offload:
                off = OptimizerStateOffload(opt, include_cpu=True)
                assert off.offload() > 0 and opt.state[w]["state1"].untyped_storage().nbytes() == 0
                off.restore()
        return w, opt

    (w0, opt0), (w1, opt1) = trained(False), trained(True)
    assert opt1.state[w1]["state1"].dtype == torch.uint8
    assert torch.equal(w0, w1)
    for k, v in opt0.state[w0].items():
        if torch.is_tensor(v):
            assert torch.equal(v, opt1.state[w1][k]), k


def test_optimizer_state_offload_moves_a_shared_storage_once():
    p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    shared = torch.arange(16, dtype=torch.float32)  # like bitsandbytes' qmap, shared by every parameter
    opt = torch.optim.SGD([p, q], lr=0.1)
    opt.state[p] = {"qmap": shared, "m": torch.ones(4)}
    opt.state[q] = {"qmap": shared, "m": torch.ones(4)}
    off = OptimizerStateOffload(opt, include_cpu=True)
    assert off.offload() == 16 * 4 + 2 * 4 * 4
    off.restore()
    assert torch.equal(opt.state[p]["qmap"], torch.arange(16, dtype=torch.float32))
    assert opt.state[q]["qmap"] is shared
