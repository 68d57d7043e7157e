"""PPOTrainer says once, when train() starts, what is on, what is off and why, and where to watch it."""

from __future__ import annotations

import pytest

from tests.ppo.helpers import tiny_trainer

pytestmark = pytest.mark.usefixtures("single_thread", "no_rapidfire_env")


def _table(out: str) -> list[str]:
    lines = out.splitlines()
    start = lines.index("rapidfire PPOTrainer:")
    table = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        table.append(line)
    return table


def test_no_config_names_what_it_leaves_off(tmp_path, tokenizer, capsys):
    tiny_trainer(tmp_path, tokenizer, max_steps=1).train()
    table = _table(capsys.readouterr().out)
    assert "  on       rollout: model.generate" in table
    assert "  on       value: separate value model" in table
    assert any(x.startswith("  on       optimizer: AdamW with the finite-step guard") for x in table)
    skipped = [x for x in table if x.startswith("  skipped")]
    assert any(
        "fast rollout engine (the static engine records CUDA graphs; this run is on cpu)" in x
        for x in skipped
    )
    assert any("throughput planner (no rapidfire_config" in x for x in skipped)
    assert any("AdaptivePrecisionPlugin (no rapidfire_config)" in x for x in skipped)
    assert any(x.startswith("  on       MemoryCompactionCallback (") for x in table)


def test_without_memory_management_nothing_writes_telemetry(tmp_path, tokenizer, capsys):
    tiny_trainer(tmp_path, tokenizer, max_steps=1, memory_management=False).train()
    table = _table(capsys.readouterr().out)
    assert "  skipped  MemoryCompactionCallback (memory_management=False)" in table
    assert not any("process registry" in x for x in table)  # the callback is what writes the telemetry


def test_a_preset_lists_its_parts_and_where_the_telemetry_goes(tmp_path, tokenizer, capsys, monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_CACHE_DIR", str(tmp_path / "cache"))
    tiny_trainer(tmp_path, tokenizer, max_steps=1, value_mode="fused", rapidfire_config="balanced").train()
    table = _table(capsys.readouterr().out)
    assert "  on       value: fused head on the policy" in table
    assert any(x.startswith("  on       optimizer: RapidFireOptimizer(") for x in table)
    assert "  on       MemoryCompactionCallback (balanced)" in table
    assert any(x.startswith("  on       throughput planner (memory.optimization=balanced") for x in table)
    assert any(x.startswith("  on       AdaptivePrecisionPlugin (") for x in table)
    assert any(f"process registry {tmp_path / 'cache' / 'procs'}" in x for x in table)


def test_logging_level_warning_keeps_it_quiet(tmp_path, tokenizer, capsys):
    config = {"preset": "balanced", "logging": {"level": "warning"}}
    tiny_trainer(tmp_path, tokenizer, max_steps=1, rapidfire_config=config).train()
    assert "rapidfire PPOTrainer:" not in capsys.readouterr().out
