"""examples/sweep.yaml, run as `rapidfire sweep examples/sweep.yaml` on CPU: its trials learn visibly different
things in the default 40 updates (issue 30: with lr 3e-6 two trials drew the same line and KL stayed ~0)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from rapidfire_hf.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sweep.yaml"


def recent_reward(out: Path, trial: str, last: int = 3) -> float:
    """Mean ``objective/scores`` of a trial's last ``last`` updates."""
    with open(out / "trials" / trial / "metrics.csv") as f:
        scores = [float(row["objective/scores"]) for row in csv.DictReader(f)]
    return sum(scores[-last:]) / len(scores[-last:])


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_example_sweep_trials_learn_visibly_different_curves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example writes to out/sweep under the current folder
    assert main(["sweep", str(EXAMPLE), "--no-progress"]) == 0
    out = tmp_path / "out" / "sweep"
    trials = json.loads((out / "summary.json").read_text())["trials"]
    assert set(trials) == {"kl0.01", "kl0.5", "lr1e-4"}
    best = trials["kl0.01"]
    assert best["state"] == "finished" and best["updates"] == 40
    assert recent_reward(out, "kl0.01") > best["reward_first"] + 0.1  # it learns
    assert best["kl_last"] > 0.5  # and moves away from the reference
    for name in ("kl0.5", "lr1e-4"):  # clearly behind: early stopping ends them
        assert recent_reward(out, "kl0.01") > recent_reward(out, name) + 0.1, name
        assert trials[name]["state"] == "early_stopped", (name, trials[name])
