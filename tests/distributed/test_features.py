"""The per-engine feature table and engine detection on a real (single-process) Accelerator."""

from __future__ import annotations

import logging

import pytest
import torch

from rapidfire_hf.distributed import Engine, Status, check_sync, describe_engine, support_for
from rapidfire_hf.distributed.sync_debug import SyncChecker, tensor_checksums


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_single_process_accelerator_is_single_and_everything_holds(caplog):
    from accelerate import Accelerator

    with caplog.at_level(logging.INFO, logger="rapidfire_hf.distributed.features"):
        support = describe_engine(Accelerator(cpu=True))
    assert support.engine is Engine.SINGLE and support.world_size == 1
    assert support.fallbacks() == {}
    assert "all features hold" in caplog.text


@pytest.mark.parametrize("engine", ["deepspeed_zero2", "deepspeed_zero3", "fsdp2"])
def test_sharded_engines_state_their_fallbacks(engine):
    support = support_for(engine, world_size=2)
    assert not support.holds("gradient_pipeline")
    message = support.message()
    assert message.startswith(f"rapidfire_hf on {engine} (2 process(es))")
    assert "gradient_pipeline: falls back" in message
    assert set(support.to_dict()["features"]) == set(support.features)


def test_ddp_keeps_rollback_and_drops_the_pipeline():
    support = support_for("ddp", 2)
    assert support.holds("rollback") and support.holds("memory_compaction")
    assert support.features["gradient_pipeline"][0] is Status.FALLS_BACK


def test_unknown_engine_is_rejected():
    with pytest.raises(ValueError):
        support_for("horovod")


def test_checksums_see_a_swap_that_a_sum_misses():
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([2.0, 1.0, 3.0])
    ca, cb = tensor_checksums(a), tensor_checksums(b)
    assert ca[0] == cb[0] and ca[2] == cb[2]
    assert ca[1] != cb[1]


def test_single_process_check_is_trivially_in_sync():
    model = torch.nn.Linear(3, 2)
    report = check_sync(model)
    assert report.in_sync and report.gradient_sync_diff == 0.0 and report.compared == 2
    with pytest.raises(ValueError, match="interval"):
        SyncChecker(model, interval=0)


def test_gathered_for_generation_is_reentrant(monkeypatch):
    """Nested use gathers once: ZeRO-3 refuses overlapping GatheredParameters, and an inner FSDP2 exit
    would reshard under the outer context. Engines that hold full weights gather nothing."""
    from contextlib import contextmanager

    import torch

    from rapidfire_hf.distributed import features, generation

    events = []

    @contextmanager
    def fake_gather(model, submodule=None):
        events.append("enter")
        yield
        events.append("exit")

    class Acc:
        @staticmethod
        def unwrap_model(model):
            return model

    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(generation, "_zero3_gathered", fake_gather)
    monkeypatch.setattr(features, "detect_engine", lambda acc: features.Engine.ZERO3)
    with generation.gathered_for_generation(Acc(), model) as outer:
        with generation.gathered_for_generation(Acc(), model) as inner:
            assert inner is outer is model
            assert events == ["enter"]
        assert events == ["enter"]  # the inner exit left the weights gathered
    assert events == ["enter", "exit"]
    with generation.gathered_for_generation(Acc(), model):  # a later rollout gathers again
        pass
    assert events == ["enter", "exit", "enter", "exit"]
    monkeypatch.setattr(features, "detect_engine", lambda acc: features.Engine.DDP)
    with generation.gathered_for_generation(Acc(), model):
        pass
    assert len(events) == 4


def test_nothing_to_gather_is_a_plain_nullcontext(monkeypatch):
    """Engines that hold full weights (one device, DDP) get a plain ``nullcontext`` yielding the unwrapped
    model: no context of the package is entered around a rollout or a scoring pass that gathers nothing."""
    from contextlib import nullcontext

    import torch

    from rapidfire_hf.distributed import features, generation

    model, unwrapped = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    class Acc:
        @staticmethod
        def unwrap_model(m):
            return unwrapped if m is model else m

    for engine in (features.Engine.SINGLE, features.Engine.DDP):
        monkeypatch.setattr(features, "detect_engine", lambda acc, engine=engine: engine)
        context = generation.gathered_for_generation(Acc(), model)
        assert isinstance(context, nullcontext), engine
        with context as yielded:
            assert yielded is unwrapped
    monkeypatch.setattr(features, "detect_engine", lambda acc: features.Engine.ZERO3)
    assert not isinstance(generation.gathered_for_generation(Acc(), model), nullcontext)


def test_gathered_for_generation_passes_the_submodule_to_gather(monkeypatch):
    """PPO's rollout gathers the policy alone: the engine's gather receives it."""
    from contextlib import contextmanager

    import torch

    from rapidfire_hf.distributed import features, generation

    seen = []

    @contextmanager
    def fake_gather(model, submodule=None):
        seen.append(submodule)
        yield

    class Acc:
        @staticmethod
        def unwrap_model(model):
            return model

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    monkeypatch.setattr(features, "detect_engine", lambda acc: features.Engine.ZERO3)
    monkeypatch.setattr(generation, "_zero3_gathered", fake_gather)
    with generation.gathered_for_generation(Acc(), model, model[0]):
        pass
    with generation.gathered_for_generation(Acc(), model):
        pass
    assert seen[0] is model[0] and seen[1] is None
