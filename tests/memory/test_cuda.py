"""The same mechanisms on a real GPU: compaction returns cached memory, a real OOM is split and recovered."""

from __future__ import annotations

import copy

import pytest
import torch

from rapidfire_hf.memory import MemoryCompactionCallback, OOMRecovery, TelemetryWriter
from rapidfire_hf.memory.stats import MiB

pytestmark = pytest.mark.gpu


def test_threshold_compaction_returns_cached_blocks(tmp_path):
    """pressure_fraction=0: compact on fragmentation alone. The default waits for memory pressure (85% of
    the GPU reserved), which 1 GiB is not."""
    default = MemoryCompactionCallback(compaction_threshold=0.3, min_interval_steps=1, telemetry=False)
    cb = MemoryCompactionCallback(
        compaction_threshold=0.3,
        min_interval_steps=1,
        pressure_fraction=0.0,
        telemetry=TelemetryWriter(tmp_path, register=False),
    )
    keep = torch.ones(64 * MiB, dtype=torch.uint8, device="cuda")
    scratch = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")
    del scratch  # freed to the cache, still reserved
    assert default.maybe_compact(default.sample("test", step=1), step=1) == 0 and default.compactions == []
    s = cb.sample("test", step=1)
    assert s.device.startswith("cuda") and s.reserved >= 1024 * MiB and s.fragmentation > 0.3
    assert cb.maybe_compact(s, step=1) >= 1024 * MiB
    assert cb.maybe_compact(cb.sample("test", step=1), step=1) == 0  # not again within the interval
    assert len(cb.compactions) == 1 and keep.sum().item() == 64 * MiB


def test_real_cuda_oom_is_split_and_gives_the_same_gradients():
    torch.manual_seed(0)
    reference = torch.nn.Linear(64, 64, device="cuda")
    model = copy.deepcopy(reference)
    free, _ = torch.cuda.mem_get_info()
    per_sample = int(free * 0.3)  # 8 or 4 samples need more than is free, 2 fit

    def step(chunk, weight, net=model, scratch_per_sample=per_sample):
        scratch = torch.empty(scratch_per_sample * chunk.shape[0], dtype=torch.uint8, device="cuda")
        loss = net(chunk).pow(2).mean()
        (loss * weight).backward()
        del scratch
        return loss

    x = torch.randn(8, 64, device="cuda")
    step(x, 1.0, net=reference, scratch_per_sample=0)
    recover = OOMRecovery(max_splits=3, params=model.parameters())
    recover(step, x)
    assert [e["chunk_size"] for e in recover.events] == [8, 4]
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-6, rtol=1e-5)
