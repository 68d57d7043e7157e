"""Fragmentation, holdings and the compaction rule (a pure function of a sample and the step count)."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.memory.stats import (
    MemorySample,
    MiB,
    clear_cublas_workspaces,
    compaction_reason,
    holdings,
    sample_memory,
)


def cuda_sample(allocated: int, reserved: int) -> MemorySample:
    return MemorySample(t=0.0, device="cuda:0", rss_bytes=0, allocated=allocated, reserved=reserved)


def test_fragmentation_is_share_of_reserved_not_allocated():
    assert cuda_sample(300 * MiB, 1000 * MiB).fragmentation == 0.7
    assert cuda_sample(0, 0).fragmentation == 0.0
    assert cuda_sample(300 * MiB, 1000 * MiB).cached_free_bytes == 700 * MiB
    cpu = MemorySample(t=0.0, device="cpu", rss_bytes=1)
    assert cpu.fragmentation is None and cpu.cached_free_bytes is None


def test_compacts_only_above_threshold():
    assert compaction_reason(cuda_sample(750 * MiB, 1000 * MiB), 0.3, None, 10) is None
    assert compaction_reason(cuda_sample(690 * MiB, 1000 * MiB), 0.3, None, 10) is not None
    assert compaction_reason(cuda_sample(1000 * MiB, 1000 * MiB), 1.0, None, 10) is None
    assert "0.50 > threshold 0.40" in compaction_reason(cuda_sample(500 * MiB, 1000 * MiB), 0.4, None, 10)


def test_never_compacts_twice_within_the_interval():
    frag = cuda_sample(100 * MiB, 1000 * MiB)
    assert compaction_reason(frag, 0.3, steps_since_last=0, min_interval_steps=10) is None
    assert compaction_reason(frag, 0.3, steps_since_last=9, min_interval_steps=10) is None
    assert compaction_reason(frag, 0.3, steps_since_last=10, min_interval_steps=10) is not None
    assert compaction_reason(frag, 0.3, steps_since_last=None, min_interval_steps=10) is not None


def test_skips_compaction_that_would_return_little():
    small = cuda_sample(10 * MiB, 40 * MiB)  # 75% fragmented but only 30 MiB cached
    assert compaction_reason(small, 0.3, None, 1, min_release_bytes=64 * MiB) is None
    assert compaction_reason(small, 0.3, None, 1, min_release_bytes=16 * MiB) is not None


def test_cpu_sample_never_compacts():
    assert compaction_reason(sample_memory(), 0.01, None, 0, min_release_bytes=0) is None


def test_holdings_count_params_grads_and_optimizer_state_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    # tied through a transposed view: two Parameters over one storage, counted once
    model[1].weight = torch.nn.Parameter(model[0].weight.t())
    unique = 16 * 8 + 16 + 8  # shared weight + both biases
    n_params = sum(p.numel() for p in model.parameters())  # 280: the view counted twice
    opt = torch.optim.AdamW(model.parameters())
    before = holdings(model, opt, "cpu")
    assert before == {"parameters": unique * 4, "gradients": 0, "optimizer_state": 0}
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    after = holdings(model, opt, "cpu")
    assert after["gradients"] == n_params * 4  # each Parameter has its own .grad
    # exp_avg + exp_avg_sq per parameter, plus a 0-d fp32 step counter per parameter
    assert after["optimizer_state"] == 2 * n_params * 4 + len(list(model.parameters())) * 4
    assert holdings(model, opt, "cuda") == {"parameters": 0, "gradients": 0, "optimizer_state": 0}


def test_cpu_sample_has_rss_and_holdings():
    model = torch.nn.Linear(4, 4)
    s = sample_memory(model)
    assert s.device == "cpu" and s.rss_bytes > 0 and s.allocated is None
    assert s.holdings["parameters"] == 20 * 4
    d = s.to_dict()
    assert d["fragmentation"] is None and d["holdings"]["parameters"] == 80


def test_pressure_condition_holds_back_compaction_until_reserved_is_high():
    frag = cuda_sample(100 * MiB, 1000 * MiB)  # 90% fragmented, 900 MiB cached
    assert compaction_reason(frag, 0.3, None, 1, min_reserved_bytes=2000 * MiB) is None
    assert compaction_reason(frag, 0.3, None, 1, min_reserved_bytes=1000 * MiB) is not None
    assert compaction_reason(frag, 0.3, None, 1, min_reserved_bytes=None) is not None


def test_expandable_segments_detected_from_the_environment(monkeypatch):
    from rapidfire_hf.memory import allocator

    for name in allocator.ALLOC_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_RUNTIME_EXPANDABLE", False)
    assert not allocator.expandable_segments_active()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    assert allocator.expandable_segments_active()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # read first, as torch does
    assert not allocator.expandable_segments_active()


def test_callback_pressure_fraction_is_validated_and_off_the_gpu_adds_no_condition():
    import pytest

    from rapidfire_hf.memory import MemoryCompactionCallback

    with pytest.raises(ValueError, match="pressure_fraction"):
        MemoryCompactionCallback(pressure_fraction=1.5, telemetry=False, expandable_segments=False)
    cb = MemoryCompactionCallback(pressure_fraction=0.5, telemetry=False, expandable_segments=False)
    if not torch.cuda.is_available():
        assert cb.min_reserved_bytes() is None


def test_clear_cublas_workspaces_is_a_no_op_without_cuda():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is up: the call really clears (covered by the GPU run)")
    assert clear_cublas_workspaces() is False
