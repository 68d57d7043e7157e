"""benchmarks/ppo_vs_trl part "sweep": N LoRA trials one after another (ours; stock TRL when TRL112_PATH
points at trl 1.12) against PPOSweep training all N at once, and summarize.py --sweep's arithmetic."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "ppo_vs_trl"
spec = importlib.util.spec_from_file_location("ppo_summarize_sweep", BENCH / "summarize.py")
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)


@pytest.mark.slow
def test_sweep_part_runs_each_trial_with_its_settings_and_sums_the_sequential_side(tmp_path):
    systems = "trl,rapidfire,sweep" if os.environ.get("TRL112_PATH") else "rapidfire,sweep"
    cmd = [sys.executable, str(BENCH / "run.py"), "--out", str(tmp_path), "--smoke", "--part", "sweep",
           "--sweep-trials", "1,2", "--sweep-systems", systems]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    rows = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert {"sw_rapidfire_t0", "sw_rapidfire_t1", "sw_sweep_n1", "sw_sweep_n2"} <= set(rows)
    assert all(r["status"] == "ok" for r in rows.values()), {n: r.get("error") for n, r in rows.items()}
    # every trial ran its updates with its own kl_coef, in the sweep and on its own
    assert rows["sw_sweep_n2"]["trial_updates"] == {"t0": 2, "t1": 2}
    assert rows["sw_sweep_n2"]["trial_kl_applied"] == {"t0": 0.01, "t1": 0.02}
    assert [rows[f"sw_rapidfire_t{i}"]["kl_coef_applied"] for i in (0, 1)] == [0.01, 0.02]
    assert rows["sw_rapidfire_t1"]["seed"] == 1 and rows["sw_sweep_n2"]["trials"] == 2
    (two,) = [r for r in summarize.sweep_summary(tmp_path) if r["trials"] == 2]
    seq = rows["sw_rapidfire_t0"]["s_per_update"] + rows["sw_rapidfire_t1"]["s_per_update"]
    sweep_s = statistics.median(rows["sw_sweep_n2"]["update_times"][1:])
    assert two["ours_seq_s"] == pytest.approx(seq) and two["sweep_s"] == pytest.approx(sweep_s)
    assert two["vs_ours"] == pytest.approx(seq / sweep_s)
    assert two["sweep_tokens_per_s"] == pytest.approx(2 * 4 * 16 / sweep_s)  # 2 trials x batch 4 x (8 + 8)
    assert (two.get("vs_trl") is not None) == ("trl" in systems)
    assert (tmp_path / "sweep.csv").exists() and (tmp_path / "sweep.png").exists()


def _row(name, system, s, status="ok", **kw):
    return {"part": "sweep", "name": name, "system": system, "batch": 2, "prompt_len": 3, "response_len": 5,
            "status": status, "s_per_update": s, "update_times": [9.0, s, s], "peak_gib": 1.0, **kw}  # fmt: skip


def test_sweep_summary_pairs_within_a_file_and_needs_every_trial(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    rows_a = [_row("sw_trl_t0", "trl", 4.0), _row("sw_trl_t1", "trl", 6.0, status="oom"),
              _row("sw_rapidfire_t0", "rapidfire", 1.0), _row("sw_rapidfire_t1", "rapidfire", 3.0),
              _row("sw_sweep_n1", "sweep", 0.5, trials=1), _row("sw_sweep_n2", "sweep", 2.0, trials=2)]  # fmt: skip
    (tmp_path / "a" / "results.json").write_text(json.dumps({"rows": rows_a}))
    # b holds stock's second trial, ok: it must not fill a's gap
    (tmp_path / "b" / "results.json").write_text(json.dumps({"rows": [_row("sw_trl_t1", "trl", 6.0)]}))
    by = {(r["file"], r["trials"]): r for r in summarize.sweep_summary(tmp_path)}
    one, two = by[("a/results.json", 1)], by[("a/results.json", 2)]
    assert (one["trl_seq_s"], one["vs_trl"], one["ours_seq_s"], one["vs_ours"]) == (4.0, 8.0, 1.0, 2.0)
    assert two.get("trl_seq_s") is None and two.get("vs_trl") is None  # a failed trial: no sequential number
    assert (two["ours_seq_s"], two["vs_ours"], two["sweep_tokens_per_s"]) == (4.0, 2.0, 2 * 2 * 8 / 2.0)
    assert len(by) == 2
