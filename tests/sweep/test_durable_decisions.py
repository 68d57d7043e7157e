"""Decisions survive a kill: a sweep whose trials are cloned, stopped and resumed by callbacks, by the
control file and by successive halving, SIGKILLed right after (or just before) each decision is journaled,
mid-update or while its index is replaced, resumes to the uninterrupted run's trials (CPU fp32, bit-exact:
adapters, value heads, curves, states, reasons, the rule's decisions). And a stopping rule whose metric is
not logged, or that a trial's logging_steps would leave without values, is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidfire_hf.sweep.checkpoint import INDEX
from rapidfire_hf.sweep.control import EarlyStopping, SuccessiveHalving
from rapidfire_hf.sweep.journal import JOURNAL, JournalError, read_journal
from rapidfire_hf.sweep.sweep import SweepError

from .decide import CountUpdates, decide_sweep
from .helpers import TRIALS, curves, make_sweep, max_abs_diff

ROOT = Path(__file__).resolve().parents[2]


def _snapshot(sweep) -> dict:
    trials = {
        n: (curves(t.state.log_history), sweep.adapter_state_dict(n), t.value_head.state_dict(),
            (t.status, t.reason, t.pinned, t.state.global_step))
        for n, t in sweep.trials.items()
    }  # fmt: skip
    return {"trials": trials, "decisions": [list(d.items()) for d in sweep.rules[0].decisions]}


def _same(got: dict, want: dict) -> None:
    assert got["trials"].keys() == want["trials"].keys()
    for name, (curve, adapter, head, state) in want["trials"].items():
        g = got["trials"][name]
        assert g[3] == state, name
        assert g[0] == curve, name
        assert max_abs_diff(g[1], adapter) == 0.0, name
        assert max_abs_diff(g[2], head) == 0.0, name
    assert got["decisions"] == want["decisions"]


@pytest.fixture(scope="module")
def uninterrupted(tokenizer, tmp_path_factory):
    torch.set_num_threads(1)
    sweep = decide_sweep(tokenizer, tmp_path_factory.mktemp("whole"))
    sweep.train()
    states = {n: (t.status, t.state.global_step, t.pinned) for n, t in sweep.trials.items()}
    # the scenario of tests/sweep/decide.py took every kind of decision
    assert states == {"A": ("early_stopped", 4, False), "B": ("early_stopped", 3, False),
                      "C": ("finished", 5, True), "A-fast": ("stopped", 2, False)}  # fmt: skip
    return _snapshot(sweep)


# (where, target, n, updates run after the resume): after the clone is queued by its callback (not made);
# after A-fast's stop is queued at update 2, before that round's save; with the clone's checkpoint and index
# written but before its journal line; after the control file's stop of C (applied, the control line not yet
# written); after the resume of C is queued; after successive halving's record at update 3, before its stop;
# after B's stop; after the second cut's record (A, cut retroactively when C reaches update 3); right after
# the save of round 4 is journaled; the index replaced a 5th time; in the 4th update's PPO epochs. The
# uninterrupted sweep runs 5 + 3 + 4 + 1 = 13 updates; a resume runs those after its last complete save.
KILLS = [
    ("after", "queued", 1, 13),
    ("after", "queued", 2, 13),
    ("before", "clone", 1, 13),
    ("after", "stop", 1, 6),
    ("after", "queued", 3, 6),
    ("after", "rule", 1, 6),
    ("after", "stop", 3, 6),
    ("after", "rule", 2, 2),
    ("after", "saved", 3, 2),
    ("replace", INDEX, 5, 6),
    ("optimize", "-", 4, 6),
]


def run_killed(out: Path, where: str, target: str, n: int) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "tests.sweep.decide", str(out), where, target, str(n)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("where", "target", "n", "left"), KILLS, ids=[f"{k[0]}-{k[1]}-{k[2]}" for k in KILLS])
@pytest.mark.usefixtures("single_thread")
def test_resume_after_sigkill_at_a_decision_equals_the_uninterrupted_sweep(
    tokenizer, tmp_path, uninterrupted, where, target, n, left
):
    run = run_killed(tmp_path, where, target, n)
    assert run.returncode == -9, run.stderr[-2000:]  # killed, not finished
    resumed = decide_sweep(tokenizer, tmp_path)
    resumed.train(resume_from_checkpoint=True)
    _same(_snapshot(resumed), uninterrupted)
    updates = next(cb for cb in resumed.callbacks if isinstance(cb, CountUpdates)).updates
    assert updates == left, updates  # only the updates the checkpoints lacked were run again


def test_a_damaged_journal_line_is_refused_by_name(tmp_path):
    path = tmp_path / JOURNAL
    path.write_text('{"op": "begin", "sweep_id": "x", "control_offset": 0, "statuses": {}}\nnot json\n{"op": "control", "offset": 0}\n')
    with pytest.raises(JournalError, match=f"{JOURNAL} line 2"):
        read_journal(tmp_path)
    # a line a kill cut short is a decision not taken: dropped, at the end or ended by the next writer
    path.write_text('{"op": "begin", "sweep_id": "x", "control_offset": 0, "statuses": {}}\n{"op": "stop", "tri\n{"op": "control", "offset": 3}\n{"op": "sto')
    assert [e["op"] for e in read_journal(tmp_path)] == ["begin", "control"]


@pytest.mark.usefixtures("single_thread")
def test_a_rule_metric_no_trial_logs_is_refused_by_name(tokenizer, tmp_path):
    sweep = make_sweep(tokenizer, tmp_path, {"a": TRIALS["kl0.01"], "b": TRIALS["kl0.2-lr3"]}, max_steps=2)
    sweep.early_stopping = SuccessiveHalving(rungs=(1,), metric="objective/score")
    with pytest.raises(SweepError, match=r"'objective/score', which trial 'a' does not log \(did you mean objective/scores"):
        sweep.train()
    assert all(t.state.log_history == [] for t in sweep.trials.values())  # refused before a rank of "none"


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        (SuccessiveHalving(rungs=(2, 3)), r"trial 'b' logs every 2 updates \(logging_steps\), not at update 3"),
        (EarlyStopping(after_updates=1), r"trial 'b' logs every 2 updates \(logging_steps\)"),
    ],
    ids=["halving", "early-stopping"],
)
def test_a_rule_a_trial_logging_steps_skips_is_refused(tokenizer, tmp_path, rule, problem):
    trials = {"a": {}, "b": {"logging_steps": 2}}
    with pytest.raises(ValueError, match=problem):
        make_sweep(tokenizer, tmp_path, trials, max_steps=4).early_stopping = rule
    sweep = make_sweep(tokenizer, tmp_path, {"a": {}}, max_steps=4)
    sweep.early_stopping = rule
    with pytest.raises(ValueError, match=problem.replace("'b'", "'c'")):  # a clone is checked too
        sweep.clone("a", "c", logging_steps=2)


def test_journal_lines_of_a_finished_sweep(tmp_path):
    """The journal of the uninterrupted scenario holds each decision once, in the order it was taken."""
    run = run_killed(tmp_path, "none", "-", 0)
    assert run.returncode == 0, run.stderr[-2000:]
    ops = [(e["op"], e.get("trial")) for e in read_journal(tmp_path)]
    assert ops.count(("stop", "B")) == 1 and ops.count(("stop", "A")) == 1 and ops.count(("clone", "A")) == 1
    assert json.loads((tmp_path / "summary.json").read_text())["decisions"][0]["stopped"] == ["B"]
