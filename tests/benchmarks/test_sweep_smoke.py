"""benchmarks/sweep/run.py --smoke: the halving run stops trials at its rungs, the time to the best trial is the
recorded time of the winner's last update, each trial run alone equals its sweep twin (CPU, bit-exact), and
the stock TRL part is skipped cleanly without trl 1.12."""

from __future__ import annotations

import json

import pytest

from benchmarks.sweep.run import main, parse_args, rounds, sequential_summary, trial_grid


def test_grid_gives_each_trial_its_settings_and_seed():
    grid = trial_grid([0.01, 0.1], [1e-4, 1e-3])
    assert list(grid) == ["kl0.01-lr0.0001", "kl0.01-lr0.001", "kl0.1-lr0.0001", "kl0.1-lr0.001"]
    assert grid["kl0.1-lr0.0001"] == {"kl_coef": 0.1, "learning_rate": 1e-4, "seed": 2}


def test_bad_arguments_are_refused(capsys):
    for argv in (["--rungs", "3,12"], ["--parts", "sweep_halving,nope"], ["--seq-updates", "1"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", *argv])
    assert "unknown part(s) nope" in capsys.readouterr().err


def test_fewer_sequential_updates_are_extrapolated_and_said_so():
    trial = {"status": "finished", "steps": [1, 2, 3], "t": [10.0, 11.0, 12.5], "rewards": [0.1, 0.2, 0.3],
             "build_s": 2.0, "init_s": 1.0, "peak_gib": 7.0}  # fmt: skip
    part = {
        "status": "ok",
        "trials": {"a": trial, "b": dict(trial)},
        "config": {"trials": {"a": {}, "b": {}, "c": {}}},
    }
    s = sequential_summary(part, updates=12)
    per = 10.0 + 1.25 * 11  # first update + median of the later ones (1.0, 1.5) x (U - 1)
    assert s["per_trial_s"] == {"a": per, "b": per}
    assert s["time_to_best_s"] == pytest.approx(3 * per)  # trial c did not run: counted at the median trial
    assert "extrapolated" in s["how"] and "1 trial(s) not run" in s["how"]
    assert s["winner"] is None and s["one_trial_peak_gib"] == 7.0  # no final reward at update 12


@pytest.mark.slow  # three small runs in worker processes, about 45 s on a 2-core CPU
def test_smoke_run_halves_at_the_rungs_and_times_the_best_trial(tmp_path, monkeypatch):
    monkeypatch.delenv("TRL112_PATH", raising=False)
    main(["--out", str(tmp_path), "--smoke"])
    data = json.loads((tmp_path / "results.json").read_text())
    parts, summary = {p["part"]: p for p in data["parts"]}, data["summary"]
    assert parts["trl"]["status"] == "skipped" and "TRL112_PATH" in parts["trl"]["error"]
    for name in ("sweep_halving", "sequential_ours", "sweep_all"):
        assert parts[name]["status"] == "ok" and parts[name]["complete"], parts[name].get("error")
    halving, every, seq = parts["sweep_halving"], parts["sweep_all"], parts["sequential_ours"]
    assert len(halving["trials"]) == 4 and halving["config"]["halving"] == {"rungs": [2, 3], "keep": 0.5}

    # alive trials per update: 4, 4 until the first rung, then 2, then 1 after the second
    alive = [r["alive_count"] for r in rounds(halving)]
    assert alive == [4, 4, 2, 1, 1] == summary["sweep_halving"]["alive_per_update"]
    assert [d["update"] for d in halving["decisions"]] == [2, 3]
    stopped = {n for n, t in halving["trials"].items() if t["status"] == "early_stopped"}
    assert len(stopped) == 3 and all(len(halving["trials"][n]["steps"]) < 5 for n in stopped)
    assert [r["alive_count"] for r in rounds(every)] == [4] * 5  # without halving every trial runs on

    # the winner is the survivor with the best reward at update U; its time is that update's stamp
    (survivor,) = set(halving["trials"]) - stopped
    s = summary["sweep_halving"]
    assert s["winner"] == survivor and s["how"] == "measured"
    assert s["time_to_best_s"] == halving["trials"][survivor]["t"][-1] == rounds(halving)[-1]["t"]
    assert s["time_to_best_with_load_s"] == pytest.approx(
        s["time_to_best_s"] + halving["build_s"] + halving["init_s"]
    )
    seq_total = sum(t["t"][-1] for t in seq["trials"].values())  # each trial's train() to its update U
    assert summary["sequential_ours"]["time_to_best_s"] == pytest.approx(seq_total)
    assert summary["time_to_best_speedup"] == pytest.approx(seq_total / s["time_to_best_s"])
    finals = {n: t["rewards"][-1] for n, t in seq["trials"].items()}
    assert summary["sequential_ours"]["winner"] == max(finals, key=finals.get)
    assert summary["same_best_trial"] == (s["winner"] == summary["sequential_ours"]["winner"])

    # each trial alone (PPOTrainer, its settings and seed) equals its twin in the sweep, and the halving
    # run's curves are the full run's up to where they stopped
    for name, t in seq["trials"].items():
        assert t["rewards"] == every["trials"][name]["rewards"], name
        assert (
            t["kl_coef_applied"] == t["overrides"]["kl_coef"] and t["seed_applied"] == t["overrides"]["seed"]
        )
        assert (
            halving["trials"][name]["rewards"]
            == every["trials"][name]["rewards"][: len(halving["trials"][name]["rewards"])]
        )
    assert summary["steady_throughput_from"] == "sweep_all"
    assert (tmp_path / "results.csv").read_text().count("\n") == 5 and (
        tmp_path / "sweep.png"
    ).stat().st_size > 0
    assert data["environment"]["command"].startswith("python benchmarks/sweep/run.py --out")
