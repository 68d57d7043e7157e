"""benchmarks/ppo_vs_trl/lr_sweep.py on stored H200 learning rows: de-duplication, commands, statistics."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.benchmarks.loader import BENCHMARKS, load_benchmark

STORED = BENCHMARKS / "ppo_vs_trl" / "results" / "h200" / "learning_lr_sweep"


@pytest.fixture(scope="module")
def sweep():
    return load_benchmark("ppo_vs_trl/lr_sweep.py")


def _rows(lr_folder: str, prefix: str, seeds: range) -> list[dict]:
    rows = json.loads((STORED / lr_folder / "results.json").read_text())["rows"]
    picked = [r for r in rows if r["name"].startswith(prefix) and r["seed"] in seeds]
    assert len(picked) == len(seeds)
    return picked


def _write(path: Path, rows: list[dict], command: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    env = {"command": command, "date": "2026-11-30", "gpu": "NVIDIA H200"}
    path.write_text(json.dumps({"environment": env, "rows": rows}))
    return path


def test_sweep_keys_rows_by_name_lr_and_seed(tmp_path, sweep):
    trl = _rows("lr3e-4", "learn_trl_separate", range(4))
    fused = _rows("lr1e-3", "learn_rapidfire_fused", range(4, 8))
    # a row without its own command takes its file's, with --learn-lr set to the row's own rate
    bare = [{k: v for k, v in r.items() if k not in ("run_command", "date")} for r in fused]
    a = _write(tmp_path / "a" / "results.json", trl + bare[:2], "run.py --part learning --learn-lr 3e-4")
    # the same runs again, in a folder passed whole: they must not count twice
    _write(tmp_path / "b" / "results.json", trl[:2] + bare[2:], "run.py --part learning --learn-lr 3e-4")
    other = tmp_path / "b" / "grpo" / "results.json"  # another benchmark's results in the tree: skipped
    other.parent.mkdir()
    other.write_text(json.dumps({"summary": []}))
    out = tmp_path / "out"
    sweep.main([str(out), str(a), str(tmp_path / "b")])

    result = json.loads((out / "sweep.json").read_text())
    by = {(e["system"], e["lr"]): e for e in result["summary"]}
    assert set(by) == {("learn_trl_separate", 3e-4), ("learn_rapidfire_fused", 1e-3)}
    for (system, lr), rows in {
        ("learn_trl_separate", 3e-4): trl,
        ("learn_rapidfire_fused", 1e-3): fused,
    }.items():
        e, vals = by[(system, lr)], [r["reward_last5"] for r in rows]
        assert e["runs"] == e["ok"] == 4
        assert e["mean"] == pytest.approx(statistics.fmean(vals))
        assert e["se"] == pytest.approx(statistics.stdev(vals) / 2)
        assert e["collapsed"] == sum(v < sweep.COLLAPSED for v in vals)
        assert e["per_seed"] == {str(r["seed"]): r["reward_last5"] for r in rows}
    assert result["best_lr"] == {"learn_trl_separate": 3e-4, "learn_rapidfire_fused": 1e-3}

    per_lr = json.loads((out / "lr1e-3" / "results.json").read_text())["rows"]
    assert sorted(r["seed"] for r in per_lr) == [4, 5, 6, 7]
    assert {r["run_command"] for r in per_lr} == {"run.py --part learning --learn-lr 0.001"}
    kept = json.loads((out / "lr3e-4" / "results.json").read_text())["rows"]
    assert [r["run_command"] for r in kept] == [r["run_command"] for r in trl]  # own commands kept
    assert (out / "sweep.png").stat().st_size > 10_000 and (out / "sweep.csv").is_file()


def test_sweep_refuses_inputs_without_learning_rows(tmp_path, sweep):
    path = _write(tmp_path / "results.json", [{"name": "tp_rapidfire_b8", "part": "throughput"}], "run.py")
    with pytest.raises(SystemExit, match="no learning rows"):
        sweep.main([str(tmp_path / "out"), str(path)])
