"""The measured per-phase peaks (memory/phase_peaks.py): the allocator's peak is reset before each phase and
read after it; the run's peak survives the resets; nothing is measured off CUDA."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.memory.phase_peaks import GIB, PhasePeaks


class FakeAllocator:
    """torch.cuda's peak statistics, driven by the test: ``alloc`` raises the peak."""

    def __init__(self):
        self.now, self.peak, self.resets = 0, 0, 0

    def alloc(self, nbytes):
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def free(self, nbytes):
        self.now -= nbytes

    def reset(self, device=None):
        self.resets += 1
        self.peak = self.now


def measured() -> PhasePeaks:
    """A meter that measures (as on a CUDA device) whatever this machine has."""
    peaks = PhasePeaks("cuda")
    peaks.measured = True
    return peaks


@pytest.fixture
def fake(monkeypatch):
    a = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: a.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", a.reset)
    return a


def test_each_phase_gets_its_own_peak_and_the_run_keeps_the_largest(fake):
    peaks = measured()
    fake.alloc(10 * GIB)  # weights, before any phase
    with peaks.phase("generation"):
        fake.alloc(30 * GIB)  # KV cache
        fake.free(30 * GIB)
    with peaks.phase("scoring"):
        fake.alloc(5 * GIB)
        fake.free(5 * GIB)
    with peaks.phase("training"):
        fake.alloc(20 * GIB)
        fake.free(20 * GIB)
    m = peaks.metrics()
    assert m["rapidfire/memory/generation_peak_gib"] == 40
    assert m["rapidfire/memory/scoring_peak_gib"] == 15  # not the generation's 40: reset before it
    assert m["rapidfire/memory/training_peak_gib"] == 30
    assert m["rapidfire/memory/peak_gib"] == 40 and fake.resets == 3


def test_a_phase_that_raises_still_records_its_peak(fake):
    peaks = measured()
    with pytest.raises(torch.OutOfMemoryError), peaks.phase("training"):
        fake.alloc(7 * GIB)
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert peaks.metrics()["rapidfire/memory/training_peak_gib"] == 7


def test_nothing_is_measured_or_logged_off_cuda():
    peaks = PhasePeaks("cpu")
    with peaks.phase("generation"):
        torch.ones(1000)
    assert peaks.metrics() == {} and not peaks.measured
    with pytest.raises(ValueError, match="phase 'rollout'"):
        with peaks.phase("rollout"):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_phase_peak_is_the_allocators():
    peaks = PhasePeaks("cuda")
    base = torch.cuda.memory_allocated()
    with peaks.phase("scoring"):
        x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        del x
    assert peaks.last["scoring"] >= base + 256 * 2**20


def test_the_trainer_logs_each_phase_peak_beside_the_plans_prediction(fake, monkeypatch, tmp_path, tokenizer):
    """PPOTrainer measures its three phases every update (here on a fake CUDA allocator whose peak the
    phases raise by 1, 2 and 3 GiB) and logs them beside the plan's ``rapidfire/plan/<phase>_peak_gib``."""
    import rapidfire_hf.ppo.recipe.trainer as trainer_module
    from tests.ppo.helpers import tiny_trainer

    raised = {"rollout": 1, "score": 2, "optimize": 3}
    monkeypatch.setattr(trainer_module, "PhasePeaks", lambda device: measured())
    torch.manual_seed(0)
    cfg = {"memory": {"prefetch_window": 0}, "precision": {"mode": "static"}}
    trainer = tiny_trainer(tmp_path, tokenizer, rapidfire_config=cfg)
    for method, gib in raised.items():
        inner = getattr(trainer, method)

        def phase(*a, _inner=inner, _gib=gib, **k):
            fake.alloc(_gib * GIB)
            fake.free(_gib * GIB)
            return _inner(*a, **k)

        setattr(trainer, method, phase)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rapidfire/memory/training_peak_gib" in h]
    assert len(logs) == trainer.args.max_steps
    for h in logs:
        assert (h["rapidfire/memory/generation_peak_gib"], h["rapidfire/memory/scoring_peak_gib"],
                h["rapidfire/memory/training_peak_gib"]) == (1, 2, 3)  # fmt: skip
    assert "rapidfire/plan/training_peak_gib" in logs[0]
