"""`rapidfire sweep SWEEP.yaml`, `rapidfire sweep ctl` and `rapidfire demo --sweep` argument handling."""

from __future__ import annotations

import json

import pytest

from rapidfire_hf.cli.main import main
from rapidfire_hf.cli.sweep import demo_trials
from rapidfire_hf.config import ConfigError
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


def test_ctl_appends_commands(tmp_path, capsys):
    assert main(["sweep", "ctl", "--dir", str(tmp_path), "stop", "kl0.2"]) == 0
    assert main(["sweep", "ctl", "--dir", str(tmp_path), "clone", "a", "b", "learning_rate=2e-5"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "control.jsonl").read_text().splitlines()]
    assert lines == [
        {"op": "stop", "trial": "kl0.2"},
        {"op": "clone", "trial": "a", "new": "b", "overrides": {"learning_rate": 2e-5}},
    ]
    assert "next update boundary" in capsys.readouterr().out
    assert main(["sweep", "ctl", "--dir", str(tmp_path), "stop"]) == 2  # a one-line message, no traceback
    assert "usage: rapidfire sweep ctl" in capsys.readouterr().err


def test_demo_sweep_grid():
    trials = demo_trials(["kl_coef=0.01,0.2", "learning_rate=1e-3"])
    assert trials == {
        "kl_coef=0.01_learning_rate=0.001": {"kl_coef": 0.01, "learning_rate": 1e-3},
        "kl_coef=0.2_learning_rate=0.001": {"kl_coef": 0.2, "learning_rate": 1e-3},
    }
    assert isinstance(demo_trials(["kl_coef=1"])["kl_coef=1.0"]["kl_coef"], float)
    with pytest.raises(SystemExit, match="field=value"):
        demo_trials(["kl_coef"])
