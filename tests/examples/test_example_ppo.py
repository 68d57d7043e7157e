"""examples/ppo.py on CPU: --rapidfire_config takes a preset, a YAML file or JSON; several processes form one
DDP job with --use_cpu and stop with a message naming that flag without it (never duplicate jobs)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "ppo.py"
TINY = [
    "--report_to", "none", "--num_prompts", "32", "--per_device_train_batch_size", "4",
    "--gradient_accumulation_steps", "1", "--num_mini_batches", "1", "--response_length", "6",
    "--disable_tqdm", "true",
]  # fmt: skip


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("example_ppo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["example_ppo"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("balanced", "balanced"),
        ("config/advanced.yaml", "config/advanced.yaml"),
        ('{"gradient_pipeline": true}', {"gradient_pipeline": True}),
    ],
)
def test_rapidfire_config_parses(example, tmp_path, monkeypatch, value, expected):
    monkeypatch.chdir(REPO)
    _, args = example.parse_args(["--output_dir", str(tmp_path), "--rapidfire_config", value, *TINY])
    assert args.rapidfire_config == expected


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("balancd", "did you mean 'balanced'"),
        ("missing.yaml", "config file not found"),
        ("{x", "not valid JSON"),
    ],
)
def test_bad_rapidfire_config_is_an_argparse_error(example, tmp_path, capsys, value, says):
    with pytest.raises(SystemExit) as info:
        example.parse_args(["--output_dir", str(tmp_path), "--rapidfire_config", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --rapidfire_config" in err and says in err and "invalid Any value" not in err


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


@pytest.mark.slow
def test_runs_with_a_preset_and_a_yaml_file(tmp_path):
    for value in ("balanced", "config/advanced.yaml"):
        out = tmp_path / value.replace("/", "_")
        cmd = [sys.executable, str(SCRIPT), "--output_dir", str(out), "--max_steps", "1", "--use_cpu", *TINY]
        proc = subprocess.run(
            cmd + ["--rapidfire_config", value],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (out / "config.json").is_file() or (out / "policy" / "config.json").is_file()


def _torchrun(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
        "--output_dir", str(out), "--max_steps", "1", "--save_strategy", "steps", "--save_steps", "1", *TINY,
        *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the duplicate-job case needs a machine without a GPU"
)
@pytest.mark.slow  # 15 s on a 2-core CPU
def test_two_cpu_processes_without_use_cpu_stop_naming_the_flag(tmp_path):
    proc = _torchrun(tmp_path / "out")
    assert proc.returncode != 0
    assert "add --use_cpu" in proc.stderr and "duplicating the run" in proc.stderr
    assert not (tmp_path / "out" / "checkpoint-1").exists()


@pytest.mark.slow
def test_two_cpu_processes_with_use_cpu_form_one_ddp_job(tmp_path):
    proc = _torchrun(tmp_path / "out", "--use_cpu")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ckpt = tmp_path / "out" / "checkpoint-1"
    assert json.loads((ckpt / "checkpoint_manifest.json").read_text())["num_processes"] == 2
    assert (ckpt / "rng_state_0.pt").is_file() and (ckpt / "rng_state_1.pt").is_file()
