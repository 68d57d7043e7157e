"""MemoryCompactionCallback inside a real transformers.Trainer, and its phase-boundary API."""

from __future__ import annotations

import json
import types

import pytest
import torch
from transformers import Trainer, TrainingArguments

from rapidfire_hf.memory import MemoryCompactionCallback, TelemetryWriter


class CharLM(torch.utils.data.Dataset):
    def __init__(self, n=16, length=12, vocab=40, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(4, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(model, tmp_path, callback, steps=3):
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    Trainer(model=model, args=args, train_dataset=CharLM(), callbacks=[callback]).train()
    return args


def test_trainer_run_writes_memory_records_with_holdings(tmp_path, tiny_policy):
    cb = MemoryCompactionCallback(telemetry=TelemetryWriter())  # default dir: <output_dir>/telemetry
    train(tiny_policy, tmp_path, cb, steps=3)
    cb.telemetry.close()
    (stream,) = (tmp_path / "out" / "telemetry").glob("*.jsonl")
    recs = [json.loads(line) for line in stream.read_text().splitlines()]
    memory = [r for r in recs if r["kind"] == "memory"]
    assert [r["where"] for r in memory] == ["train_begin", "step_end", "step_end", "step_end", "train_end"]
    assert [r["step"] for r in memory if r["where"] == "step_end"] == [1, 2, 3]
    n_param_bytes = sum(p.numel() * 4 for p in tiny_policy.parameters())
    last = memory[-2]
    assert last["device"] == "cpu" and last["rss_bytes"] > 0 and last["fragmentation"] is None
    assert last["holdings"]["parameters"] == n_param_bytes
    assert last["holdings"]["gradients"] == n_param_bytes  # measured at the optimizer step
    assert last["holdings"]["optimizer_state"] >= 2 * n_param_bytes  # AdamW moments
    names = [r["name"] for r in recs if r["kind"] == "event"]
    assert names == ["train_begin", "train_end"]  # nothing to compact on a CPU
    assert any(r["kind"] == "metrics" and "loss" in r["values"] for r in recs)
    assert cb.compactions == [] and cb.bytes_returned == 0


def test_phase_boundary_compacts_after_rollout_only(tmp_path):
    cb = MemoryCompactionCallback(telemetry=TelemetryWriter(tmp_path / "t", register=False))
    cb.telemetry.open()
    cb.phase_boundary("rollout", "score", step=4)
    assert cb.compactions == []  # no threshold compaction on CPU
    cb.phase_boundary("score", "train", step=4)
    assert cb.compactions == []
    cb.phase_boundary("rollout", "train", step=5)
    assert [c["reason"] for c in cb.compactions] == ["phase rollout->train"]
    assert cb.compactions[0]["bytes_returned"] == 0 and cb.phase == "train"
    cb.telemetry.close()
    recs = [json.loads(line) for line in cb.telemetry.path.read_text().splitlines()]
    wheres = [r["where"] for r in recs if r["kind"] == "memory"]
    assert wheres == ["phase:rollout->score", "phase:score->train", "phase:rollout->train"]
    assert [r["step"] for r in recs if r.get("name") == "compaction"] == [5]


def test_config_object_or_keywords(tmp_path):
    cfg = types.SimpleNamespace(compaction_threshold=0.15, optimization="aggressive", prefetch_window=4)
    cb = MemoryCompactionCallback(cfg, telemetry=False)
    assert (cb.compaction_threshold, cb.optimization, cb.min_interval_steps) == (0.15, "aggressive", 5)
    full = types.SimpleNamespace(memory=cfg)  # a RapidFireConfig: its .memory section is used
    assert (
        MemoryCompactionCallback(full, compaction_threshold=0.5, telemetry=False).compaction_threshold == 0.5
    )
    with pytest.raises(ValueError, match="optimization='turbo'"):
        MemoryCompactionCallback(optimization="turbo", telemetry=False)
    with pytest.raises(ValueError, match="compaction_threshold=1.5"):
        MemoryCompactionCallback(compaction_threshold=1.5, telemetry=False)


def test_real_memory_config_is_accepted():
    config = pytest.importorskip("rapidfire_hf.config")
    if not hasattr(config, "MemoryConfig"):
        pytest.skip("rapidfire_hf.config has no MemoryConfig yet")
    cb = MemoryCompactionCallback(config.MemoryConfig(), telemetry=False)
    assert cb.optimization == "balanced" and 0 < cb.compaction_threshold <= 1


def test_allocator_left_alone_when_user_configured_it(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert MemoryCompactionCallback(telemetry=False).allocator_setup == "user"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "")  # recorded by monkeypatch, so whatever we set is undone
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    expected = (
        "no-cuda" if not torch.cuda.is_available() else ("runtime" if torch.cuda.is_initialized() else "env")
    )
    assert MemoryCompactionCallback(telemetry=False).allocator_setup == expected


def test_process_wide_writer_follows_each_runs_folder(tmp_path, tiny_policy, monkeypatch):
    """Two trainings in one process with the default (process-wide) writer: each run's records land in
    its own <output_dir>/telemetry, not in the folder the first run opened."""
    import rapidfire_hf.memory.telemetry as telemetry_module

    monkeypatch.delenv("RAPIDFIRE_TELEMETRY_DIR", raising=False)
    monkeypatch.setattr(telemetry_module, "_DEFAULT", TelemetryWriter(register=False))
    for run in ("first", "second"):
        train(tiny_policy, tmp_path / run, MemoryCompactionCallback(), steps=2)
    telemetry_module.get_telemetry().close()
    for run in ("first", "second"):
        (stream,) = (tmp_path / run / "out" / "telemetry").glob("*.jsonl")
        recs = [json.loads(line) for line in stream.read_text().splitlines()]
        begins = [r for r in recs if r["kind"] == "event" and r["name"] == "train_begin"]
        assert len(begins) == 1, run  # its own run's records only
        assert [r["step"] for r in recs if r["kind"] == "memory" and r["where"] == "step_end"] == [1, 2]


def _gpu_like(cb, reserved: int, floor: int):
    """``cb`` sampling ``reserved`` bytes held on a device whose pressure floor is ``floor`` bytes."""
    from rapidfire_hf.memory.stats import MemorySample

    cb.sample = lambda where, step=None: MemorySample(
        t=0.0, device="cuda:0", rss_bytes=1, allocated=reserved, reserved=reserved
    )
    cb.min_reserved_bytes = lambda: floor
    return cb


@pytest.mark.parametrize(
    "release, reserved, compacts",
    [("always", 10, True), ("pressure", 10, False), ("pressure", 100, True), ("pressure", 99, False)],
)
def test_release_after_rollout_waits_for_pressure_only_when_asked(release, reserved, compacts):
    """'always' releases at every rollout->train boundary; 'pressure' only where the allocator holds at
    least the pressure floor (100 bytes here), and then no threshold compaction either (no fragmentation)."""
    cb = _gpu_like(
        MemoryCompactionCallback(telemetry=False, expandable_segments=False, release_after_rollout=release),
        reserved,
        floor=100,
    )
    cb.phase_boundary("rollout", "train", step=3)
    assert [c["reason"] for c in cb.compactions] == (["phase rollout->train"] if compacts else [])


def test_release_after_rollout_comes_from_the_config_and_bad_values_are_named():
    from rapidfire_hf.config import ConfigError, load_config
    from rapidfire_hf.ppo.recipe.setup import make_memory_callback

    args = types.SimpleNamespace(memory_management=True)
    cfg = load_config({"preset": "balanced", "memory": {"release_after_rollout": "pressure"}})
    assert make_memory_callback(args, cfg).release_after_rollout == "pressure"
    cfg = load_config({"preset": "balanced", "memory": {"release_after_rollout": "always"}})
    assert make_memory_callback(args, cfg).release_after_rollout == "always"
    # the default, with a config and without one: only under pressure (benchmarks/presets release_b8_stock)
    assert make_memory_callback(args, load_config("balanced")).release_after_rollout == "pressure"
    assert make_memory_callback(args, None).release_after_rollout == "pressure"
    with pytest.raises(ConfigError, match="release_after_rollout") as err:
        load_config({"preset": "balanced", "memory": {"release_after_rollout": "sometimes"}})
    assert "pressure" in str(err.value)
    with pytest.raises(ValueError, match="release_after_rollout='never'"):
        MemoryCompactionCallback(telemetry=False, expandable_segments=False, release_after_rollout="never")
