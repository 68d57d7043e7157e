"""benchmarks/rollout/families.py: --smoke builds every family's CPU-sized stand-in, checks greedy agreement
and times the engine against model.generate; the row plan puts the cheap comparisons first."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPT_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout"
pytestmark = pytest.mark.usefixtures("single_thread")


def _script(name: str):
    """A module of benchmarks/rollout/, imported as the scripts there import each other."""
    import importlib

    sys.path.insert(0, str(SCRIPT_DIR))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPT_DIR))


def _families():
    return _script("families")


@pytest.mark.slow  # six models built and run twice each on the CPU
def test_smoke_run_covers_every_family(tmp_path):
    fam = _families()
    assert fam.main(["--out", str(tmp_path), "--smoke"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["complete"] is True
    assert set(result["greedy_agreement"]) == set(fam.SHAPES)
    for name, agree in result["greedy_agreement"].items():
        assert agree["greedy_token_match_rate"] == 1.0, name  # fp32 on the CPU: exact
        assert agree["path"] == "native", name
    assert all(r["status"] == "ok" and r["ms_per_step"] > 0 for r in result["results"])
    summary = {e["family"]: e for e in result["summary"]}
    assert set(summary) == set(fam.SHAPES)
    assert all(e["per_byte_vs_llama"] > 0 and e["hf_dynamic_ms"] > 0 for e in summary.values())
    assert (tmp_path / "results.csv").read_text().count("\n") == 1 + 2 * len(fam.SHAPES)


def test_plan_runs_cheap_rows_first_and_unknown_names_are_refused(tmp_path, capsys):
    fam = _families()
    rows = fam.plan(["a", "b"], list(fam.SYSTEMS), [8, 64])
    assert len(rows) == 2 * 4 * 2 and len(set(rows)) == len(rows)
    costly = [i for i, (_, s, _) in enumerate(rows) if s in ("ours_compile", "hf_static")]
    assert min(costly) == 8  # every family's recorded step and dynamic generate come first
    assert [b for _, s, b in rows if s == "ours_compile"] == [8, 8, 64, 64]
    assert fam.main(["--out", str(tmp_path), "--smoke", "--families", "gpt2"]) == 2
    assert "unknown family/system gpt2" in capsys.readouterr().err


def test_smoke_times_the_sliding_ring_against_the_full_length_cache(tmp_path, capsys):
    """``--sliding-cache ring,full``: Gemma-3's stand-in (window 8) past its window, each of our systems on the
    ring and again on the old full-length masked cache (``@full``), compared in the summary."""
    fam = _families()
    argv = ["--out", str(tmp_path), "--smoke", "--families", "gemma3-1b", "--systems", "ours_eager",
            "--prompt-len", "8", "--new-tokens", "24", "--sliding-cache", "ring,full"]  # fmt: skip
    assert fam.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert [(r["system"], r["status"]) for r in result["results"]] == [
        ("ours_eager", "ok"),
        ("ours_eager@full", "ok"),
    ]
    (entry,) = [e for e in result["summary"] if "sliding" in e]
    assert entry["sliding"] == "ours_eager" and entry["full_over_ring"] > 0
    assert fam.main([*argv[:-1], "full"]) == 2
    assert "--sliding-cache 'full': 'ring' or 'ring,full'" in capsys.readouterr().err


def test_the_full_system_runs_the_full_length_cache():
    import torch

    _timing = _script("_timing")
    fam = _families()
    model = fam.build_model("gemma3-1b", "cpu", torch.float32, smoke=True, max_positions=64)
    ids, mask = torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    # the prompt padded to the bucket of 32, then 32 tokens: a local layer's ring 8 slots, else 64
    for system, slots in (("ours_eager", [8, 64]), ("ours_eager@full", [64, 64])):
        run = _timing._runner(model, system, ids, mask)
        run(32, None)
        assert [k.shape[2] for k in run.engine._static._buf.k] == slots, system


def test_smoke_times_each_forced_moe_form_against_the_engines_choice(tmp_path, capsys):
    """``--moe-form auto,gather,dense,grouped``: the MoE stand-in's step once per forced expert form
    (``system@form``), a dense family not (it has no routed layer), each form over auto in the summary."""
    fam = _families()
    argv = ["--out", str(tmp_path), "--smoke", "--families", "qwen3moe-12l,llama-1.1b", "--systems", "ours_eager",
            "--moe-form", "auto,gather,dense,grouped"]  # fmt: skip
    assert fam.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["moe_form"] == ["auto", "gather", "dense", "grouped"]
    assert [(r["family"], r["system"], r["status"]) for r in result["results"]] == [
        ("qwen3moe-12l", s, "ok")
        for s in ("ours_eager", "ours_eager@gather", "ours_eager@dense", "ours_eager@grouped")
    ] + [("llama-1.1b", "ours_eager", "ok")]
    entries = [e for e in result["summary"] if "moe_form" in e]
    assert [e["moe_form"] for e in entries] == ["gather", "dense", "grouped"]
    for e in entries:
        assert e["system"] == "ours_eager" and e["batch"] == 2 and e["decode_mode_ran"] == "eager"
        assert e["over_auto"] == round(e["ms"] / e["auto_ms"], 3) and e["over_auto"] > 0
    for bad in ("grouped", "auto,sparse", "auto,gather,gather"):
        assert fam.main([*argv[:-1], bad]) == 2
        assert f"--moe-form {bad!r}: 'auto', then any of gather, dense, grouped" in capsys.readouterr().err


def test_a_moe_form_system_forces_that_form_on_the_engine():
    import torch

    _timing = _script("_timing")
    fam = _families()
    model = fam.build_model("qwen3moe-12l", "cpu", torch.float32, smoke=True, max_positions=64)
    ids, mask = torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    for system, form, sliding in (("ours_eager", None, "ring"), ("ours_eager@grouped", "grouped", "ring"),
                                  ("ours_eager@full@dense", "dense", "full")):  # fmt: skip
        net = _timing._runner(model, system, ids, mask).engine._static.net
        assert (net.moe_form, net.sliding_cache) == (form, sliding), system
    for system in ("ours_eager@sparse", "hf_dynamic@grouped", "ours_eager@gather@dense"):
        with pytest.raises(ValueError, match="an ours_ system takes @ring or @full, and/or an MoE form"):
            _timing._runner(model, system, ids, mask)
    with pytest.raises(ValueError, match="moe_form='gather': this model has no routed MoE layer"):
        _timing._runner(
            fam.build_model("llama-1.1b", "cpu", torch.float32, True, 64), "ours_eager@gather", ids, mask
        )
