"""`rapidfire sweep SWEEP.yaml`, `rapidfire sweep ctl` and `rapidfire demo --sweep` argument handling."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from rapidfire_hf.cli.main import main
from rapidfire_hf.cli.sweep import demo_trials
from rapidfire_hf.config.errors import ConfigError
from rapidfire_hf.sweep.spec import load_spec, validate

TINY = """
model: demo
dataset: demo
reward_funcs: [demo]
lora: {r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}
config:
  output_dir: OUT
  max_steps: 2
  per_device_train_batch_size: 4
  num_ppo_epochs: 1
  response_length: 6
  stop_token: eos
  use_cpu: true
  logging_steps: 1
trials:
  kl0.01: {kl_coef: 0.01}
  kl0.2: {kl_coef: 0.2, learning_rate: 2.0e-3}
"""


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_sweep_yaml_end_to_end(tmp_path, capsys):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(TINY.replace("OUT", str(tmp_path / "out")))
    assert main(["sweep", str(spec), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["trials"]
    assert set(summary) == {"kl0.01", "kl0.2"}
    assert summary["kl0.2"]["overrides"] == {"kl_coef": 0.2, "learning_rate": 2e-3}
    assert summary["kl0.2"]["updates"] == 2
    assert (tmp_path / "out" / "sweep_curves.png").is_file()
    assert "kl0.2: reward" in capsys.readouterr().out
    assert main(["sweep", "ctl", "--dir", str(tmp_path / "out"), "status"]) == 0
    assert "finished" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"trails": {}}, r"trails: unknown key \(did you mean trials"),
        ({"config": {"kl_coeff": 1}}, r"config.kl_coeff: unknown key \(did you mean kl_coef"),
        ({"trials": {"a": {"lr": 1}}}, r"trials.a.lr: unknown key"),
        ({"trials": {"a": {"temperature": 0.5}}}, r"trials.a.temperature: is shared by every trial"),
        ({"trials": {}}, r"trials: needs a mapping"),
        ({"reward_model": "x"}, r"exactly one of reward_funcs and reward_model"),
        ({"early_stopping": {"patience": 3}}, r"early_stopping.patience: unknown key"),
    ],
)
def test_spec_errors_name_the_key(edit, message):
    base = {"reward_funcs": ["demo"], "trials": {"a": {"kl_coef": 0.1}}}
    with pytest.raises(ConfigError, match=message):
        validate({**base, **edit})


def test_spec_file_errors_name_the_file(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("reward_funcs: [demo]\ntrials: {a: {kl_coef: 0.1, clip: 1}}\n")
    with pytest.raises(ConfigError, match="bad.yaml: trials.a.clip: unknown key"):
        load_spec(spec)


def _live_sweep(out, status="running", pid=None, **trial_states):
    """A sweep_state.json as a running sweep writes it (this process stands in for the sweep)."""
    out.mkdir(parents=True, exist_ok=True)
    trials = {
        n: {"state": st, "updates": 1, "num_updates": 3, "reward_last": 0.5} for n, st in trial_states.items()
    }
    state = {
        "format": 1,
        "status": status,
        "pid": pid or os.getpid(),
        "host": socket.gethostname(),
        "trials": trials,
    }
    (out / "sweep_state.json").write_text(json.dumps(state))


def _ctl(out, *words):
    return main(["sweep", "ctl", "--dir", str(out), *words])


def test_ctl_appends_checked_commands(tmp_path, capsys):
    _live_sweep(tmp_path, **{"kl0.2": "running", "a": "running", "done": "finished"})
    assert _ctl(tmp_path, "stop", "kl0.2") == 0
    assert _ctl(tmp_path, "clone", "a", "b", "learning_rate=2e-5", "lr_scheduler_kwargs={num_cycles: 2}") == 0
    lines = [json.loads(x) for x in (tmp_path / "control.jsonl").read_text().splitlines()]
    assert lines == [
        {"op": "stop", "trial": "kl0.2"},
        {"op": "clone", "trial": "a", "new": "b",
         "overrides": {"learning_rate": 2e-5, "lr_scheduler_kwargs": {"num_cycles": 2}}},
    ]  # fmt: skip
    assert "next update boundary" in capsys.readouterr().out
    assert _ctl(tmp_path, "stop") == 2  # a one-line message, no traceback
    assert "usage: rapidfire sweep ctl" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (("stop", "nope"), "no trial named 'nope'"),
        (("stop", "done"), "'done' is finished, not running"),
        (("resume", "a"), "only a stopped trial can be resumed"),
        (("clone", "nope", "b"), "no trial named 'nope'"),
        (("clone", "a", "done"), "'done' exists already"),
        (("clone", "a", "x/y"), "trial name 'x/y' is not allowed"),
        (("clone", "a", "b", "temperature=0.5"), "temperature is not a field a trial can set"),
        (("clone", "a", "b", "lr_scheduler_kwargs=oops"), "lr_scheduler_kwargs takes a mapping"),
        (("clone", "a", "b", "learning_rate=fast"), "learning_rate takes a number"),
        (("clone", "a", "b", "seed=1.5"), "seed takes an integer"),
        (("clone", "a", "b", "seed=1", "seed=2"), "seed is given twice"),
    ],
)
def test_ctl_refuses_commands_the_sweep_cannot_apply(tmp_path, capsys, words, message):
    _live_sweep(tmp_path, a="running", done="finished")
    assert _ctl(tmp_path, *words) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "control.jsonl").exists()


def test_ctl_refuses_folders_without_a_running_sweep(tmp_path, capsys):
    assert _ctl(tmp_path / "missing", "stop", "a") == 2
    assert "no such folder" in capsys.readouterr().err
    assert _ctl(tmp_path, "stop", "a") == 2
    assert "no sweep in" in capsys.readouterr().err
    _live_sweep(tmp_path / "done", status="finished", a="finished")
    assert _ctl(tmp_path / "done", "stop", "a") == 2
    assert "is not running (status 'finished')" in capsys.readouterr().err
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    _live_sweep(tmp_path / "killed", pid=int(dead.stdout), a="running")
    assert _ctl(tmp_path / "killed", "stop", "a") == 2
    assert "is gone" in capsys.readouterr().err


def test_ctl_status_of_a_half_written_or_foreign_state(tmp_path, capsys):
    _live_sweep(tmp_path, a="running")
    assert _ctl(tmp_path, "status") == 0
    assert "sweep running" in capsys.readouterr().out
    state = tmp_path / "sweep_state.json"
    state.write_text(state.read_text()[:40])  # what a plain write_text leaves when killed half-way
    assert _ctl(tmp_path, "status") == 2
    assert "sweep_state.json is not valid JSON" in capsys.readouterr().err
    for text in (b"\xff\xfe", b"[1, 2]", b'{"trials": 3}'):
        state.write_bytes(text)
        assert _ctl(tmp_path, "status") == 2
        assert "sweep_state.json" in capsys.readouterr().err


def test_ctl_imports_no_torch(tmp_path):
    """ctl answers at once because it imports neither torch nor transformers (9-12 s before)."""
    _live_sweep(tmp_path, a="running")
    code = (
        "import sys; from rapidfire_hf.cli.main import main; "
        f"rc = [main(['sweep', 'ctl', '--dir', {str(tmp_path)!r}, w, 'a']) for w in ('status', 'stop')]; "
        "heavy = [m for m in ('torch', 'transformers', 'peft') if m in sys.modules]; print(rc, heavy)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert run.stdout.strip().splitlines()[-1] == "[0, 0] []", run.stderr


def test_demo_sweep_grid():
    trials = demo_trials(["kl_coef=0.01,0.2", "learning_rate=1e-3"])
    assert trials == {
        "kl_coef=0.01_learning_rate=0.001": {"kl_coef": 0.01, "learning_rate": 1e-3},
        "kl_coef=0.2_learning_rate=0.001": {"kl_coef": 0.2, "learning_rate": 1e-3},
    }
    assert isinstance(demo_trials(["kl_coef=1"])["kl_coef=1.0"]["kl_coef"], float)
    with pytest.raises(SystemExit, match="field=value"):
        demo_trials(["kl_coef"])


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (["kl_coef=0.01,0.01"], "the value 0.01 of kl_coef is given twice"),
        (["kl_coef=0.01,1e-2"], "the value 0.01 of kl_coef is given twice"),
        (["kl_coef=0.01,0.2", "kl_coef=0.5"], "kl_coef is given by another --sweep too"),
        (["lr_scheduler_kwargs=oops"], "lr_scheduler_kwargs takes a mapping"),
        (["seed=" + "1" * 300], "characters long"),
        (["temperature=0.5,1"], "temperature is a field every trial shares"),
    ],
)
def test_demo_sweep_grid_refusals(grid, message):
    with pytest.raises(SystemExit, match=message):
        demo_trials(grid)


def test_ctl_line_after_an_unfinished_one_is_kept(tmp_path):
    from rapidfire_hf.sweep.control import ControlFile

    _live_sweep(tmp_path, a="running")
    reader = ControlFile(tmp_path)
    (tmp_path / "control.jsonl").write_bytes(b'{"op": "stop", "tri')  # a writer killed mid-line
    assert _ctl(tmp_path, "stop", "a") == 0
    assert [cmd for _, cmd, _ in reader.read()] == [("stop", "a", "ctl")]


@pytest.mark.usefixtures("single_thread")
def test_plan_prints_the_first_updates_plan_and_trains_nothing(tmp_path, capsys):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(TINY.replace("OUT", str(tmp_path / "out")))
    assert main(["sweep", str(spec), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "PPOSweep plan (memory.optimization=balanced" in out
    # two trials' micro-batches of 4 rows in one training forward (the demo's prompts fit the cap)
    assert "training rows per forward (all trials)  4      8" in out
    assert not (tmp_path / "out" / "summary.json").exists()  # nothing trained, nothing written
    assert main(["sweep", str(spec), "--plan", "--resume"]) == 2
    assert "--plan and --resume: give one" in capsys.readouterr().err


@pytest.mark.usefixtures("single_thread")
def test_the_readme_sweep_plan_line_runs_as_written(capsys, monkeypatch):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    line = next(x for x in (root / "README.md").read_text().splitlines() if x.startswith("rapidfire sweep "))
    monkeypatch.chdir(root)
    existed = (root / "out").exists()
    assert main(line.split("#")[0].split()[1:]) == 0
    assert "PPOSweep plan (memory.optimization=balanced" in capsys.readouterr().out
    assert existed or not (root / "out").exists()  # the plan writes no output folder into the checkout
