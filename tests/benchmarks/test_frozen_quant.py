"""benchmarks/frozen_quant: the learning curves of PPO with the frozen models as given, in 8 and in 4 bits. The
script runs on the CPU at its smallest size and writes what its README describes; the README's numbers are
the stored results.json's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.benchmarks.loader import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks" / "frozen_quant"
bench = load_benchmark("frozen_quant/run.py")
needs_bnb = pytest.mark.skipif(
    not __import__("rapidfire_hf.utils.imports", fromlist=["is_available"]).is_available("bitsandbytes"),
    reason="bitsandbytes not installed",
)
ROW_KEYS = {"update", "seconds", "score", "kl", "policy_loss", "ref_logprob_max_abs_diff"}


@needs_bnb
def test_the_smallest_run_on_the_cpu_writes_three_curves(tmp_path):
    result = bench.main(["--out", str(tmp_path), "--updates", "2", "--batch", "4", "--micro", "4",
                         "--prompt-length", "4", "--response-length", "4", "--epochs", "1"])  # fmt: skip
    for name in ("results.json", "command.txt", "versions.json", "chart.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["summary"] == json.loads(json.dumps(result["summary"]))
    variants = stored["variants"]
    assert list(variants) == ["given", "8bit", "4bit"]
    for v in variants.values():
        assert v["updates_done"] == 2 and [r["update"] for r in v["rows"]] == [0, 1]
        assert all(set(r) == ROW_KEYS for r in v["rows"])
    # the frozen models are what each variant says, and only the quantized references differ from as given
    assert (
        variants["given"]["ref_quantized"] == "Linear" and variants["8bit"]["ref_quantized"] == "Linear8bitLt"
    )
    assert (
        variants["4bit"]["ref_quantized"] == "Linear4bit"
        and variants["4bit"]["reward_quantized"] == "Linear4bit"
    )
    assert all(r["ref_logprob_max_abs_diff"] == 0 for r in variants["given"]["rows"])
    assert all(r["ref_logprob_max_abs_diff"] > 0 for n in ("8bit", "4bit") for r in variants[n]["rows"])
    s = stored["summary"]
    assert s["updates_compared"] == 2 and set(s) == {"updates_compared", "given", "8bit", "4bit"}
    assert abs(s["given"]["kl_update0"]) < 1e-3  # the reference is the policy itself at update 0


def test_unknown_variants_and_shapes_are_refused(capsys):
    for argv in (["--variants", "given,int3"], ["--shape", "llama-99b"], ["--batch", "6", "--micro", "4"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", "x", *argv])
    err = capsys.readouterr().err
    assert "unknown int3" in err and "llama-99b" in err and "not divisible" in err


def _readme_rows() -> dict[str, list[str]]:
    text = (HERE / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in ("as given", "8bit", "4bit"):
            rows[{"as given": "given"}.get(cells[0], cells[0])] = cells[1:]
    return rows


def test_the_readme_numbers_are_the_stored_cpu_run():
    text = (HERE / "README.md").read_text()
    folder = re.search(r"results/(cpu_\d{4}-\d{2}-\d{2})", text).group(1)
    stored = json.loads((HERE / "results" / folder / "results.json").read_text())
    summary = stored["summary"]
    rows = _readme_rows()
    assert set(rows) == {"given", "8bit", "4bit"}
    for name, cells in rows.items():
        s = summary[name]
        want = [
            s["kl_update0"],
            s["kl_mean"],
            s["score_mean"],
            s["score_last"],
            s["ref_logprob_max_abs_diff"],
        ]
        assert cells[:5] == [f"{x:.4f}" for x in want], (name, cells)
        delta = s.get("score_mean_minus_given")
        assert cells[5] == ("—" if delta is None else f"{delta:+.4f}"), (name, cells)
    assert f"{summary['updates_compared']} updates" in text
    command = (HERE / "results" / folder / "command.txt").read_text().strip()
    assert command.split("run.py", 1)[1].strip() in text.replace(
        "\n    ", " "
    )  # the command is in the README


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--updates", "-1"], "--updates -1: must be at least 1"),
        (["--micro", "0"], "--micro 0: must be at least 1"),
        (["--lr", "0"], "--lr 0.0: must be a positive number"),
        (["--budget-s", "nan"], "--budget-s nan: must be a positive number"),
        (["--out", "/dev/null/x"], "--out /dev/null/x: cannot make the folder"),
    ],
)
def test_a_bad_argument_is_refused_in_one_line(tmp_path, capsys, extra, says):
    argv = ["--out", str(tmp_path / "out"), *extra]
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
