"""`rapidfire plan`: the planner's table (or JSON) for a shape or a local model, no training; user
mistakes exit 2 with one line on stderr."""

from __future__ import annotations

import json
import re

import pytest

from rapidfire_hf.cli.main import main

# rollout batch 8, one mini-batch of four micro-batches of 2 rows, 8 + 8 tokens: all four fit in one forward
SMALL = ["--batch", "8", "--micro", "2", "--prompt-length", "8", "--response-length", "8"]


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Single-threaded: the tiny models are faster that way on the shared cores."""


def row(out: str, setting: str) -> list[str]:
    """``[asked, chosen, why...]`` of one setting of the printed table."""
    line = next(x for x in out.splitlines() if x.strip().startswith(setting))
    return re.split(r"\s{2,}", line.strip()[len(setting) :].strip())


def test_smoke_shape_prints_the_plan(tmp_path, capsys):
    assert main(["plan", "--shape", "smoke", *SMALL, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "policy smoke" in out and "rapidfire plan (memory.optimization=balanced" in out
    asked, chosen, why = row(out, "training micro-batch (rows)")
    assert (asked, chosen) == ("2", "8") and why.startswith("4 of your micro-batches per forward")
    assert row(out, "activation checkpointing") == ["auto", "none", "fits without recompute"]
    assert (tmp_path / "rapidfire_plan_probe.json").is_file()  # the probe is cached in --output-dir


def test_json_and_an_explicit_score_chunk(capsys):
    assert main(["plan", *SMALL, "--score-chunk", "3", "--json", "--value-mode", "fused"]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out)  # nothing but the JSON on stdout: no table, no description line
    assert plan["train_rows"] == 8 and plan["merge"] == 4 and plan["fits"]
    assert plan["scoring_rows"] == 3 and plan["asked"]["scoring_rows"] == 3
    assert plan["reasons"]["scoring_rows"] == "your local_rollout_forward_batch_size"


def test_explicit_chunks_in_the_table_and_a_local_model(capsys, tiny_model_dir):
    args = ["plan", "--model", str(tiny_model_dir), *SMALL, "--score-chunk", "3", "--generation-chunk", "5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "fused value" in out  # a local model gets a value head unless --value-mode separate
    assert row(out, "scoring chunk (rows)")[:2] == ["3", "3"]
    assert row(out, "generation chunk (prompts)")[:2] == ["5", "5"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--shape", "nope"], "unknown shape 'nope'; known: llama-15b, llama-7b, llama-1.1b"),
        (["--model", "{tmp}/nope"], "no such folder"),
        (["--model", "{tmp}"], "not a HF model folder (no config.json)"),
        (["--model", "{tmp}/garbage"], "not a HF causal LM folder"),
        (["--batch", "10", "--micro", "4"], "--batch 10 is not divisible by --micro 4"),
        (["--batch", "8", "--micro", "2", "--mini-batches", "3"], "not divisible by --mini-batches 3"),
        (["--config", "nope"], "unknown preset; got 'nope'"),
        (["--config", "{tmp}/missing.yaml"], "config file not found"),
        (["--score-chunk", "x"], "--score-chunk 'x': expected 'auto' or a positive integer"),
        (["--generation-chunk", "1.5"], "--generation-chunk '1.5': expected 'auto' or a positive integer"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(tmp_path, capsys, flags, message):
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "config.json").write_text('{"model_type": "no-such-model"}')
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert main(["plan", *flags]) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("rapidfire plan: error:")]
    assert len(err) == 1 and message in err[0], captured.err
    assert "Traceback" not in captured.err + captured.out


def test_the_readme_example_runs(capsys):
    """README's `rapidfire plan` line (Configuration and CLI) runs as written."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("rapidfire plan "))
    assert main(line.split()[1:]) == 0
    assert "fits without recompute" in capsys.readouterr().out
