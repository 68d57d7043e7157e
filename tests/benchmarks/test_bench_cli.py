"""`rapidfire bench`: lists the benchmarks and runs one in its CPU smoke mode."""

from __future__ import annotations

import json

import pytest

from rapidfire_hf.cli.main import main


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "ppo" in out and "grpo" in out and "optimizer" in out


@pytest.mark.slow  # 13 s on a 2-core CPU
def test_bench_runs_the_ppo_script_in_smoke_mode(tmp_path, monkeypatch):
    monkeypatch.delenv("TRL112_PATH", raising=False)  # stock side is skipped without trl 1.12
    assert main(["bench", "ppo", "--smoke", "--out", str(tmp_path), "--", "--only", "tp_rapidfire"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["tp_rapidfire_b8"] and rows[0]["status"] == "ok"
    assert rows[0]["tokens_per_s"] > 0 and (tmp_path / "ppo_vs_trl.png").is_file()


@pytest.mark.slow  # four subprocesses, about 45 s on the CPU
def test_bench_runs_the_ppo_size7b_part_in_smoke_mode(tmp_path, monkeypatch):
    """The 7B part in smoke mode (tiny shape, CPU): full fine-tuning and LoRA for each of our value modes."""
    monkeypatch.delenv("TRL112_PATH", raising=False)
    argv = ["bench", "ppo", "--smoke", "--out", str(tmp_path), "--", "--part", "size7b"]
    assert main(argv) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert set(rows) == {f"s7_{s}_{m}" for s in ("trl", "rapidfire", "fused") for m in ("full", "lora")}
    assert rows["s7_trl_full"]["status"] == rows["s7_trl_lora"]["status"] == "skipped"
    for name in ("s7_rapidfire_full", "s7_rapidfire_lora", "s7_fused_full", "s7_fused_lora"):
        assert rows[name]["status"] == "ok", rows[name].get("error")
        assert rows[name]["part"] == "size7b" and rows[name]["shape"] == "smoke"
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["s_per_update"] > 0
    # LoRA trains the adapters (and, with a separate value model, that model in full): fewer parameters
    assert rows["s7_fused_lora"]["trainable_params"] < rows["s7_fused_full"]["trainable_params"] / 5
    assert rows["s7_rapidfire_lora"]["trainable_params"] < rows["s7_rapidfire_full"]["trainable_params"]
    assert rows["s7_rapidfire_lora"]["peft"] == "lora" and rows["s7_rapidfire_full"]["peft"] is None
    assert (tmp_path / "ppo_vs_trl.png").is_file() and (tmp_path / "results.csv").is_file()


@pytest.mark.slow  # one subprocess, about 15 s on the CPU
def test_size7b_reward_model_and_8bit_optimizer_reach_our_trainer(tmp_path, monkeypatch):
    """--size-reward model scores with a sequence-classification model; --ours-optimizer adamw8bit makes
    our trainer update the weights with bitsandbytes' AdamW8bit (under RapidFireOptimizer)."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.delenv("TRL112_PATH", raising=False)
    extra = [
        "--part",
        "size7b",
        "--only",
        "s7_fused_full",
        "--size-reward",
        "model",
        "--ours-optimizer",
        "adamw8bit",
    ]
    assert main(["bench", "ppo", "--smoke", "--out", str(tmp_path), "--", *extra]) == 0
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["status"] == "ok", row.get("error")
    assert row["optimizer_class"] == "AdamW8bit" and row["reward_class"] == "LlamaForSequenceClassification"
    assert row["reward"] == "model" and row["optimizer"] == "adamw8bit"
