"""`rapidfire bench`: lists the benchmarks and runs one in its CPU smoke mode."""

from __future__ import annotations

import json

from rapidfire_hf.cli.main import main


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "ppo" in out and "grpo" in out and "optimizer" in out


def test_bench_runs_the_ppo_script_in_smoke_mode(tmp_path, monkeypatch):
    monkeypatch.delenv("TRL112_PATH", raising=False)  # stock side is skipped without trl 1.12
    assert main(["bench", "ppo", "--smoke", "--out", str(tmp_path), "--", "--only", "tp_rapidfire"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["tp_rapidfire_b8"] and rows[0]["status"] == "ok"
    assert rows[0]["tokens_per_s"] > 0 and (tmp_path / "ppo_vs_trl.png").is_file()
