"""`rapidfire config validate|show|presets`, in process and through the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rapidfire_hf.cli.main import main
from rapidfire_hf.config import PRESETS, RapidFireConfig, load_config

REPO = Path(__file__).resolve().parents[2]
ADVANCED = REPO / "config" / "advanced.yaml"


@pytest.fixture(autouse=True)
def clean_env(no_rapidfire_env):
    """Tests start without RAPIDFIRE_* variables from the calling shell."""


@pytest.fixture()
def bad_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("gradient:\n  pipeline_depth: eight\n")
    return path


def test_validate_ok_prints_summary(capsys):
    assert main(["config", "validate", str(ADVANCED)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {ADVANCED} is a valid rapidfire_hf config")
    assert "pipeline on, depth 8, overlap 0.7" in out
    assert "grad_norm > 1.0 -> switch_to fp32; throughput < 100 -> disable_pipeline" in out


def test_validate_bad_file_exits_2_with_message(capsys, bad_file):
    assert main(["config", "validate", str(bad_file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        f"{bad_file}: gradient.pipeline_depth: invalid value; got 'eight' (str); allowed: an integer >= 1"
        in (captured.err)
    )


def test_validate_missing_file_and_preset_name_exit_2(capsys, tmp_path):
    assert main(["config", "validate", str(tmp_path / "none.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    # a bundled config file resolves by name from anywhere (config/balanced.yaml ships with the package)
    assert main(["config", "validate", "balanced"]) == 0
    assert main(["config", "validate", "no-such-config"]) == 2


def test_validate_ignores_env_unless_asked(capsys, monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_GRADIENT_PIPELINE_DEPTH", "0")
    assert main(["config", "validate", str(ADVANCED)]) == 0
    assert main(["config", "validate", "--with-env", str(ADVANCED)]) == 2
    assert "environment variable RAPIDFIRE_GRADIENT_PIPELINE_DEPTH" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["conservative", "balanced", "aggressive"])
def test_show_preset_json(capsys, name):
    assert main(["config", "show", "--preset", name, "--format", "json"]) == 0
    assert RapidFireConfig.from_dict(json.loads(capsys.readouterr().out)) == PRESETS[name]


def test_show_defaults_to_balanced_yaml(capsys):
    assert main(["config", "show"]) == 0
    assert RapidFireConfig.from_dict(yaml.safe_load(capsys.readouterr().out)) == RapidFireConfig()


def test_show_file_with_env_override(capsys, monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_GRADIENT_PIPELINE_DEPTH", "3")
    assert main(["config", "show", "--file", str(ADVANCED)]) == 0
    out = capsys.readouterr().out
    assert "# gradient.pipeline_depth set by RAPIDFIRE_GRADIENT_PIPELINE_DEPTH" in out
    shown = RapidFireConfig.from_dict(yaml.safe_load(out))
    assert shown.gradient.pipeline_depth == 3
    assert shown == load_config(ADVANCED)


def test_show_errors_exit_2(capsys, bad_file):
    assert main(["config", "show", "--preset", "agressive"]) == 2
    assert "did you mean 'aggressive'?" in capsys.readouterr().err
    assert main(["config", "show", "--file", str(bad_file)]) == 2


def test_presets_lists_each(capsys):
    assert main(["config", "presets"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == list(PRESETS)


def test_console_script_exit_codes(bad_file):
    script = shutil.which("rapidfire")
    assert script, "the rapidfire console script is not installed (pip install -e .)"
    ok = subprocess.run(
        [script, "config", "validate", str(ADVANCED)], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    assert "OK:" in ok.stdout
    bad = subprocess.run(
        [script, "config", "validate", str(bad_file)], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert "gradient.pipeline_depth" in bad.stderr and "'eight'" in bad.stderr
