"""utils.device_memory: the card's size every plan reads honours the per-process cap that
``torch.cuda.set_per_process_memory_fraction`` sets (the caching allocator enforces it; a plan past it
would count on memory the run cannot get). The CUDA calls are replaced by a fake 141 GB card."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rapidfire_hf.memory.checkpointing import free_device_bytes, level_budget
from rapidfire_hf.utils import device_memory
from rapidfire_hf.utils.device_memory import device_capacity_bytes, device_free_bytes

GIB = 1 << 30
TOTAL = 140 * GIB


@pytest.fixture
def card(monkeypatch):
    state = {"fraction": 1.0, "free": 130 * GIB, "reserved": 6 * GIB, "allocated": 4 * GIB}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=TOTAL))
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d: state["fraction"])
    monkeypatch.setattr(cuda, "mem_get_info", lambda d: (state["free"], TOTAL))
    monkeypatch.setattr(cuda, "memory_reserved", lambda d: state["reserved"])
    monkeypatch.setattr(cuda, "memory_allocated", lambda d: state["allocated"])
    assert device_memory.torch.cuda is cuda
    return state


def test_capacity_is_the_card_times_the_process_fraction(card):
    assert device_capacity_bytes("cuda:0") == TOTAL
    card["fraction"] = 80 / 140
    assert device_capacity_bytes("cuda") == pytest.approx(80 * GIB, abs=1)


def test_free_bytes_stop_at_the_cap(card):
    # uncapped: the driver's free memory plus reserved-but-unallocated
    assert device_free_bytes("cuda:0") == 130 * GIB + 2 * GIB
    card["fraction"] = 0.5  # 70 GiB may be held; 6 reserved: 64 more from the driver, plus 2 reusable
    assert device_free_bytes("cuda:0") == 64 * GIB + 2 * GIB
    assert free_device_bytes("cuda:0") == device_free_bytes("cuda:0")
    card["reserved"] = card["allocated"] = 75 * GIB  # past the cap already: nothing more
    assert device_free_bytes("cuda:0") == 0


def test_level_budget_targets_a_share_of_the_capped_card(card):
    full = level_budget("cuda:0", "aggressive").target_bytes
    card["fraction"] = 0.5
    half = level_budget("cuda:0", "aggressive").target_bytes
    assert half == pytest.approx(full / 2, rel=1e-6)


def test_a_torch_that_cannot_read_the_cap_plans_for_the_whole_card(card, monkeypatch):
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")
    assert device_capacity_bytes("cuda:0") == TOTAL
