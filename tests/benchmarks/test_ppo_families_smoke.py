"""benchmarks/ppo_vs_trl with another decoder family as the policy (``--shape`` one of FAMILY_SHAPES): the
worker builds that family's classes (shrunk under ``--smoke``), runs our PPO update on it and records which
classes and which rollout path ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidfire_hf.demo.shapes import FAMILY_SHAPES, family_config

ROOT = Path(__file__).resolve().parents[2]


def test_family_shapes_have_their_published_sizes():
    # parameters of the published checkpoints (the configs' own vocabularies; embeddings tied where they are)
    published = {"gemma3-1b": 1.00e9, "olmo2-1b": 1.485e9, "phi3-mini": 3.82e9, "pythia-1b": 1.01e9}
    from transformers import AutoModelForCausalLM

    for name, params in published.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(family_config(name, 520))
        n = sum(p.numel() for p in model.parameters())
        assert abs(n - params) / params < 0.01, (name, n)
    assert set(published) < set(FAMILY_SHAPES)


def test_family_config_refuses_an_unknown_name_and_takes_overrides():
    with pytest.raises(KeyError, match="unknown family shape 'gemma9'"):
        family_config("gemma9", 64)
    conf = family_config("olmo2-1b", 64, hidden_size=32, num_hidden_layers=1)
    assert (conf.hidden_size, conf.num_hidden_layers, conf.pad_token_id, conf.num_labels) == (32, 1, 0, 1)


@pytest.mark.slow
def test_smoke_runs_our_ppo_update_on_the_family(tmp_path):
    # --smoke runs batch 8 for every system (stock only where TRL112_PATH is set); --only keeps ours, separate value
    cmd = [sys.executable, str(ROOT / "benchmarks/ppo_vs_trl/run.py"), "--out", str(tmp_path), "--smoke",
           "--shape", "olmo2-1b", "--part", "throughput", "--only", "tp_rapidfire"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600, cwd=ROOT)
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["status"] == "ok", row.get("error")
    assert row["ref_class"] == "Olmo2ForCausalLM"
    assert row["shape"] == "olmo2-1b" and row["tokens_per_s"] > 0
    assert row["rollout_backend"] in ("static", "hf", "generic")
