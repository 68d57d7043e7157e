"""benchmarks/kernels/run.py --smoke (Triton's interpreter on the CPU) writes its results, correct rows."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "run.py"
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.slow  # the interpreter runs the 7B-shaped attention tile by tile (~20 s)
def test_smoke_run_writes_results_and_every_kernel_matches_its_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--out", str(tmp_path), "--smoke"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_info.value.code == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["kernel"], r["impl"]) for r in rows} == {
        ("attention", "sdpa"),
        ("attention", "matmul"),
        ("attention", "triton"),
        ("sampling", "torch"),
        ("sampling", "triton"),
        ("sampling", "triton-philox"),
    }
    for row in rows:
        assert row["ms"] > 0
        if row["max_abs_diff"] is not None:
            assert row["max_abs_diff"] < 1e-5, row
        if row.get("same_tokens") is not None:
            assert row["same_tokens"], row
    assert (tmp_path / "results.csv").stat().st_size > 0 and (tmp_path / "kernels.png").stat().st_size > 0
