"""`rapidfire env`: the bug-report summary, as text and JSON."""

from __future__ import annotations

import json
import platform

import torch
import transformers

import rapidfire_hf
from rapidfire_hf.cli.env import CORE_PACKAGES, OPTIONAL_PACKAGES
from rapidfire_hf.cli.main import main
from rapidfire_hf.utils.imports import is_available


def test_env_json_reports_versions_and_machine(capsys, monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_MEMORY_OPTIMIZATION", "aggressive")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # torch's current name
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rapidfire_hf"] == rapidfire_hf.__version__
    assert platform.python_version() in info["python"]
    assert info["torch"]["version"] == torch.__version__
    assert info["torch"]["cuda_available"] == torch.cuda.is_available()
    assert len(info["torch"]["devices"]) >= torch.cuda.device_count()
    assert info["packages"]["transformers"] == transformers.__version__
    assert set(info["packages"]) == set(CORE_PACKAGES)
    assert info["cpu_count"] >= 1 and info["memory"]["total_gib"] > 0
    assert info["settings"]["RAPIDFIRE_MEMORY_OPTIMIZATION"] == "aggressive"
    assert info["settings"]["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


def test_env_optional_packages_match_is_available(capsys):
    assert main(["env", "--json"]) == 0
    optional = json.loads(capsys.readouterr().out)["optional"]
    assert list(optional) == list(OPTIONAL_PACKAGES)
    for name, status in optional.items():
        assert (status != "not installed") == is_available(name), name


def test_env_text_lists_the_same_items(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"- rapidfire_hf: {rapidfire_hf.__version__}" in out
    assert f"  - torch: {torch.__version__}" in out
    for name in (
        "platform",
        "cpu_count",
        "memory",
        "trl",
        "peft",
        "datasets",
        "accelerate",
        "liger_kernel",
        "pynvml",
    ):
        assert f"- {name}:" in out, name
