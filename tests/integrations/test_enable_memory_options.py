"""enable_rapidfire and memory.optimization / memory.prefetch_window on a tiny SFTTrainer (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from rf_trainers import PARITY_CONFIG

from rapidfire_hf.integrations import enable_rapidfire
from rapidfire_hf.memory import activation_bytes


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Single-threaded: the tiny models are faster that way on the shared cores."""


def config(**memory):
    return {**PARITY_CONFIG, "memory": memory}


def forward_bytes(trainer) -> int:
    model = trainer.model.train()
    ids = torch.randint(4, 40, (4, 24), generator=torch.Generator().manual_seed(0))
    return activation_bytes(lambda: model(input_ids=ids).logits)


def test_forced_checkpointing_checkpoints_the_model_and_trains_the_same(build):
    held, weights = {}, {}
    for policy in ("off", "elementwise", "matmuls"):
        memory = dict(checkpointing=policy, prefetch_window=0)
        trainer = enable_rapidfire(build("sft", gradient_checkpointing=False), config=config(**memory))
        assert trainer.model.model.layers[0].gradient_checkpointing == (policy != "off")
        trainer.train()
        held[policy] = forward_bytes(trainer)
        weights[policy] = [p.detach().clone() for p in trainer.model.parameters()]
    assert held["off"] > held["elementwise"] > held["matmuls"], held
    for policy in ("elementwise", "matmuls"):
        assert all(torch.equal(a, b) for a, b in zip(weights[policy], weights["off"])), policy


@pytest.mark.parametrize("level", ["conservative", "balanced", "aggressive"])
def test_no_level_recomputes_a_model_that_fits(build, level):
    trainer = enable_rapidfire(build("sft", gradient_checkpointing=False), config=config(optimization=level))
    trainer.train()
    assert not trainer.model.model.layers[0].gradient_checkpointing


def test_trainer_gradient_checkpointing_is_kept(build):
    trainer = build("sft", gradient_checkpointing=True)  # TRL's default
    trainer = enable_rapidfire(trainer, config=config(optimization="aggressive"))
    state = trainer._rapidfire
    assert any("gradient_checkpointing=True already checkpoints" in s for s in state.skipped)
    trainer.train()
    layer = trainer.model.model.layers[0]
    assert layer.gradient_checkpointing
    assert "context_fn" not in getattr(layer._gradient_checkpointing_func, "keywords", {})


@pytest.mark.parametrize("level", ["auto", "balanced", "aggressive"])
def test_recompute_is_chosen_at_train_begin_when_memory_is_short(build, monkeypatch, level):
    monkeypatch.setattr("rapidfire_hf.memory.checkpointing.free_device_bytes", lambda device: 1)
    trainer = enable_rapidfire(build("sft", gradient_checkpointing=False), config=config(optimization=level))
    callback = trainer._rapidfire.parts["checkpointing"]
    trainer.train()
    assert callback.level == "aggressive" and trainer.model.model.layers[0].gradient_checkpointing
    assert callback.measured["conservative"] > callback.measured["aggressive"]


class CountingLoader:
    """Wraps the trainer's DataLoader and counts the batches taken from it."""

    def __init__(self, loader):
        self.loader, self.taken = loader, 0

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            self.taken += 1
            yield batch


def run_recording(trainer):
    make_loader, counted, seen = trainer.get_train_dataloader, [], []

    def counting_loader():
        counted.append(CountingLoader(make_loader()))
        return counted[-1]

    trainer.get_train_dataloader = counting_loader
    step = trainer.training_step

    def recording(model, inputs, *args, **kwargs):
        seen.append((inputs["input_ids"].clone(), counted[-1].taken))
        return step(model, inputs, *args, **kwargs)

    trainer.training_step = recording
    trainer.train()
    return seen


def test_prefetch_same_batches_and_runs_ahead(build):
    runs = {}
    for window in (0, 2):
        trainer = build("sft", gradient_checkpointing=False)
        trainer = enable_rapidfire(trainer, config=config(prefetch_window=window))
        runs[window] = run_recording(trainer)
    assert len(runs[0]) == len(runs[2]) == 4
    for (ids0, _), (ids2, _) in zip(runs[0], runs[2]):
        assert torch.equal(ids0, ids2)
    # taken from the DataLoader when step k starts: accelerate's own one-batch look-ahead, plus the window
    taken0 = [taken for _, taken in runs[0]]
    assert [taken for _, taken in runs[2]] == [t + 2 for t in taken0], (taken0, runs[2])


@pytest.mark.parametrize("rollout", ["maybe", 1.5, None, "HF"])
def test_an_unknown_rollout_choice_is_refused_naming_the_choices(build, rollout):
    with pytest.raises(ValueError, match=r"enable_rapidfire\(rollout=.*expected one of True, False, 'auto'"):
        enable_rapidfire(build("sft", gradient_checkpointing=False), rollout=rollout)


def test_enable_rapidfire_prints_what_is_on_and_what_was_skipped(build, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RAPIDFIRE_CACHE_DIR", str(tmp_path / "cache"))
    enable_rapidfire(build("sft", gradient_checkpointing=True), config=config(optimization="balanced"))
    out = capsys.readouterr().out
    assert out.count("rapidfire on SFTTrainer:") == 1
    assert "  on       MemoryCompactionCallback (balanced)" in out
    assert "  skipped  memory.optimization=balanced checkpointing (gradient_checkpointing=True" in out
    assert f"process registry {tmp_path / 'cache' / 'procs'} (RAPIDFIRE_CACHE_DIR moves it)" in out


def test_a_quiet_logging_level_prints_nothing(build, capsys):
    enable_rapidfire(build("sft"), config={**config(), "logging": {"level": "warning"}})
    assert "rapidfire on" not in capsys.readouterr().out
